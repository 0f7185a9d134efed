"""One measurement of bench_gpt.py, in its own process: ``measure(args, who, size, ...)``.

Every record has who, model, size, step_ms (the median of the timed windows' mean step times),
window_ms (each window's mean), tokens_per_s, mfu (against the bf16 matmul peak measured
here on random data, fp32 on CPU), compile_s (the first step, compilation included),
peak_memory_gb (GPU) and the configuration; jaxdist's also data_wait_frac.
"""

from __future__ import annotations

import gzip
import json
import shutil
import statistics
import time
from pathlib import Path

import numpy as np


def matmul_peak_flops(cpu: bool) -> float:
    """Best of 5 timed (n x n) @ (n x n) products: 2 n^3 FLOPs each."""
    import jax
    import jax.numpy as jnp

    n, dtype = (512, jnp.float32) if cpu else (8192, jnp.bfloat16)
    # random, not ones: a GPU draws more power on random bits and clocks lower
    a = jax.random.normal(jax.random.key(0), (n, n), dtype)
    mm = jax.jit(lambda x: x @ x)
    mm(a).block_until_ready()
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(10):
            out = mm(a)
        out.block_until_ready()
        best = min(best, (time.perf_counter() - start) / 10)
    return 2 * n**3 / best


def measure(args, who: str, size: str, dims: dict, run: dict) -> dict:
    model = getattr(args, "model", "gpt")
    record = {"who": who, "model": model, "size": size, **dims}
    record.update({k: v for k, v in run.items() if k != "steps"})
    record.update(attention=args.attention, note=getattr(args, "note", ""))
    if who == "jaxdist":
        record.update(strategy=args.strategy, scan_layers=args.scan_layers, remat=args.remat)
        record["loss_chunks"] = args.loss_chunks
        record["fp8"] = getattr(args, "fp8", False)
    elif who == "plain-jax":
        record["donate"] = not args.no_donate
    if who == "torch.compile":
        try:
            import peer_torch
        except ImportError as err:
            return {**record, "skipped": f"torch not installed ({err})"}
        backend = getattr(args, "torch_backend", "inductor")
        record["torch_backend"] = backend
        timing = peer_torch.measure(dims, run, cpu=args.cpu, backend=backend, model=model)
        peak = peer_torch.matmul_peak_flops(args.cpu)
    else:
        import jax

        if args.cache_dir:
            jax.config.update("jax_compilation_cache_dir", args.cache_dir)
            jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
        timing = (measure_jaxdist if who == "jaxdist" else measure_plain_jax)(args, dims, run)
        peak = matmul_peak_flops(args.cpu)
        stats = jax.devices()[0].memory_stats() or {}
        if "peak_bytes_in_use" in stats:
            timing["peak_memory_gb"] = stats["peak_bytes_in_use"] / 1e9
    tokens_per_step = run["batch"] * run["seq_len"]
    from bench_gpt import flops_per_token

    flops = flops_per_token(model, timing["n_params"], dims, run["seq_len"])
    tokens_per_s = tokens_per_step / (timing["step_ms"] / 1e3)
    return {
        **record,
        **timing,
        "tokens_per_s": tokens_per_s,
        "mfu": flops * tokens_per_s / peak,
        "matmul_peak_tflops": peak / 1e12,
    }


