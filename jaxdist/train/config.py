"""Typed, nested run configuration: dataclasses, a YAML file, and CLI overrides.

Every leaf field is a CLI flag (``train.global_batch_size`` -> ``--global-batch-size``;
the dotted form ``--train.global_batch_size`` works too). Precedence: defaults < YAML < CLI.
Unknown keys and bad values raise ``ConfigError``; the command turns it into exit code 2.
"""

from __future__ import annotations

import argparse
import dataclasses
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml

from jaxdist.data import text
from jaxdist.errors import ConfigError
from jaxdist.train import flags
from jaxdist.train.architecture import ModelConfig, with_model_from_config
from jaxdist.train.config_checks import coerce, validate
from jaxdist.train.yaml_file import load_yaml

Strategy = Literal["pmap", "shard_map", "gspmd"]


@dataclass
class DataConfig:
    # "" = the task's default (lm: the standard library corpus; classify: synthetic), or
    # synthetic | grammar | stdlib | FILE.bin/.npy (tokens) | FILE.npz | text files, folders
    # or globs, comma-separated | package.module:factory (see jaxdist/train/build_data.py)
    path: str = field(default="", metadata={"flag": "--data"})
    eval_path: str = field(default="", metadata={"flag": "--eval-data"})  # held-out file
    token_dtype: Literal["auto", "uint16", "uint32"] = "auto"  # .bin ids; auto: sidecar
    npz_inputs: str = "x"  # .npz array names
    npz_labels: str = "y"
    eval_fraction: float = text.EVAL_FRACTION  # text: share of files held out (by file)
    last_batch: Literal["drop", "wrap"] = "drop"  # an epoch's last partial global batch
    prefetch: int = 2  # device batches built ahead by a background thread
    # >0: a grain source's per-example work in this many worker processes (grain's own)
    data_workers: int = 0
    cache_dir: str = ""  # prepared text; "" = $JAXDIST_CACHE or ~/.cache/jaxdist
    num_examples: int = 16384  # synthetic classification: training examples
    eval_examples: int = 2048  # synthetic classification: held-out examples


@dataclass
class OptimConfig:
    optimizer: Literal["adamw", "sgd"] = "adamw"
    lr: float = 3e-3  # at base_batch_size; scaled by lr_scaling to the global batch
    lr_scaling: Literal["none", "linear", "sqrt"] = "none"
    base_batch_size: int = 0  # 0: the global batch size (no scaling)
    warmup_steps: int = 10
    min_lr_ratio: float = 0.1  # cosine decays to lr * min_lr_ratio at the last step
    weight_decay: float = 0.01
    momentum: float = 0.9  # sgd only
    clip_norm: float = 1.0  # global-norm clipping; 0 disables


