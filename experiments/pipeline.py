"""What does each pipeline schedule cost per device? Memory and bubble of one GPT step.

Command:   python experiments/pipeline.py [--microbatches 8 16] [--steps 3] [--json rows.jsonl]
Hardware:  8 emulated CPU devices (data=2, stage=4) on a 2-core machine; on a GPU host
           the same command with --platform gpu needs 8 GPUs.
Measures:  per schedule (gpipe, 1f1b, interleaved with V=2) and microbatch count M, the
           compiled train step of the built-in GPT (d_model 256, 8 layers, 8 heads, 64 x 128
           tokens a step, SGD): XLA's temporaries per device and the peak (arguments +
           outputs + temporaries - aliased), the schedule's bubble (S-1)/(M+S-1) or
           (S-1)/(V*M+S-1), how many times each layer's forward runs per microbatch, and
           (with --steps N > 0) the median time of N steps after a first one. GPipe with
           --remat full is a fifth row: the other way to keep fewer activations.
Expected:  1f1b's temporaries are a fraction of GPipe's (85 against 565 MiB at M = 8: one
           microbatch's layer activations per stage and each stage's input per
           microbatch, against M + S - 1 microbatches' activations) and shrink with M
           (57 MiB at M = 16, GPipe's stay near 500). It runs the forward twice, as GPipe
           with --remat full does, which keeps about as little here (55 and 52 MiB);
           1f1b with --remat full keeps the least (49 and 47 MiB, F three times).
           Interleaved cuts the bubble (3/11 -> 3/19 at M = 8) and keeps GPipe's
           activations; its ticks send V M + S - 1 activations instead of M + S - 1, and it
           re-lays each stage's weights onto the ring every step (6 of 8 chunks move): the
           last lines give the re-lay's bytes, compiled alone. Collectives are per device
           per step, as jaxdist.parallel.hlo counts them. On CPU step times say little: the 8
           devices share 2 cores, so an idle stage costs nothing (no bubble to see).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import jax
import numpy as np

# (schedule, --remat): the three schedules, then the two with every block checkpointed
SCHEDULES = (
    ("gpipe", "none"), ("1f1b", "none"), ("interleaved", "none"), ("gpipe", "full"),
    ("1f1b", "full"),
)  # fmt: skip
STAGES, DATA, LAYERS, D_MODEL, SEQ, BATCH, VIRTUAL = 4, 2, 8, 256, 128, 64, 2


def measure(schedule: str, remat: str, microbatches: int, steps: int) -> dict:
    import optax
    from flax import nnx

    import jaxdist
    from jaxdist.models.gpt import GPT
    from jaxdist.parallel import hlo
    from jaxdist.parallel.strategies.pipeline import bubble_fraction

    def model():
        return GPT(256, SEQ, D_MODEL, LAYERS, 8, attention="xla", scan_layers=True,
                   remat=remat, rngs=nnx.Rngs(0))  # fmt: skip

    def loss_fn(model, batch):
        tokens = batch["tokens"]
        logits = model(tokens[:, :-1])
        return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()

    mesh = jaxdist.make_mesh(data=DATA, stage=STAGES)
    dp = jaxdist.Parallel(
        model, optax.sgd(0.1), loss_fn, mesh=mesh, microbatches=microbatches,
        pipeline_schedule=schedule, virtual_stages=VIRTUAL,
    )  # fmt: skip
    start = time.perf_counter()
    tokens = jax.ShapeDtypeStruct((BATCH, SEQ + 1), np.int32)
    compiled = dp.program({"tokens": tokens}).compile()
    memory = compiled.memory_analysis()
    peak = memory.argument_size_in_bytes + memory.output_size_in_bytes
    peak += memory.temp_size_in_bytes - memory.alias_size_in_bytes
    virtual = VIRTUAL if schedule == "interleaved" else 1
    sent = hlo.read_program(compiled.as_text(), mesh.size).bytes_by_kind()
    # forward runs of each layer per microbatch: 1f1b recomputes it in its backward pass,
    # remat full once more inside each block's backward
    forwards = (2 if schedule == "1f1b" else 1) + (remat == "full")
    row = {
        "schedule": schedule + (f" V={virtual}" if virtual > 1 else ""),
        "remat": remat,
        "M": microbatches,
        "temp_MiB": memory.temp_size_in_bytes / 2**20,
        "peak_MiB": peak / 2**20,
        "bubble": bubble_fraction(STAGES, microbatches, virtual),
        "F_per_microbatch": forwards,
        "collective_MiB": sum(sent.values()) / 2**20,
        "compile_s": time.perf_counter() - start,
        "step_s": time_steps(dp, mesh, steps) if steps else None,
        "describe": dp.pipeline.describe(),
        "relay": relay_cost(dp.program({"tokens": tokens}), mesh) if virtual > 1 else None,
    }
    return row


def relay_cost(program, mesh) -> dict:
    """The interleaved schedule's re-lay of the stacked weights alone, compiled: bytes a
    device sends (XLA's collectives) and the copy it holds, per step (the gradient
    goes back the same way)."""
    from jaxdist.parallel import hlo
    from jaxdist.parallel.strategies.pipeline_interleaved import relay

    stacked = [
        x for x in jax.tree.leaves(program.state.params)
        if len(x.sharding.spec) and x.sharding.spec[0] == "stage"
    ]  # fmt: skip
    fn = jax.jit(
        lambda xs: [relay(x, STAGES, VIRTUAL) for x in xs],
        out_shardings=[x.sharding for x in stacked],
    )
    compiled = fn.lower(stacked).compile()
    sent = hlo.read_program(compiled.as_text(), mesh.size).bytes_by_kind()
    return {
        "sent_MiB": sum(sent.values()) / 2**20,
        "kinds": sorted(sent),
        "copy_MiB": compiled.memory_analysis().output_size_in_bytes / 2**20,
    }


def time_steps(dp, mesh, steps: int) -> float:
    import jaxdist

    rng = np.random.default_rng(0)
    batch = {"tokens": rng.integers(0, 256, (BATCH, SEQ + 1), dtype=np.int32)}
    batch = jaxdist.shard_batch(batch, mesh)
    state, metrics = dp.step(dp.init_state(), batch)  # the first: compiles
    jax.block_until_ready(metrics)
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        state, metrics = dp.step(state, batch)
        jax.block_until_ready(metrics)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def table(rows: list[dict]) -> str:
    head = "| schedule | remat | M | temp / device | peak / device | bubble | F per microbatch |"
    head += " collectives / device | step (CPU) |\n|---|---|---|---|---|---|---|---|---|\n"
    lines = [
        f"| {r['schedule']} | {r['remat']} | {r['M']} | {r['temp_MiB']:.1f} MiB | "
        f"{r['peak_MiB']:.1f} MiB | {r['bubble']:.1%} | {r['F_per_microbatch']} | "
        f"{r['collective_MiB']:.1f} MiB | "
        + (f"{r['step_s']:.2f} s |" if r["step_s"] is not None else "- |")
        for r in rows
    ]
    return head + "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--microbatches", type=int, nargs="+", default=[8, 16])
    parser.add_argument("--steps", type=int, default=0, help="timed steps per row (0: none)")
    parser.add_argument("--platform", default="cpu")
    parser.add_argument("--json", help="append one JSON line per row")
    args = parser.parse_args()
    if args.platform == "cpu":
        jax.config.update("jax_platforms", "cpu")
        jax.config.update("jax_num_cpu_devices", STAGES * DATA)
    assert jax.device_count() == STAGES * DATA, jax.devices()
    rows = []
    for m in args.microbatches:
        for schedule, remat in SCHEDULES:
            rows.append(measure(schedule, remat, m, args.steps))
            print(json.dumps({k: v for k, v in rows[-1].items() if k != "describe"}), flush=True)
            if args.json:
                with open(args.json, "a") as f:
                    f.write(json.dumps(rows[-1]) + "\n")
    from jaxdist.parallel.strategies.pipeline_interleaved import moved_chunks

    where = f"{jax.device_count()} {jax.devices()[0].platform} devices"
    print(f"\nGPT d_model {D_MODEL}, {LAYERS} layers, batch {BATCH} x {SEQ}, mesh "
          f"data={DATA},stage={STAGES}, {where}\n")  # fmt: skip
    print(table(rows))
    chunks, relay = STAGES * VIRTUAL, next(r["relay"] for r in rows if r["relay"])
    print(f"\ninterleaved: {moved_chunks(STAGES, VIRTUAL)} of {chunks} chunks of "
          f"{LAYERS // chunks} layer(s) change device; the re-lay alone, compiled: "
          f"{relay['sent_MiB']:.1f} MiB sent per device ({', '.join(relay['kinds'])}) and a "
          f"{relay['copy_MiB']:.1f} MiB copy of its weights per device, and as much again "
          "for the gradient")  # fmt: skip
    for r in rows[:3]:
        print(f"- {r['describe']}")


if __name__ == "__main__":
    main()
