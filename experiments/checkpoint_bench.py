"""How long does a checkpoint of a GPT-2 124M training state take, and a restart?

Command:   python experiments/checkpoint_bench.py [--cpu-devices 1] [--dir /tmp] [--repeats 3]
Hardware:  any; the figures below: a shared 2-core CPU (1 device), local disk, page cache
           warm (the restore reads what the save just wrote).
Measures:  the state of jaxdist's GPT at GPT-2 small size (vocabulary 50304, T 1024,
           d 768, 12 layers, 12 heads: 124.5M parameters; AdamW: params + mu + nu, float32,
           12 B x 124.5M = 1.49 GB), built by ``DataParallel.init_state`` and filled with
           noise (zero AdamW moments would compress to almost nothing on disk):
           1) fingerprint throughput (``jaxdist.checkpoint.fingerprints``, every array);
           2) ``Parallel.save``: the time it blocks the caller (fingerprints + copy off the
              devices) and the time until ``wait_for_saves`` returns (all on disk);
           3) ``Parallel.restore``: read, reshard and verify every fingerprint;
           4) time to the first step of the default GPT (``python -m jaxdist.train --model
              gpt --cpu-devices 8 --steps 1``): cold (a fresh ``--compile-cache``) and warm
              (the same cache again), wall time of the whole command and the trainer's own
              "first step, with compilation".
Expected:  fingerprints well above disk speed (they must not be what a save waits for); a
           save blocking about the fingerprint time plus a copy of 1.49 GB; restore about the
           save's total; warm start clearly below cold (compiles come from the cache).
Measured:  2-core CPU shared with other work (load average 4.7-6.6), 1 device, local disk;
           range over 3-4 runs, medians of 3 repeats each:
           fingerprints of the 1.49 GB: 0.63-0.98 s, 1.5-2.4 GB/s (first call, with its
           compile: 1.8-2.3 s); save blocks the caller 0.55-2.3 s (typically 1.0 s) and is
           on disk (1.32 GB after zstd) after 3.0-9.0 s (typically 5.6 s, 0.27 GB/s);
           restore with verification 4.8-10.9 s (typically 6 s). Default GPT, time to the
           first step: cold cache 3.5-6.3 s (whole command 10.5-15.0 s), warm cache
           0.7-2.1 s (whole command 3.9-10.5 s).
"""

from __future__ import annotations

import argparse
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

GPT2_SMALL = dict(vocab_size=50304, seq_len=1024, d_model=768, n_layers=12, n_heads=12)
FIRST_STEP = re.compile(r"first step, with compilation: ([\d.]+)s")


def build_state(cpu_devices: int):
    """(dp, state): a DataParallel of the 124M GPT with AdamW, and its initial state (made
    inside jit on the devices: no 124M-parameter model is built eagerly on the host)."""
    import jax
    import optax
    from flax import nnx

    import jaxdist
    from jaxdist.models.gpt import GPT

    jaxdist.initialize(cpu_devices=cpu_devices)

    def loss_fn(model, batch):  # never run here: the step is not compiled
        logits = model(batch["tokens"][:, :-1])
        return optax.softmax_cross_entropy_with_integer_labels(
            logits, batch["tokens"][:, 1:]
        ).mean()

    dp = jaxdist.DataParallel(
        lambda: GPT(**GPT2_SMALL, attention="xla", rngs=nnx.Rngs(0)),
        optax.adamw(3e-4),
        loss_fn,
        mesh=jaxdist.make_mesh(),
    )
    state = trained_like(dp.init_state())
    jax.block_until_ready(state)
    return dp, state


def trained_like(state):
    """Every float array filled with noise in [-0.5, 0.5): the initial AdamW moments are
    zeros, which orbax's zstd squeezes to almost nothing (1.49 GB -> 0.46 GB on disk),
    unlike a trained state's. A hash of the element index (jax.random's normal took 28 s
    here for 374M values)."""
    import jax
    import jax.numpy as jnp

    def noise(index: int, x):
        if not jnp.issubdtype(x.dtype, jnp.floating):
            return x
        bits = jax.lax.iota(jnp.uint32, x.size) * jnp.uint32(0x9E3779B1) + jnp.uint32(index)
        bits = (bits ^ (bits >> 15)) * jnp.uint32(0x85EBCA6B)
        bits = bits ^ (bits >> 13)
        one_to_two = jax.lax.bitcast_convert_type((bits >> 9) | 0x3F800000, jnp.float32)
        return (one_to_two - 1.5).reshape(x.shape).astype(x.dtype)

    leaves, treedef = jax.tree.flatten(state)
    filled = jax.jit(lambda xs: [noise(i, x) for i, x in enumerate(xs)], donate_argnums=0)
    return jax.tree.unflatten(treedef, filled(leaves))