@dataclass
class TrainConfig:
    strategy: Strategy = "gspmd"
    steps: int = 200
    global_batch_size: int = 64  # across all devices and processes
    grad_accum: int = 1  # microbatches per device per optimizer step
    seed: int = 0
    log_every: int = 10
    run_dir: str = ""  # "" -> runs/<model>-<strategy>-<time>
    cpu_devices: int = 0  # >0: emulate this many CPU devices (set before jax starts)
    num_devices: int = 0  # >0: use only the first N devices; 0: all
    # the mesh, "data=2,fsdp=2,model=2" (axes data, stage, fsdp, model, seq; one may be -1);
    # "": every device on data. pmap takes data only.
    mesh: str = ""
    rules: str = ""  # YAML file of [regex on a param path, [axis or null per dim]] pairs
    # the model's own names for axes -> mesh axes: "tp=model,dp=data,kv=null" (null:
    # replicated on purpose); a name its annotations use that nothing maps is an error
    axis_names: str = ""
    # pipeline (--mesh stage=S): microbatches of the GPipe schedule; 0 = auto: the largest
    # count <= 4 x S that divides the rows each pipeline replica holds per step
    microbatches: int = 0
    # gpipe (M microbatches' activations alive), 1f1b (one, the forward run twice),
    # interleaved (V layer chunks per device: bubble (S-1)/(V*M+S-1))
    pipeline_schedule: Literal["gpipe", "1f1b", "interleaved"] = "gpipe"
    virtual_stages: int = 2  # interleaved: layer chunks per device (V)
    # ZeRO-1: AdamW's moments split over data, parameters whole: the gradient
    # reduce-scattered, the parameters all-gathered once a step
    shard_optimizer: bool = False
    # in host memory, comma-separated: optimizer, params (fsdp's), activations (saved)
    offload: str = ""
    save_params: str = ""  # write the final params to this .npz (process 0)
    eval_every: int = 0  # run the held-out set every N steps and at the end; 0 = never
    eval_batch_size: int = 0  # global; 0 = global_batch_size
    eval_batches: int = 0  # the first N held-out batches each evaluation; 0 = every one
    # a step whose loss or gradient is NaN/inf: halt (exit 1) or skip its update
    nan_policy: Literal["halt", "skip"] = "halt"
    # pmap/shard_map: a BatchNorm axis_name means the data axis (SyncBatchNorm); default:
    # each device's rows
    sync_batch_stats: bool = False
    # orbax checkpoints in RUN_DIR/checkpoints every N steps, at the end and on preemption
    # (SIGUSR1/SIGTERM); 0: only at the end and on preemption
    checkpoint_every: int = 500
    keep: int = 3  # the newest checkpoints kept
    # a checkpoint that cannot be written (no space, quota, read-only, ...): stop (exit 74)
    # or continue training and try again at the next one (the final one must succeed)
    checkpoint_failures: Literal["stop", "continue"] = "stop"
    # a resume whose data files differ from the checkpoint's (size, sampled content):
    # stop (exit 2), or ok (trains on, said in the log and in metrics.jsonl)
    data_changed: Literal["stop", "ok"] = "stop"
    # auto: continue from the newest good checkpoint in the run dir; never: refuse a run
    # dir that has checkpoints
    resume: Literal["auto", "never"] = "auto"
    overwrite: bool = False  # start afresh in a run dir that holds an earlier run
    # XLA's persistent compilation cache, shared by runs: "" = the jaxdist cache's xla/
    # ($JAXDIST_CACHE or ~/.cache/jaxdist), but none on CPU (train/resume.py); "off": none
    compile_cache: str = ""
    # what a run shows: TensorBoard event files in RUN_DIR/tb (process 0)
    tensorboard: bool = True
    wandb: str = ""  # "PROJECT[/RUN]": the same scalars to Weights & Biases (process 0)
    # "START:STOP": a jax.profiler trace of those steps in RUN_DIR/profile
    profile: str = ""
    profile_all_processes: bool = False  # every process traces (RUN_DIR/profile/process_N)
    peak_tflops: float = 0.0  # one device's peak, for MFU; 0: from the device table
    # compile the step for the devices present and print its memory per device against
    # their capacity and its FLOPs; exit 0 (fits) or 2 (does not); no data, no run dir
    dry_run: bool = False


@dataclass
class DistConfig:
    # The process group; empty: SLURM, mpirun, Kubernetes, then JAXDIST_* / MASTER_ADDR...
    # environment, else one (jaxdist/cluster/environment.py).
    # single: one process, whatever a scheduler's environment says (one run in an allocation)
    process_group: Literal["auto", "single"] = "auto"
    coordinator: str = ""  # HOST:PORT of process 0 (PyTorch: MASTER_ADDR:MASTER_PORT)
    num_processes: int = 0  # (PyTorch: WORLD_SIZE, counted in processes)
    process_id: int = -1  # (PyTorch: RANK)
    local_device_ids: str = ""  # "0,1": this process's GPUs (PyTorch: LOCAL_RANK)
    init_timeout: float = 300.0  # s to wait for every process to join
    heartbeat_timeout: float = 100.0  # s without a heartbeat before a peer counts as dead
    # where process 0's coordination service listens; "": the coordinator address's host
    # (JAX's default, every interface, under SLURM)
    coordinator_bind_address: str = ""
    # health (jaxdist.health.watchdog, agreement, replica_check, peers); off: JAX's own behaviour
    health: bool = True
    # s a training step or evaluation batch may take; 0: max(300 s, 20 x the median step)
    step_timeout: float = 0.0
    # s for set-up, the steps that compile and checkpoint saves
    slow_phase_timeout: float = 1800.0
    # compare the data-parallel replicas of every parameter every N steps and before each
    # checkpoint; 0: never
    check_replicas_every: int = 100


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    dist: DistConfig = field(default_factory=DistConfig)


