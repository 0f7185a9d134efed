"""What a run asks for that does nothing, or that it changes to fit, is said at start-up
(one line), or refused (exit 2, one line); an error raised in the user's model names the
user's file and line, its traceback in a file the line names."""

from __future__ import annotations

import re
import textwrap
from pathlib import Path

import pytest

from helpers import run_cli
from jaxdist.train.build_model import model_factory
from jaxdist.train.config import ConfigError, from_dict


@pytest.mark.parametrize(
    "model", [{"name": "explicit_model:build"}, {"name": "mlp"}], ids=["factory", "mlp"]
)
def test_the_gpts_flags_on_a_model_that_cannot_see_them_are_refused(model):
    config = from_dict({"model": {**model, "scan_layers": True, "remat": "block"}})
    with pytest.raises(ConfigError, match=r"--scan-layers True, --remat block: the built-in "
                       r"GPT's flag\(s\), which --model .* cannot see"):  # fmt: skip
        model_factory(config.model, seed=0)


def test_a_factory_that_reads_the_config_may_take_them():
    config = from_dict({"model": {"name": "test_nothing_silent:reads_config", "remat": "block"}})
    assert model_factory(config.model, seed=0)() == "block"


def reads_config(config):
    return config.remat


def test_a_warmup_cut_to_fit_the_run_is_said(tmp_path):
    cut = run_cli("--steps", "3", "--warmup-steps", "10", "--run-dir", str(tmp_path / "a"))
    assert cut.returncode == 0, cut.stderr[-3000:]
    assert "--warmup-steps 10 is cut to 2 for a run of 3 steps (--steps)" in cut.stdout
    fits = run_cli("--steps", "5", "--warmup-steps", "2", "--run-dir", str(tmp_path / "b"))
    assert fits.returncode == 0 and "is cut to" not in fits.stdout


BROKEN = """
    from flax import nnx
    import jax.numpy as jnp


    class Broken(nnx.Module):
        def __init__(self, rngs):
            self.dense = nnx.Linear(32, 10, rngs=rngs)

        def __call__(self, x):
            h = self.dense(x)
            return h @ jnp.ones((7, 10))  # (B, 10) @ (7, 10): the shapes do not meet


    def build(rngs):
        return Broken(rngs)
"""


def test_an_error_in_the_users_model_names_its_file_and_line(tmp_path):
    (tmp_path / "broken_model.py").write_text(textwrap.dedent(BROKEN))
    line = 1 + textwrap.dedent(BROKEN).splitlines().index(
        "        return h @ jnp.ones((7, 10))  # (B, 10) @ (7, 10): the shapes do not meet"
    )
    run = run_cli("--model", "broken_model:build", "--steps", "2", "--run-dir",
                  str(tmp_path / "run"), cwd=tmp_path)  # fmt: skip
    lines = [x for x in run.stderr.splitlines() if x.strip()]
    assert run.returncode == 2 and len(lines) == 1, run.stderr[-3000:]
    assert f"raised TypeError (at broken_model.py:{line} in __call__)" in lines[0], lines[0]
    where = re.search(r"; its traceback: (\S+)$", lines[0])
    assert where, lines[0]
    trace = Path(where.group(1)).read_text()
    assert "Traceback" in trace and f'broken_model.py", line {line}, in __call__' in trace
    assert not (tmp_path / "run").exists()  # refused before its first step: nothing written


def test_the_planner_and_the_dry_run_say_a_model_axis_splits_nothing():
    """The MLP names no axis: model=2 copies it (the dry run's line, a plan's note)."""
    import jaxdist
    from jaxdist.plan import Options

    flags = ["--model", "mlp", "--mesh", "data=4,model=2", "--grad-accum", "1"]
    plan = jaxdist.plan(flags, "cpu:8", Options(budget_s=0, workers=1))
    compiled = [c for c in plan.candidates if c.status == "compiled"]
    assert compiled, [c.why for c in plan.candidates]
    for c in compiled:
        assert any("--mesh model=2 splits no parameter" in n for n in c.measured["notices"])
    dry = run_cli(*flags, "--cpu-devices", "8", "--dry-run")
    assert dry.returncode == 0, dry.stderr[-3000:]
    assert "jaxdist: warning: --mesh model=2 splits no parameter of this model" in dry.stdout
