"""``python -m jaxdist.train ... --dry-run``: the step compiled for the devices present,
its memory per device against theirs; exit 0 if it fits, 2 if not; no data read, no
run directory, nothing written."""

from __future__ import annotations

import jax

from jaxdist.train import compile_only
from jaxdist.train import config as config_lib
from jaxdist.train.trainer import main
from jaxdist.units import size

GPT = ["--model", "gpt", "--d-model", "64", "--n-layers", "2", "--n-heads", "4", "--seq-len", "32"]


def test_a_run_that_fits_prints_its_memory_and_writes_nothing(tmp_path, capsys):
    run_dir, cache = tmp_path / "run", tmp_path / "cache"
    flags = [*GPT, "--mesh", "fsdp=8", "--global-batch-size", "16", "--cache-dir", str(cache)]
    code = main([*flags, "--dry-run", "--run-dir", str(run_dir)])
    out = capsys.readouterr().out
    assert code == 0, out
    assert not run_dir.exists() and not cache.exists()  # stdlib's text never prepared
    assert "on 8 cpu devices, --mesh fsdp=8" in out and ": fits" in out
    # the numbers are the compiled program's own
    _, program, _ = compile_only.build(config_lib.parse_args(flags), jax.devices())
    own = program.compile().memory_analysis()
    peak = own.argument_size_in_bytes + own.output_size_in_bytes + own.temp_size_in_bytes
    peak -= own.alias_size_in_bytes
    assert f"peak {size(peak)} of " in out


def test_a_run_that_does_not_fit_exits_2(tmp_path, capsys):
    """A 0.5B-parameter GPT replicated on 8 CPU devices: ~8 GB of state each, more than a
    device's share of the host (the machine's memory / 8)."""
    big = ["--model", "gpt", "--d-model", "2048", "--n-layers", "8", "--n-heads", "16"]
    big += ["--vocab-size", "50304", "--seq-len", "64", "--global-batch-size", "8"]
    run_dir = tmp_path / "run"
    code = main([*big, "--dry-run", "--run-dir", str(run_dir)])
    out, err = capsys.readouterr()
    assert code == 2, err
    assert "DOES NOT FIT" in out
    assert "--dry-run: the step needs" in err and "python -m jaxdist.plan" in err
    assert not run_dir.exists()