def named_arrays(state) -> dict:
    import jax

    from jaxdist.parallel.layout import path_name

    return {path_name(path): x for path, x in jax.tree.leaves_with_path(state)}


def timed(fn, repeats: int) -> tuple[float, float]:
    """(first call's seconds, median of the next ``repeats``)."""
    times = []
    for _ in range(repeats + 1):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return times[0], statistics.median(times[1:])


def measure_checkpoints(cpu_devices: int, root: Path, repeats: int) -> list[tuple]:
    import jax

    from jaxdist.checkpoint.verify import fingerprints

    start = time.perf_counter()
    dp, state = build_state(cpu_devices)
    arrays = named_arrays(state)
    state_gb = sum(x.nbytes for x in arrays.values()) / 1e9
    params = sum(x.size for name, x in arrays.items() if name.startswith("params/"))
    rows = [("state built (init_state, with compile)", time.perf_counter() - start, None)]
    print(f"state: {params / 1e6:.1f}M parameters, {len(arrays)} arrays, {state_gb:.2f} GB")

    first, median = timed(lambda: fingerprints(arrays), repeats)
    rows += [("fingerprints, first call (with compile)", first, None)]
    rows += [("fingerprints", median, state_gb / median)]

    blocked, total = [], []
    for i in range(repeats):
        folder = root / f"save{i}"
        start = time.perf_counter()
        blocked.append(dp.save(state, folder, keep=1))
        dp.wait_for_saves()
        total.append(time.perf_counter() - start)
        if i < repeats - 1:
            shutil.rmtree(folder)
    on_disk_gb = sum(f.stat().st_size for f in folder.rglob("*") if f.is_file()) / 1e9
    total_s = statistics.median(total)
    rows += [("save: blocks the caller", statistics.median(blocked), None)]
    rows += [(f"save: on disk ({on_disk_gb:.2f} GB written)", total_s, state_gb / total_s)]

    def restore():
        restored, _ = dp.restore(folder)
        jax.block_until_ready(restored)

    first, median = timed(restore, repeats)
    rows += [("restore + verify, first (with compile)", first, None)]
    rows += [("restore + verify", median, state_gb / median)]
    return rows


def first_step(cache: str, run_dir: Path) -> tuple[float, float]:
    """(wall seconds of the whole command, the trainer's first step with compilation);
    ``cache``: a ``--compile-cache`` directory, or ``off``."""
    command = [sys.executable, "-m", "jaxdist.train", "--model", "gpt", "--cpu-devices", "8"]
    command += ["--steps", "1", "--run-dir", str(run_dir), "--compile-cache", str(cache)]
    start = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True, timeout=600)
    wall = time.perf_counter() - start
    if done.returncode:
        raise SystemExit(f"{' '.join(command)} failed:\n{done.stderr[-3000:]}")
    return wall, float(FIRST_STEP.search(done.stdout)[1])


def measure_first_steps(root: Path) -> list[tuple]:
    cache = str(root / "xla-cache")
    first_step("off", root / "prepare")  # prepares the corpus if needed; not timed
    rows = []
    for name in ("cold", "warm"):
        wall, step_s = first_step(cache, root / name)
        rows += [(f"default GPT, {name} cache: whole command", wall, None)]
        rows += [(f"default GPT, {name} cache: first step", step_s, None)]
    return rows


def show(rows: list[tuple]) -> None:
    print(f"{'measurement':48s} {'seconds':>8s} {'GB/s':>6s}")
    for name, seconds, rate in rows:
        print(f"{name:48s} {seconds:8.2f} {'' if rate is None else f'{rate:6.2f}'}")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--cpu-devices", type=int, default=1, help="devices (replicated state)")
    parser.add_argument("--dir", default=None, help="where checkpoints go (default: a temp dir)")
    parser.add_argument("--repeats", type=int, default=3, help="timed repeats (medians)")
    parser.add_argument("--skip-first-step", action="store_true", help="checkpoints only")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(dir=args.dir, prefix="checkpoint-bench-") as tmp:
        # The first-step runs are subprocesses; run them before this process joins JAX.
        rows = [] if args.skip_first_step else measure_first_steps(Path(tmp))
        rows = measure_checkpoints(args.cpu_devices, Path(tmp), args.repeats) + rows
        show(rows)


if __name__ == "__main__":
    main()
