"""Weights & Biases (``--wandb PROJECT[/RUN]``): the scalars TensorBoard gets, under the
same tags and at the same steps, and the resolved config as the W&B run's config.

Process 0 only (``jaxdist/train/run_sinks.py``), and only with a run directory: W&B's
files go to ``RUN_DIR/wandb/`` and the W&B run id to ``RUN_DIR/wandb_id``, so that a
resumed run (same run directory) continues the same W&B run. The W&B run starts at the
first logged step, when the run directory is made. ``wandb`` is an optional extra,
imported only here: ``prepare()`` checks it at set-up.

W&B never stops the run: the sink runs on the reporting thread, and an error from W&B
(no network, a refused login) prints one warning and turns the sink off.
"""

from __future__ import annotations

import os
import secrets
import string
from pathlib import Path

from jaxdist.cluster.failures import FAILED, OK, PREEMPTED
from jaxdist.errors import ConfigError
from jaxdist.sinks import Sink
from jaxdist.sinks.events import EvalMetrics, Resumed, Started, StepMetrics, Stopped
from jaxdist.sinks.tensorboard import NOT_PLOTTED, tag

ID_FILE = "wandb_id"  # in the run directory: the W&B run id a resume continues
ID_CHARS, ID_LENGTH = string.ascii_lowercase + string.digits, 8  # as W&B makes its ids
REFUSED = "/\\#?%:"  # characters W&B refuses in a project name
MAX_PROJECT = 128  # characters, W&B's limit
INSTALL = "pip install 'jaxdist[wandb]'"
NO_LOGIN_MODES = {"offline", "dryrun", "disabled"}  # W&B modes that need no account


def parse_target(text: str) -> tuple[str, str]:
    """``--wandb PROJECT[/RUN]`` -> (project, run name or ""); ConfigError naming the flag."""
    project, _, name = text.partition("/")
    usage = "use --wandb PROJECT or --wandb PROJECT/RUN_NAME"
    if "/" in name:
        raise ConfigError(
            f"--wandb {text!r}: more than one '/'; {usage} (the entity comes from "
            "WANDB_ENTITY or your W&B default)"
        )
    if not project.strip():
        raise ConfigError(f"--wandb {text!r}: the project name is empty; {usage}")
    if "/" in text and not name.strip():
        raise ConfigError(f"--wandb {text!r}: the run name after '/' is empty; {usage}")
    refused = sorted({c for c in project if c in REFUSED})
    if refused:
        raise ConfigError(
            f"--wandb {text!r}: W&B refuses {' '.join(refused)} in a project name "
            f"(none of {' '.join(REFUSED)})"
        )
    if len(project) > MAX_PROJECT:
        raise ConfigError(
            f"--wandb: the project name has {len(project)} characters; W&B takes at most "
            f"{MAX_PROJECT}"
        )
    return project, name


def prepare() -> None:
    """At set-up, on process 0, before any data: the package imports and, unless W&B runs
    offline, a login exists (W&B asks on a terminal now, not on the reporting thread)."""
    try:
        import wandb
    except ImportError:
        raise ConfigError(f"--wandb needs the wandb package: {INSTALL}") from None
    if getattr(wandb.setup().settings, "mode", "online") in NO_LOGIN_MODES:
        return
    try:
        wandb.login()
    except Exception as err:  # noqa: BLE001 - W&B's kinds vary by version; named below
        raise ConfigError(
            f"--wandb: no W&B login ({err}): run `wandb login` or set WANDB_API_KEY, or "
            "train with WANDB_MODE=offline and `wandb sync RUN_DIR/wandb/offline-run-*` later"
        ) from None


