"""The trainer's side of checkpoints: where the run lives, whether it resumes, what a
checkpoint records besides the state, and the compilation cache that makes a restart
fast. The state itself is saved and restored by ``Parallel.save`` / ``Parallel.restore``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

import jax

import jaxdist
from jaxdist.checkpoint import lock, run_directory
from jaxdist.cluster import failures
from jaxdist.data import fingerprint
from jaxdist.data.text import default_cache_dir
from jaxdist.errors import JaxdistError
from jaxdist.sinks.goodput import earlier_last_step
from jaxdist.train import build_data
from jaxdist.train import config as config_lib
from jaxdist.train.config import Config, ConfigError
from jaxdist.train.factories import parse_model_args
from jaxdist.train.optim import effective_lr


@dataclass(frozen=True)
class Start:
    """Where the loop starts: the state, its step, and what an earlier attempt did."""

    state: jaxdist.TrainState
    step: int  # optimizer steps already taken (0: a fresh or restarted run)
    earlier_last_step: int  # the last step earlier attempts reached (resumed or restarted)
    # (role, the checkpoint's fingerprint, this run's) of each data file that differs,
    # trained on as --data-changed ok allows: announced in the log and metrics.jsonl
    data_changed: list[tuple[str, dict, dict]] = field(default_factory=list)


def use_compile_cache(setting: str, platform: str = "") -> Path | None:
    """JAX's persistent compilation cache: a restarted or requeued run loads its compiled
    programs instead of compiling them again (shared/jax-notes fact 10: 4.5 s -> 0.4 s for
    a 60-layer gradient on CPU). Programs that compile in under 0.5 s are not written
    (unless JAX's own JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS says otherwise).

    Off by default on the CPU ``platform``: a pipelined GPT's step loaded from the cache
    starts its collectives in another order on each device (its ppermutes and
    all-reduces: XLA:CPU rebuilds each collective with an ordering resource of its own),
    and XLA aborted the run in its rendezvous, while the same step compiled afresh ran
    (``tests/test_collective_order.py``). A directory given (``--compile-cache DIR``,
    ``JAX_COMPILATION_CACHE_DIR``) is used on CPU too: jaxdist's thread pool
    (``jaxdist.cluster.cpu_backend``) lets such runs finish as well. ``off`` is off even
    where JAX_COMPILATION_CACHE_DIR is set (slurm/*.sh set it)."""
    given = setting or os.environ.get("JAX_COMPILATION_CACHE_DIR")
    if setting == "off":  # JAX read JAX_COMPILATION_CACHE_DIR itself when it was imported
        jax.config.update("jax_compilation_cache_dir", None)
        return None
    if platform == "cpu" and not given:
        return None
    # --compile-cache, else JAX's own variable (slurm/*.sh set it), else the jaxdist cache
    path = Path(given or default_cache_dir() / "xla")
    jax.config.update("jax_compilation_cache_dir", str(path))
    if "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS" not in os.environ:  # JAX read it already
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)
    return path


def prepare_run_dir(config: Config, write: bool) -> tuple[Path | None, run_directory.Plan]:
    """The run directory (None: ``write=False``) and whether to resume from it. Process 0
    locks it (a second run on it exits 2: ``jaxdist.checkpoint.lock``; the caller
    releases it); every process checks; process 0 clears an earlier run on
    ``--overwrite``, then all wait."""
    if not write:
        return None, run_directory.Plan(resume=False, clear=False)
    cfg = config.train
    run_dir = run_directory.run_dir_path(cfg.run_dir, config.model.name, cfg.strategy)
    lock.take(run_dir)  # before it is read or cleared: a live run's files are not touched
    try:
        plan = run_directory.plan(run_dir, cfg.resume, cfg.overwrite)
        if plan.clear and jaxdist.is_main_process():
            run_directory.clear(run_dir)  # RUN_FILES and run_id: the lock stays
        jaxdist.barrier("jaxdist-run-dir")
    except BaseException:
        lock.release(run_dir)  # the caller has no run_dir yet to release
        raise
    return run_dir, plan


def start(
    dp: jaxdist.Parallel,
    run_dir: Path | None,
    plan: run_directory.Plan,
    config: Config,
    data: build_data.Data,
) -> Start:
    """The initial state, or the newest good checkpoint's (resharded to this layout),
    its data files checked against ``data``'s."""
    if plan.restart:
        return _restart(dp, run_dir, config, data)
    if not plan.resume:
        return Start(initial_state(dp, config, data), 0, 0)
    restored = dp.restore(run_dir / run_directory.CHECKPOINTS)
    _record_damaged(dp, run_dir)
    if restored is None:  # a checkpoint wins over --init-from: a resume never reloads it
        return Start(initial_state(dp, config, data), 0, 0)
    state, extra = restored
    step = int(jax.device_get(state.step).reshape(-1)[0])
    _say_what_changed(extra, config, step)
    changed = _check_data(extra, config, step, data.fingerprints)
    return Start(state, step, earlier_last_step(run_dir), changed)


def _record_damaged(dp: jaxdist.Parallel, run_dir: Path) -> None:
    """A damaged checkpoint passed over goes to failures.jsonl (recovered: an older one
    was used), so that a disk losing data shows in the run's record, not only in a log."""
    if not jaxdist.is_main_process():
        return
    for step, problem in dp.damaged_checkpoints:
        failure = failures.Failure(
            "corrupt_checkpoint", problem, step=step, host=failures.hostname(), recovered=True
        )
        failures.record(run_dir, failure)


def initial_state(dp: jaxdist.Parallel, config: Config, data: build_data.Data):
    """Step 0's state: the model's own initialisation, or ``--init-from``'s weights
    (renamed by ``--init-map``) with a fresh optimizer."""
    state = dp.init_state()
    model = config.model
    if not model.init_from:
        return state
    from jaxdist import weights

    names = model_settings({"config": config_lib.to_dict(config), "data": data_settings(data)})
    state = weights.init_params(dp, state, model.init_from, weights.load(model.init_map), names)
    how = f"mapped by {model.init_map}" if model.init_map else "names as they are"
    jaxdist.print_main(f"jaxdist: parameters from {model.init_from} ({how})")
    return state


def check_init_from(model: config_lib.ModelConfig, plan: run_directory.Plan) -> None:
    """``--init-from``'s path and ``--init-map`` checked before data is prepared and the
    step compiled, where they will be read: not on a resume (a checkpoint wins)."""
    if not model.init_from or (plan.resume and not plan.restart):
        return
    from jaxdist import weights

    weights.load(model.init_map)  # a missing or malformed map: exit 2 now
    if not Path(model.init_from).exists():
        raise ConfigError(f"--init-from {model.init_from}: no such file or folder")


def model_settings(meta: dict) -> dict:
    """The model settings a weight map may name, from a run's record (a checkpoint's
    meta): its model config, its --model-args, and the vocabulary the run trained with
    (its data's, where the config left it 0); for the Llama, also what
    ``jaxdist.weights.maps.hf_llama.settings`` derives."""
    model = dict(meta.get("config", {}).get("model", {}))
    names = {**model, **parse_model_args(model.get("model_args", ""))}
    if not names.get("vocab_size"):
        names["vocab_size"] = meta.get("data", {}).get("vocab_size", 0)
    if names.get("name") in ("llama", "gemma"):  # defaults resolved, its maps' hf_* values
        from jaxdist.weights.maps import hf_llama

        names = hf_llama.settings(names)
    return names


def data_settings(data: build_data.Data) -> dict:
    return {"vocab_size": data.vocab_size}


def _restart(dp: jaxdist.Parallel, run_dir: Path, config: Config, data) -> Start:
    """An earlier attempt of this run stopped before its first checkpoint: step 0 again.
    Said, as a resume is: its logged steps are trained a second time."""
    earlier = earlier_last_step(run_dir)  # read before metrics.jsonl is replaced
    jaxdist.print_main(
        f"jaxdist: note: restarting run {run_directory.run_id()} in {run_dir} from step 0: an "
        f"earlier attempt reached step {earlier} and saved no checkpoint"
    )
    return Start(initial_state(dp, config, data), 0, earlier)


def extra(config: Config, step: int, data: build_data.Data) -> dict:
    """What a checkpoint records besides the state: the data position (with the seed and
    the global batch, the sampler's order is a function of the step), the fingerprint of
    each data file (by role; {} for synthetic data: a resume checks them) and the config."""
    cfg, examples = config.train, len(data.train)
    return {
        "data": {
            "step": step,
            "seed": cfg.seed,
            "global_batch_size": cfg.global_batch_size,
            "examples": examples,
            "epoch": step * cfg.global_batch_size // examples,
            "files": data.fingerprints,
            **data_settings(data),  # what --vocab-size 0 came to (jaxdist.export reads it)
        },
        "config": config_lib.to_dict(config),
    }


def _say_what_changed(extra: dict, config: Config, step: int) -> None:
    """A resumed run whose batch or seed differs from the checkpoint's trains on other
    rows from here, and its learning rate follows --lr-scaling: say so, never silently."""
    cfg, saved = config.train, extra.get("data", {})
    notes = []
    if saved.get("global_batch_size", cfg.global_batch_size) != cfg.global_batch_size:
        notes.append(
            f"the global batch is {cfg.global_batch_size}, the checkpoint's was "
            f"{saved['global_batch_size']}: batches from step {step + 1} differ from the "
            f"earlier run's, and the learning rate follows --lr-scaling "
            f"{config.optim.lr_scaling}{_peak_lrs(extra, config)}"
        )
    if saved.get("seed", cfg.seed) != cfg.seed:
        notes.append(f"--seed {cfg.seed} differs from the checkpoint's {saved['seed']}")
    for note in notes:
        jaxdist.print_main(f"jaxdist: note: resuming at step {step}: {note}")


def _check_data(
    extra: dict, config: Config, step: int, found: dict[str, dict]
) -> list[tuple[str, dict, dict]]:
    """The data files' fingerprints against the checkpoint's: a difference stops the run
    (JaxdistError: exit 2) unless --data-changed ok, which trains on and says so. Every
    process compares the same meta with the same files, so all stop alike."""
    saved = extra.get("data", {}).get("files")  # found: this run's (Data.fingerprints)
    if saved is None:  # a checkpoint of a jaxdist before fingerprints (or not the trainer's)
        if found and "data" in extra:
            jaxdist.print_main(
                f"jaxdist: note: resuming at step {step}: the checkpoint records no data "
                "fingerprints (an older jaxdist's): the data files are not checked"
            )
        return []
    changed = fingerprint.differences(saved, found)
    if changed and config.train.data_changed == "stop":
        role, before, now = changed[0]
        raise JaxdistError(
            f"{_data_name(config, role, now)} is not the data the checkpoint of step {step} "
            f"was trained on: it is {fingerprint.describe(now)}, the checkpoint recorded "
            f"{fingerprint.describe(before)}{_of(before, now)}; resumed, the run would not "
            "see the uninterrupted run's batches: restore the original file, or pass "
            "--data-changed ok to train on the new data anyway"
        )
    for role, before, now in changed:
        jaxdist.print_main(
            f"jaxdist: note: resuming at step {step} on changed data (--data-changed ok): "
            f"{_data_name(config, role, now)} is {fingerprint.describe(now)}, the checkpoint "
            f"recorded {fingerprint.describe(before)}{_of(before, now)}"
        )
    return changed


def _of(before: dict, now: dict) -> str:
    """`` (of old/x.bin)``: the checkpoint's file, where it was another path."""
    return "" if before["path"] == now["path"] else f" (of {before['path']})"


def _data_name(config: Config, role: str, found: dict) -> str:
    """How the command line names the source, ``--data x.bin`` or ``--eval-data y.bin``,
    with the file read where that is another (text and stdlib: their tokenised cache)."""
    d = config.data
    if role == "eval" and d.eval_path:
        name = d.eval_path
    else:
        name = (d.path or "stdlib") + (" (held-out split)" if role == "eval" else "")
    flag = "--eval-data" if role == "eval" and d.eval_path else "--data"
    same = Path(name) == Path(found["path"])
    return f"{flag} {name}" + ("" if same else f" (read from {found['path']})")


def _peak_lrs(extra: dict, config: Config) -> str:
    """``: peak 0.1, the checkpoint's 0.05``: the numbers, since scaling from a base of
    the global batch itself (``--base-batch-size 0``) leaves the rate unchanged."""
    now = effective_lr(config.optim, config.train.global_batch_size)
    try:  # the checkpoint's run, as it was configured
        saved = config_lib.from_dict(extra["config"])
        before = effective_lr(saved.optim, extra["data"]["global_batch_size"])
    except (KeyError, TypeError, ConfigError):  # a checkpoint without the trainer's config
        return f": peak {now:.3g}"
    return f": peak {now:.3g}, the checkpoint's {before:.3g}"