SECTIONS = {f.name: f.type for f in dataclasses.fields(Config)}


def _section_classes() -> dict[str, type]:
    hints = typing.get_type_hints(Config)
    return {name: hints[name] for name in SECTIONS}


def _leaf_fields() -> list[tuple[str, dataclasses.Field, Any]]:
    """(section, field, resolved type) for every leaf of the config tree."""
    out = []
    for section, cls in _section_classes().items():
        hints = typing.get_type_hints(cls)
        out.extend((section, f, hints[f.name]) for f in dataclasses.fields(cls))
    return out


def from_dict(tree: dict) -> Config:
    """Builds a Config from a nested dict, refusing unknown sections and keys; the model
    section completed from ``model_from_config``'s file where it names one."""
    classes = _section_classes()
    sections = {}
    for name, values in with_model_from_config(tree or {}).items():
        if name not in classes:
            raise ConfigError(f"unknown config section {name!r}; allowed: {', '.join(classes)}")
        if not isinstance(values, dict):
            raise ConfigError(f"config section {name!r} must be a mapping, got {values!r}")
        cls = classes[name]
        hints = typing.get_type_hints(cls)
        for key in values:
            if key not in hints:
                raise ConfigError(
                    f"unknown config key {name}.{key}; allowed: {', '.join(sorted(hints))}"
                )
        sections[name] = cls(**{k: coerce(f"{name}.{k}", v, hints[k]) for k, v in values.items()})
    config = Config(**sections)
    validate(config)
    return config


def to_dict(config: Config) -> dict:
    return dataclasses.asdict(config)


def build_parser() -> argparse.ArgumentParser:
    """A flag for every leaf field (``jaxdist.train.flags``)."""
    return flags.build_parser(_leaf_fields())


def parse_args(argv: list[str] | None = None) -> Config:
    """CLI -> Config. Every error, argparse's included, is a ConfigError (``--help``
    still prints the help and exits 0)."""
    return from_dict(parse_tree(argv))


def parse_tree(argv: list[str] | None = None) -> dict[str, dict]:
    """The settings the user gave (``--config`` YAML, then the flags over it) as a
    nested dict, unchecked: what ``from_dict`` builds a Config from."""
    args = flags.parse(build_parser(), argv)
    tree: dict[str, dict] = {}
    if args.get("config"):
        loaded = load_yaml(Path(args["config"]))
        tree = {k: dict(v) if isinstance(v, dict) else v for k, v in loaded.items()}
    args.pop("config", None)
    for dotted, value in args.items():
        section, key = dotted.split(".", 1)
        tree.setdefault(section, {})[key] = value
    return tree


def save(config: Config, path: Path) -> None:
    """``RUN_DIR/config.yaml``: the resolved config, to rerun with ``--config``. Without
    its run directory: a file naming it would resume (or be refused by) that run instead
    of starting another. Without ``overwrite`` too: with ``--run-dir`` of this run, it
    would wipe the run instead of continuing it. The checkpoints' own copy of the config
    (``resume.extra``) keeps both."""
    tree = to_dict(config)
    tree["train"].update(run_dir="", overwrite=False)
    header = (
        "# The resolved config of the run in this directory. Rerunning this file\n"
        "# (--config FILE) starts a new run with the same settings; add\n"
        f"# --run-dir {path.parent} to continue this one instead.\n"
    )
    path.write_text(header + yaml.safe_dump(tree, sort_keys=False))