class WandbRun(Sink):
    """One W&B run fed from a run's events; ``project`` and ``name`` from
    ``parse_target`` (name "": the run directory's name)."""

    def __init__(self, run_dir: str | Path, project: str, name: str = ""):
        self.run_dir = Path(run_dir)
        # W&B's files: in WANDB_DIR where the user set it (a scratch disk, a quota), as W&B
        # itself does; else beside the run's own files. The run id stays in the run dir.
        self.files_dir = Path(os.environ.get("WANDB_DIR") or self.run_dir)
        self.path = self.files_dir / "wandb"  # named if a write fails
        self.project, self.name = project, name or self.run_dir.absolute().name
        self.config: dict = {}
        self.resumed = False
        self.run = None  # the wandb Run, from the first logged step
        self.first_step = 0  # steps below it were sent by an earlier attempt (online)
        self.off = False  # W&B failed once: the rest of the run goes without it
        self.stopped: Stopped | None = None

    def on_started(self, event: Started) -> None:
        self.config = event.config

    def on_resumed(self, event: Resumed) -> None:
        self.resumed = True  # the earlier attempt's W&B run goes on

    def on_step_metrics(self, event: StepMetrics) -> None:
        values = {
            tag(k): v
            for k, v in event.values.items()
            if k not in NOT_PLOTTED and not k.startswith("eval_") and _is_number(v)
        }
        self._log(event.step, values)

    def on_eval_metrics(self, event: EvalMetrics) -> None:
        self._log(event.step, {f"eval/{k}": v for k, v in event.values.items() if _is_number(v)})

    def on_stopped(self, event: Stopped) -> None:
        self.stopped = event

    def _log(self, step: int, values: dict) -> None:
        if self.off:
            return
        if self.run is None:
            self._start()
        # W&B takes steps in increasing order only: steps an earlier attempt already sent
        # (resumed from an older checkpoint) keep its values; a resume recomputes them.
        if self.run is None or step < self.first_step:
            return
        try:
            self.run.log({k: float(v) for k, v in values.items()}, step=step)
        except Exception as err:  # noqa: BLE001 - never the run's end
            self._give_up(err)

    def _start(self) -> None:
        import wandb

        run_id = self._run_id()
        try:
            self.files_dir.mkdir(parents=True, exist_ok=True)
            self.run = wandb.init(
                project=self.project,
                name=self.name,
                id=run_id,
                resume="allow",
                dir=str(self.files_dir),
                config=self.config,
                settings=wandb.Settings(console="off"),  # scalars and config only
            )
            self.first_step = self.run.step  # 0, or past an earlier attempt's steps
        except Exception as err:  # noqa: BLE001 - no network, a refused login: train on
            self._give_up(err)

    def _run_id(self) -> str:
        """The earlier attempt's id on a resume; a new one (written now) otherwise."""
        id_file = self.run_dir / ID_FILE
        if self.resumed and id_file.is_file():
            kept = id_file.read_text().strip()
            if kept:
                return kept
        run_id = "".join(secrets.choice(ID_CHARS) for _ in range(ID_LENGTH))
        self.run_dir.mkdir(parents=True, exist_ok=True)
        id_file.write_text(run_id + "\n")
        return run_id

    def _give_up(self, err: Exception) -> None:
        self.off = True
        print(
            f"jaxdist: warning: W&B failed ({type(err).__name__}: {err}); training goes on "
            f"without it (its local files: {self.path})",
            flush=True,
        )
        self._finish(FAILED)

    def close(self) -> None:
        """Ends the W&B run: finished, preempted (stopped early on a signal) or failed (a
        close without ``Stopped``: the run raised)."""
        if self.stopped is None:
            self._finish(FAILED)
        else:
            self._finish(PREEMPTED if self.stopped.early else OK, preempted=self.stopped.early)

    def _finish(self, exit_code: int, preempted: bool = False) -> None:
        run, self.run = self.run, None
        if run is None:
            return
        try:
            if preempted:  # W&B shows it preempted, not crashed; a resume continues it
                run.mark_preempting()
            run.finish(exit_code=exit_code)
        except Exception as err:  # noqa: BLE001 - the run's own end matters more
            print(f"jaxdist: warning: W&B could not finish its run: {err}", flush=True)


def _is_number(value) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)
