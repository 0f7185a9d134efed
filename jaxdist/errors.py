"""Errors for bad input. The command prints them (no traceback) and exits with code 2."""


class JaxdistError(ValueError):
    """Bad input: a config value, a device count, a model or a loss that does not fit."""


class ConfigError(JaxdistError):
    """A bad key or value in the configuration (exit code 2)."""


class ModelError(JaxdistError):
    """A model, factory or loss function that does not meet jaxdist's contract."""
