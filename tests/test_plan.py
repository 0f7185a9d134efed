"""``python -m jaxdist.plan`` and ``jaxdist.plan(...)``: candidates compiled in worker
processes for devices they do not have, read right, and the command they print runs.

The references: the same step compiled in this process for its 8 CPU devices (its own
``memory_analysis``), and the gradient's bytes counted from the abstract parameters."""

from __future__ import annotations

import dataclasses
import json
import shlex

import jax
import pytest

import jaxdist
from helpers import run_module
from jaxdist.plan import Options, gpu_compiler, planner
from jaxdist.plan.__main__ import main as plan_main
from jaxdist.plan.table import as_json, render
from jaxdist.train import compile_only
from jaxdist.train import config as config_lib

GPT = ["--model", "gpt", "--d-model", "64", "--n-layers", "2", "--n-heads", "4"]
GPT += ["--seq-len", "32", "--global-batch-size", "16"]


def param_bytes(flags: list[str]) -> int:
    _, program, _ = compile_only.build(config_lib.parse_args(flags), jax.devices()[:1])
    return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(program.state.params))


def gpu_compiler_ready() -> bool:
    try:
        gpu_compiler.python_path()
    except jaxdist.ConfigError:
        return False
    return True


def test_planned_memory_is_the_compiled_programs_own_on_8_devices():
    layout = ["--grad-accum", "2", "--remat", "block", "--shard-optimizer", "false"]
    flags = [*GPT, "--mesh", "model=2,stage=1", *layout]  # data x fsdp = 4: three layouts
    plan = jaxdist.plan(flags, "cpu:8", Options(budget_s=0, workers=1))
    json.dumps(as_json(plan))  # for tools: plain JSON
    found = {c.layout.mesh: c for c in plan.candidates}
    assert len(found) == 3
    # two of the three compiled here too (the third: 4 s of the suite, no other check)
    for mesh in ["data=4,model=2", "fsdp=4,model=2"]:
        measured = found[mesh].measured
        config = config_lib.parse_args([*GPT, "--mesh", mesh, *layout])
        _, program, _ = compile_only.build(config, jax.devices())
        own = program.compile().memory_analysis()
        assert measured["argument_bytes"] == own.argument_size_in_bytes, mesh
        assert measured["temp_bytes"] == own.temp_size_in_bytes, mesh
        assert measured["output_bytes"] == own.output_size_in_bytes, mesh
        assert measured["alias_bytes"] == own.alias_size_in_bytes, mesh
    # fsdp splits the state 4 ways that data replicates
    ratio = found["data=4,model=2"].peak_bytes and (
        found["data=4,model=2"].measured["argument_bytes"]
        / found["fsdp=4,model=2"].measured["argument_bytes"]
    )
    assert 3.5 < ratio <= 4.0
    assert plan.best is not None and plan.best.fits


def test_the_plan_lists_the_memory_options_and_their_bytes():
    """A data-parallel mesh's floor takes --shard-optimizer (its optimizer state 1/8 per
    device), refining compiles it without as a row of its own; the printed command of
    the one chosen carries its options."""
    flags = [*GPT, "--mesh", "data=8", "--grad-accum", "1", "--remat", "none"]
    plan = jaxdist.plan(flags, "cpu:8", Options(budget_s=0, workers=1))
    rows = {c.layout.zero: c for c in plan.candidates}
    assert sorted(rows) == [False, True] and all(c.status == "compiled" for c in rows.values())
    state, params = compile_only.state_bytes(config_lib.parse_args(GPT))
    saved = rows[False].measured["argument_bytes"] - rows[True].measured["argument_bytes"]
    assert saved == pytest.approx((state - params) * 7 / 8, rel=0.1)  # AdamW's moments' 7/8
    table = render(plan)
    assert "zero1" in table and "options" in table
    assert ("--shard-optimizer" in plan.command) == plan.best.layout.zero


@pytest.mark.skipif(not gpu_compiler_ready(), reason=f"no GPU compiler: `{gpu_compiler.INSTALL}`")
def test_a_gpu_cluster_is_planned_without_a_gpu():
    """2 nodes x 2 H100s, fsdp inside a node and data across: the gradient's all-reduce
    over data crosses nodes (each device's half of it), fsdp's collectives do not."""
    flags = [*GPT, "--mesh", "data=2,fsdp=2", "--grad-accum", "1", "--remat", "none"]
    flags += ["--shard-optimizer", "false"]  # one candidate: the plain layout
    plan = jaxdist.plan(flags, "2x2:H100-80GB", Options(budget_s=0, workers=1))
    (c,) = plan.candidates
    assert c.status == "compiled", c.why
    m, half = c.measured, param_bytes(GPT) / 2
    assert m["by_kind"]["reduce-scatter"] > 0  # the GPU compiler's, not the CPU's all-reduce
    assert m["collective_bytes"]["inter"] == pytest.approx(half, rel=0.03)
    assert m["by_kind"]["all-gather"] == pytest.approx(half, rel=0.03)  # received: 1/2
    assert m["collective_bytes"]["intra"] == pytest.approx(2 * half, rel=0.03)
    # FLOPs: the matmuls of 4 rows x 32 tokens a device, forward and backward (x 3): the
    # blocks' 12 d^2 weights per layer, the tied head over the vocabulary padded to 384,
    # attention's two (T x T) products per layer; nothing else is a matmul
    d, layers, seq, vocab = 64, 2, 32, 384
    per_token = 3 * (2 * 12 * layers * d * d + 2 * vocab * d + 4 * layers * d * seq)
    assert m["matmul_flops"] == per_token * 4 * seq
    assert c.fits and plan.capacity_bytes == pytest.approx(0.9 * 81559 * 2**20)
    assert plan.command.startswith("XLA_PYTHON_CLIENT_MEM_FRACTION=0.90 python -m jaxdist.train")


