"""The process group's shared key-value store: the coordination service that
``jax.distributed.initialize`` starts on process 0, reached by every process over gRPC.

JAX uses it for its own bookkeeping and exposes no public API to it, so its client is
reached in one place, here (``jax._src.distributed.global_state.client``; the same
methods in jax 0.10 and 0.11). A call is one round trip to process 0: about 0.1 ms on one
machine (measured: 1000 ``try_get`` in 76-124 ms), cheap enough to poll once per step.
With one process there is no store: every function here then answers as an empty one.
"""

from __future__ import annotations

import contextlib


def _client():
    """The coordination client, or None when this process is not in a group."""
    from jax._src import distributed

    return distributed.global_state.client


def available() -> bool:
    return _client() is not None


def try_get(key: str) -> str | None:
    """The value of ``key``, or None if it was never set (does not wait)."""
    client = _client()
    if client is None:
        return None
    try:
        return client.key_value_try_get(key)
    except Exception as err:  # jax raises JaxRuntimeError NOT_FOUND for a missing key
        if "NOT_FOUND" in str(err):
            return None
        raise


def set_first(key: str, value: str) -> str:
    """Sets ``key`` unless some process already did; returns the value that holds (the
    first writer's): every process that calls it gets the same answer."""
    client = _client()
    if client is None:
        return value
    try:
        client.key_value_set(key, value)
        return value
    except Exception as err:  # ALREADY_EXISTS: an earlier writer's value stands
        if "ALREADY_EXISTS" not in str(err):
            raise
    return client.key_value_try_get(key)


def put(key: str, value: str) -> None:
    """Sets ``key`` to ``value``, replacing any earlier value."""
    client = _client()
    if client is not None:
        client.key_value_set(key, value, allow_overwrite=True)


def get_dir(prefix: str) -> dict[str, str]:
    """Every key under ``prefix`` (e.g. ``"jaxdist/progress/"``) with its value."""
    client = _client()
    if client is None:
        return {}
    return dict(client.key_value_dir_get(prefix))


def delete(key: str) -> None:
    client = _client()
    if client is not None:
        with contextlib.suppress(Exception):
            client.key_value_delete(key)


def live_processes(process_count: int) -> set[int] | None:
    """The process indices the service still hears heartbeats from (None: no group)."""
    client = _client()
    if client is None:
        return None
    return set(client.get_live_nodes(list(range(process_count))))


def wait_get(key: str, timeout_s: float) -> str:
    """The value of ``key``, waiting up to ``timeout_s`` for some process to set it;
    raises TimeoutError after that."""
    client = _client()
    try:
        return client.blocking_key_value_get(key, int(timeout_s * 1000))
    except Exception as err:  # jax raises JaxRuntimeError DEADLINE_EXCEEDED
        if "DEADLINE_EXCEEDED" in str(err):
            raise TimeoutError(f"no process set {key} within {timeout_s:g}s") from None
        raise


def barrier(name: str, timeout_s: float) -> None:
    """Every process waits here until all have arrived (the store's barrier: no device
    collective, so it works before and beside the training step)."""
    client = _client()
    if client is not None:
        client.wait_at_barrier(name, int(timeout_s * 1000))


def coordinator_address() -> str:
    """HOST:PORT of process 0's coordination service ("" without a group)."""
    from jax._src import distributed

    return distributed.global_state.coordinator_address or ""
