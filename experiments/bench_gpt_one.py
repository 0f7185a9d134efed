"""One measurement of bench_gpt.py, in its own process: ``measure(args, who, size, ...)``.

Every record has who, size, step_ms, tokens_per_s, mfu (against the bf16 matmul peak
measured here, fp32 on CPU), compile_s (the first step, compilation included),
peak_memory_gb (GPU) and the configuration.
"""

from __future__ import annotations

import time

import numpy as np


def matmul_peak_flops(cpu: bool) -> float:
    """Best of 5 timed (n x n) @ (n x n) products: 2 n^3 FLOPs each."""
    import jax
    import jax.numpy as jnp

    n, dtype = (512, jnp.float32) if cpu else (8192, jnp.bfloat16)
    a = jnp.ones((n, n), dtype)
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
    record = {"who": who, "size": size, **dims, **{k: v for k, v in run.items() if k != "steps"}}
    record["attention"] = args.attention
    if who == "torch.compile":
        try:
            import peer_torch
        except ImportError as err:
            return {**record, "skipped": f"torch not installed ({err})"}
        timing = peer_torch.measure(dims, run, cpu=args.cpu)
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

    flops = flops_per_token(timing["n_params"], dims["n_layers"], dims["d_model"], run["seq_len"])
    tokens_per_s = tokens_per_step / (timing["step_ms"] / 1e3)
    return {
        **record,
        **timing,
        "tokens_per_s": tokens_per_s,
        "mfu": flops * tokens_per_s / peak,
        "matmul_peak_tflops": peak / 1e12,
    }


def _config(args, dims: dict, run: dict, data_path: str):
    from jaxdist.train.config import from_dict

    model = {"name": "gpt", "attention": args.attention, "dtype": run["dtype"]}
    model.update(vocab_size=run["vocab_size"], seq_len=run["seq_len"], **dims)
    train = {"steps": run["steps"] + 1, "global_batch_size": run["batch"]}
    train["log_every"] = run["steps"] + 1  # one record: the mean over steps 2..N+1
    return from_dict({"model": model, "data": {"path": data_path}, "train": train})


def measure_jaxdist(args, dims: dict, run: dict) -> dict:
    """The real trainer: a token file of random ids, sampler, prefetch, gspmd step."""
    import tempfile

    from jaxdist.data import write_token_file
    from jaxdist.train.trainer import train

    with tempfile.TemporaryDirectory() as tmp:
        n_tokens = (run["steps"] + 4) * run["batch"] * run["seq_len"] + 1
        ids = np.random.default_rng(0).integers(0, run["vocab_size"], n_tokens, dtype=np.uint32)
        path = write_token_file(
            f"{tmp}/random.bin", ids, vocab_size=run["vocab_size"], documents=1, sources="random"
        )
        result = train(_config(args, dims, run, str(path)), write=False, quiet=True)
    n_params = sum(x.size for x in result.dp.host_params(result.state).values())
    return {
        "step_ms": result.history[-1]["step_time_s"] * 1e3,
        "compile_s": result.compile_s,
        "n_params": int(n_params),
        "loss": result.history[-1]["loss"],
    }


def measure_plain_jax(args, dims: dict, run: dict) -> dict:
    """Hand-written jit step on device-resident batches; weights initialised as jaxdist's."""
    import jax
    from flax import nnx

    import peer_plain_jax as plain
    from jaxdist.train.build_model import attention_kernel, build_model

    cfg = _config(args, dims, run, "").model
    model, _ = build_model(cfg, seed=0)
    params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    n_params = sum(x.size for x in jax.tree.leaves(params))
    tx = plain.make_optimizer(3e-4)
    dtype = getattr(jax.numpy, run["dtype"])
    step = plain.make_step(
        tx, n_heads=dims["n_heads"], dtype=dtype, attention=attention_kernel(cfg)
    )
    opt_state = tx.init(params)
    keys = jax.random.split(jax.random.key(0), 4)
    shape = (run["batch"], run["seq_len"] + 1)
    batches = [jax.random.randint(k, shape, 0, run["vocab_size"]) for k in keys]  # on device
    start = time.perf_counter()
    params, opt_state, loss = step(params, opt_state, batches[0])
    loss.block_until_ready()
    compile_s = time.perf_counter() - start
    start = time.perf_counter()
    for i in range(run["steps"]):
        params, opt_state, loss = step(params, opt_state, batches[i % len(batches)])
    loss.block_until_ready()
    step_ms = (time.perf_counter() - start) / run["steps"] * 1e3
    return {
        "step_ms": step_ms,
        "compile_s": compile_s,
        "n_params": int(n_params),
        "loss": float(loss),
    }