def test_the_command_plans_and_its_printed_command_trains(tmp_path, capsys):
    layout = ["--mesh", "fsdp=8", "--grad-accum", "1", "--remat", "none"]
    code = plan_main(["--target", "cpu:8", *GPT, *layout, "--workers", "1"])
    out, err = capsys.readouterr()
    assert code == 0, err
    assert "Best that fits: --mesh fsdp=8 --grad-accum 1" in out
    assert "[1/1] fsdp=8 accum 1" in err  # progress, one line per candidate
    command = out.strip().splitlines()[-1]
    argv = shlex.split(command)
    assert argv[:3] == ["python", "-m", "jaxdist.train"] and "--cpu-devices" in argv
    run = run_module(*argv[2:], "--steps", "2", "--run-dir", str(tmp_path / "run"))
    assert run.returncode == 0, run.stderr
    assert (tmp_path / "run" / "metrics.jsonl").is_file()


def test_exit_codes_none_fits_and_bad_input(capsys):
    assert plan_main(["--target", "cpu:8", *GPT, "--memory-fraction", "1e-9", "--json"]) == 1
    plan = json.loads(capsys.readouterr().out)
    assert plan["best"] is None and {c["status"] for c in plan["candidates"]} == {"too big"}
    bad = run_module("jaxdist.plan", "--target", "8x8:Z100", *GPT)  # the real command's exit
    assert bad.returncode == 2 and "unknown device kind 'Z100'" in bad.stderr
    assert bad.stdout == ""


def test_a_plan_that_compiled_nothing_says_so_and_exits_3(capsys):
    """A budget that lets no compile start: nothing was measured, so nothing is ruled out
    (not "no layout fits"); the unrolled GPT was planned scanned too, and said so."""
    assert plan_main(["--target", "cpu:8", *GPT, "--budget-s", "0.001", "--workers", "1"]) == 3
    out = capsys.readouterr().out
    assert "No layout was compiled (" in out and "nothing was measured" in out, out
    assert "No layout fits" not in out
    assert "Planned with --scan-layers: unrolled, the 2 blocks compiled apart" in out
    assert "--budget-s, now 0 s" in out


def test_a_gpt_unrolled_past_the_budget_is_planned_scanned(monkeypatch):
    """Where the unrolled GPT compiled nothing in the budget (cut off here, as a large
    L's compiles are on a few cores), the plan is the scanned stack's, its command says
    --scan-layers and its header says why; --no-scan-layers keeps the unrolled form."""
    real = planner._plan

    def unrolled_cut_off(flags, target, options, progress, t0):
        if "--scan-layers" not in flags:
            options = dataclasses.replace(options, budget_s=1e-3)
        return real(flags, target, options, progress, t0)

    monkeypatch.setattr(planner, "_plan", unrolled_cut_off)
    layout = ["--mesh", "fsdp=8", "--grad-accum", "1", "--remat", "none"]
    plan = jaxdist.plan([*GPT, *layout], "cpu:8", Options(budget_s=60, workers=1))
    assert plan.best is not None and plan.compiled == 1
    assert "--scan-layers" in shlex.split(plan.command)
    assert plan.notes and plan.notes[0].startswith("Planned with --scan-layers")
    assert plan.notes[0] in render(plan)
    kept = jaxdist.plan([*GPT, *layout, "--no-scan-layers"], "cpu:8", Options(budget_s=60))
    assert kept.compiled == 0 and kept.notes == [] and kept.best is None


def test_a_candidate_past_its_time_limit_is_reported_and_its_worker_replaced():
    flags = [*GPT, "--mesh", "model=8", "--grad-accum", "1", "--remat", "none"]
    options = Options(budget_s=0, workers=1, candidate_timeout_s=0.2)
    plan = jaxdist.plan(flags, "cpu:8", options)
    (c,) = plan.candidates
    assert c.status == "timed out" and "0 s" in c.why
    assert plan.best is None and plan.command == ""


def test_a_layout_the_model_cannot_split_is_discarded_by_the_layout_functions_error():
    flags = [*GPT, "--mesh", "stage=4,model=2", "--grad-accum", "1", "--remat", "none"]
    (c,) = jaxdist.plan(flags, "cpu:8", Options(budget_s=0, workers=1)).candidates
    assert c.status == "unsplittable"  # 2 layers over 4 stages
    assert "not divisible by mesh axis stage of size 4" in c.why
