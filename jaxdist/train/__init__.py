"""The command line, ``python -m jaxdist.train``: the library (``jaxdist``) driven by a
typed config, and nothing the library needs. Nothing outside this folder imports it.

``trainer.py`` reads as the run's story (setup, mesh, data, state, step, restore, loop);
``config.py`` is the config and its YAML, ``flags.py`` its flags, ``config_checks.py``
what each value may be;
``build_model.py``, ``build_data.py``, ``optim.py`` and ``rules_file.py`` make the
library's inputs from it; ``loop.py`` is the loop; ``resume.py`` decides where a run
starts; ``run_sinks.py`` and ``run_health.py`` wire the reporting and the health;
``ending.py`` turns every way out into its exit code.
"""

from jaxdist.train.trainer import main, setup, train

__all__ = ["main", "setup", "train"]