def timed_windows(step, state, batches, run: dict) -> tuple[object, list[float], float]:
    """Runs ``state = step(state, batch)``: ``warmup`` steps (the first compiles, timed
    alone), then ``steps`` in windows of ``window``, waiting for the device at the end of
    each; returns (state, each window's mean step time in ms, compile seconds)."""
    import jax

    start = time.perf_counter()
    state = jax.block_until_ready(step(state, batches[0]))
    compile_s = time.perf_counter() - start
    for i in range(1, run["warmup"]):
        state = step(state, batches[i % len(batches)])
    jax.block_until_ready(state)
    windows = []
    for w in range(run["steps"] // run["window"]):
        start = time.perf_counter()
        for i in range(run["window"]):
            state = step(state, batches[(w + i) % len(batches)])
        jax.block_until_ready(state)
        windows.append((time.perf_counter() - start) / run["window"] * 1e3)
    return state, windows, compile_s


def _config(args, dims: dict, run: dict, data_path: str, run_dir: str = ""):
    from jaxdist.train.config import from_dict

    model = {"name": getattr(args, "model", "gpt"), "attention": args.attention}
    model["dtype"] = run["dtype"]
    model.update(vocab_size=run["vocab_size"], seq_len=run["seq_len"], **dims)
    model.update(scan_layers=args.scan_layers, remat=args.remat, loss_chunks=args.loss_chunks)
    model["fp8"] = getattr(args, "fp8", False)
    # the first step compiles, the warm-up's others follow, then the timed windows: one
    # log record per window (the loop waits for the device at each)
    steps = run["warmup"] + run["steps"]
    train = {"steps": steps, "global_batch_size": run["batch"], "strategy": args.strategy}
    train.update(log_every=run["window"], run_dir=run_dir, tensorboard=False)
    if args.profile:  # the timed part's first steps, 5 at most
        last = run["warmup"] + traced_steps(run)
        train.update(profile=f"{run['warmup'] + 1}:{last}", checkpoint_every=0)
    return from_dict({"model": model, "data": {"path": data_path}, "train": train})


def measure_jaxdist(args, dims: dict, run: dict) -> dict:
    """The real trainer: a token file of random ids, sampler, prefetch, gspmd step."""
    import tempfile

    from jaxdist.data import write_token_file
    from jaxdist.train.trainer import train

    with tempfile.TemporaryDirectory() as tmp:
        steps = run["warmup"] + run["steps"]
        n_tokens = (steps + 4) * run["batch"] * run["seq_len"] + 1
        ids = np.random.default_rng(0).integers(0, run["vocab_size"], n_tokens, dtype=np.uint32)
        path = write_token_file(
            f"{tmp}/random.bin", ids, vocab_size=run["vocab_size"], documents=1, sources="random"
        )
        run_dir = f"{tmp}/run" if args.profile else ""
        config = _config(args, dims, run, str(path), run_dir)
        result = train(config, write=bool(args.profile), quiet=True)
        if args.profile:
            keep_trace(Path(run_dir) / "profile", Path(args.profile), traced_steps(run))
    n_params = sum(x.size for x in result.dp.host_params(result.state).values())
    # history: the first step (compiling), the warm-up's window, then the timed windows
    windows = [h for h in result.history if h["step"] > run["warmup"]]
    return {
        "step_ms": statistics.median(h["step_time_s"] * 1e3 for h in windows),
        "window_ms": [round(h["step_time_s"] * 1e3, 3) for h in windows],
        "data_wait_frac": statistics.mean(h["data_wait_frac"] for h in windows),
        "compile_s": result.compile_s,
        "n_params": int(n_params),
        "loss": result.history[-1]["loss"],
    }


def traced_steps(run: dict) -> int:
    return min(5, run["steps"])


def keep_trace(profile_dir: Path, dest: Path, steps: int) -> None:
    """Writes the trace's ``.xplane.pb`` to ``dest`` (a directory), gzipped (host events
    make it tens of MB), and its summary beside it (``profile_summary.py``)."""
    import profile_summary

    dest.mkdir(parents=True, exist_ok=True)
    for found in profile_dir.rglob("*.xplane.pb"):
        with open(found, "rb") as src, gzip.open(dest / "jaxdist_step.xplane.pb.gz", "wb") as out:
            shutil.copyfileobj(src, out)
        summary = profile_summary.summarise(found, steps=steps)
        (dest / "profile_summary.json").write_text(json.dumps(summary, indent=1))


def measure_plain_jax(args, dims: dict, run: dict) -> dict:
    """Hand-written jit step on device-resident batches; weights initialised as jaxdist's."""
    import jax
    from flax import nnx

    import peer_plain_jax as plain
    import peer_plain_jax_llama as plain_llama
    from jaxdist.train.build_model import attention_kernel, build_model

    cfg = _config(args, dims, run, "").model
    model, _ = build_model(cfg, seed=0)
    params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    n_params = sum(x.size for x in jax.tree.leaves(params))
    tx = plain.make_optimizer(3e-4)
    shapes = dict(n_heads=dims["n_heads"], dtype=getattr(jax.numpy, run["dtype"]))
    shapes["attention"] = attention_kernel(cfg)
    if cfg.name == "llama":  # the Llama's loss, with its grouped heads, RoPE and eps
        shapes.update(loss=plain_llama.loss_fn, n_kv_heads=dims["n_kv_heads"])
        shapes.update(rope_theta=dims["rope_theta"], eps=dims["rms_norm_eps"])
    step = plain.make_step(tx, donate=not args.no_donate, **shapes)
    keys = jax.random.split(jax.random.key(0), 4)
    shape = (run["batch"], run["seq_len"] + 1)
    batches = [jax.random.randint(k, shape, 0, run["vocab_size"]) for k in keys]  # on device

    def train_step(state, tokens):
        return step(*state[:2], tokens)

    state = (params, tx.init(params), None)
    (_, _, loss), windows, compile_s = timed_windows(train_step, state, batches, run)
    return {
        "step_ms": statistics.median(windows),
        "window_ms": [round(w, 3) for w in windows],
        "compile_s": compile_s,
        "n_params": int(n_params),
        "loss": float(loss),
    }
