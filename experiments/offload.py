"""How many bytes does ``--offload`` take off the device in a GPT's training step?

Command:   python experiments/offload.py [--mesh fsdp=1] [--out offload.jsonl]        # a GPU
           python experiments/offload.py --cpu-devices 8 --mesh fsdp=8 --small       # CPU
Hardware:  one GPU (or several: --mesh fsdp=N) for every variant; on CPU only the variants
           CPU supports run (optimizer, params), the others print the refusal.
Measures:  per variant (none; optimizer; optimizer,params, which needs fsdp > 1;
           activations; all three), each in its own process (so the device's peak is its
           own): the compiled step's ``memory_analysis()`` (device and host argument,
           output, temp bytes), its arguments by memory kind as the entry layout places them
           (``jaxdist.parallel.offload.argument_bytes``), the device's peak bytes in use after
           ``--steps`` steps (GPU only; CPU reports none), the median step time, the losses.
           A GPT with a Stack of blocks (``--remat block`` for every variant), AdamW, random
           tokens.
Expected:  equal losses in every variant. optimizer: device argument bytes fall by AdamW's
           moments, 8 bytes per parameter (divided by fsdp), host argument bytes rise by as
           much; optimizer,params: by another 4 bytes per parameter over fsdp; activations
           (GPU): device temp bytes fall by the blocks' saved matmul outputs (host temp
           bytes appear), the step slower by the copies. On CPU host and device memory are
           the same RAM: the placement shows in the entry layout, not in the peak.
Measured:  CPU, jax 0.10.2 (shared 2-core machine, 8 emulated devices, --small: 437,760
           parameters, --mesh fsdp=8), arguments per device from the entry layout: none
           693,064 B device; optimizer 233,796 B device + 459,268 B host; optimizer,params
           4,164 B device (the batch, the step counter) + 688,900 B host; the same temp bytes
           (CPU does not move anything) and identical losses; activations refused on CPU.
           GPU: not yet run (no GPU was lent to the task that wrote it).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time

VARIANTS = ("none", "optimizer", "optimizer,params", "activations", "optimizer,params,activations")
FULL = dict(vocab=50304, seq=1024, d_model=1024, layers=8, heads=16, rows=8)
SMALL = dict(vocab=256, seq=64, d_model=128, layers=2, heads=4, rows=16)
MEMORY_FIELDS = (
    "argument_size_in_bytes",
    "output_size_in_bytes",
    "alias_size_in_bytes",
    "temp_size_in_bytes",
    "host_argument_size_in_bytes",
    "host_output_size_in_bytes",
    "host_temp_size_in_bytes",
    "peak_memory_in_bytes",
)


def measure(variant: str, args) -> dict:
    """One variant in this process: the compiled step's bytes, then ``args.steps`` steps."""
    import jax
    import numpy as np
    import optax
    from flax import nnx

    import jaxdist
    from jaxdist.losses import next_token_loss
    from jaxdist.models import GPT
    from jaxdist.parallel import offload

    jaxdist.initialize(cpu_devices=args.cpu_devices)
    size = SMALL if args.small else FULL
    mesh = jaxdist.make_mesh(**{k: int(v) for k, v in (a.split("=") for a in args.mesh.split(","))})

    def model():
        return GPT(
            size["vocab"], size["seq"], size["d_model"], size["layers"], size["heads"],
            scan_layers=True, remat="block", rngs=nnx.Rngs(0),
        )  # fmt: skip

    names = () if variant == "none" else tuple(variant.split(","))
    try:
        tx = optax.adamw(3e-4)
        dp = jaxdist.DataParallel(model, tx, next_token_loss, mesh=mesh, offload=names)
    except jaxdist.ConfigError as refused:
        return {"variant": variant, "refused": str(refused)}
    rows = size["rows"] * mesh.shape["data"] * mesh.shape["fsdp"]
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, size["vocab"], (rows, size["seq"] + 1)).astype(np.int32)
    batch = jaxdist.shard_batch({"tokens": tokens}, mesh)
    compiled = dp.program(batch).compile()
    stats = compiled.memory_analysis()
    found = {f: getattr(stats, f, None) for f in MEMORY_FIELDS}
    found["entry_layout_bytes"] = offload.argument_bytes(compiled)
    state, losses, times = dp.init_state(), [], []
    for _ in range(args.steps):
        start = time.perf_counter()
        state, metrics = dp.step(state, batch)
        losses.append(float(metrics["loss"]))  # waits for the step
        times.append(time.perf_counter() - start)
    device_stats = jax.devices()[0].memory_stats() or {}
    return {
        "variant": variant,
        "device": f"{jax.devices()[0].device_kind} x{jax.device_count()}",
        "jax": jax.__version__,
        "parameters": sum(x.size for x in jax.tree.leaves(state.unpack().params)),
        **found,
        "peak_bytes_in_use": device_stats.get("peak_bytes_in_use"),
        "step_s_median": statistics.median(times[1:]) if len(times) > 1 else None,
        "losses": losses,
    }


def mib(n) -> str:
    return "-" if n is None else f"{n / 2**20:9.1f}"


def table(results: list[dict]) -> str:
    head = "variant                        dev arg MiB  host arg MiB  temp MiB  host temp MiB"
    lines = [head + "  peak MiB  step s   losses"]
    for r in results:
        if "refused" in r:
            lines.append(f"{r['variant']:30s} refused: {r['refused']}")
            continue
        layout = r["entry_layout_bytes"]
        step = "-" if r["step_s_median"] is None else f"{r['step_s_median']:.3f}"
        lines.append(
            f"{r['variant']:30s} {mib(layout['device'])}  {mib(layout['pinned_host'])}    "
            f"{mib(r['temp_size_in_bytes'])}  {mib(r['host_temp_size_in_bytes'])}     "
            f"{mib(r['peak_bytes_in_use'])}  {step:>6s}   {[round(x, 6) for x in r['losses']]}"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--cpu-devices", type=int, default=0, help="emulate N CPU devices")
    parser.add_argument("--mesh", default="fsdp=1", help="e.g. fsdp=8 or data=2,fsdp=4")
    parser.add_argument("--small", action="store_true", help="a GPT small enough for a CPU")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--variant", help="measure one variant here (the parent's child)")
    parser.add_argument("--out", help="write the results as JSON lines here")
    args = parser.parse_args()
    if args.variant:
        print(json.dumps(measure(args.variant, args)), flush=True)
        return
    results = []
    for variant in VARIANTS:
        command = [sys.executable, __file__, *sys.argv[1:], "--variant", variant]
        done = subprocess.run(command, capture_output=True, text=True)
        if done.returncode:
            results.append({"variant": variant, "refused": f"failed: {done.stderr[-800:]}"})
            continue
        results.append(json.loads(done.stdout.strip().splitlines()[-1]))
        print(f"{variant}: done", file=sys.stderr, flush=True)
    print(table(results))
    if args.out:
        with open(args.out, "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in results)


if __name__ == "__main__":
    main()
