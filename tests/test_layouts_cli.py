"""The layout flags through ``train()``: ``--rules FILE`` changes where parameters live
(its path rules and its logical part) and a bad one is exit 2 with a message naming it;
``--remat block`` on two pipeline stages trains as ``--scan-layers`` with the rules file
does on another mesh; the pipeline states its bubble first."""

from __future__ import annotations

import re

import jax
import numpy as np
import pytest

from helpers import relative_error
from jaxdist.parallel.layout import path_name
from jaxdist.train.config import parse_args
from jaxdist.train.trainer import main, train

GPT = ["--model", "gpt", "--data", "grammar", "--seq-len", "16", "--vocab-size", "260"]
MLP = ["--model", "mlp", "--data", "synthetic", "--in-features", "16", "--hidden", "64"]


def specs(tree):
    """ "blocks/0/qkv/kernel" -> the PartitionSpec its array has."""
    flat = jax.tree_util.tree_flatten_with_path(tree)[0]
    return {path_name(path): x.sharding.spec for path, x in flat}


def test_path_rules_place_unannotated_parameters(tmp_path):
    # The MLP has no annotations; without a rule fsdp splits the largest dimension of
    # each kernel: P(None, "fsdp") for layers/0/kernel (16, 64).
    (tmp_path / "rules.yaml").write_text('- ["layers/0/kernel$", [model, fsdp]]\n')
    args = [*MLP, "--mesh", "data=2,fsdp=2,model=2", "--global-batch-size", "16"]
    args += ["--steps", "1", "--rules", str(tmp_path / "rules.yaml")]
    got = specs(train(parse_args(args), write=False, quiet=True).state.params)
    assert got["layers/0/kernel"] == jax.P("model", "fsdp")
    assert got["layers/1/kernel"] == jax.P("fsdp", None)


@pytest.mark.parametrize(
    "rules_yaml, message",
    [
        (None, r"--rules: no such file .*missing\.yaml"),
        ('- ["kernel$"]\n', r"--rules .*rules\.yaml: \['kernel\$'\] is not \[regex, \[axes"),
        (
            '- ["layers/0/kernel$", [null, tensor]]\n',
            r"layers/0/kernel \(16, 64\): rule 'layers/0/kernel\$' names mesh axis 'tensor'",
        ),
    ],
    ids=["missing", "not-a-pair", "unknown-axis"],
)
def test_a_bad_rules_file_exits_2(rules_yaml, message, tmp_path, capsys):
    rules = tmp_path / ("missing.yaml" if rules_yaml is None else "rules.yaml")
    if rules_yaml is not None:
        rules.write_text(rules_yaml)
    args = [*MLP, "--mesh", "data=4,model=2", "--rules", str(rules), "--steps", "1"]
    rc = main([*args, "--global-batch-size", "16", "--run-dir", str(tmp_path / "r")])
    err = capsys.readouterr().err
    assert rc == 2, err
    assert re.search(message, err), err
    assert not (tmp_path / "r").exists()


def run_gpt(*flags):
    common = [*GPT, "--steps", "3", "--log-every", "1", "--global-batch-size", "32"]
    common += ["--optimizer", "sgd", "--lr", "0.5"]
    run = train(parse_args([*common, *flags]), write=False)
    return [h["loss"] for h in run.history], run


def test_layout_flags_change_where_arrays_live_not_the_numbers(tmp_path, capsys):
    """Two runs that must compute the same. One: ``--scan-layers`` on a 2 x 2 x 2 mesh
    with a rules file whose logical part replicates "heads" (QKV's columns and the
    attention projection's rows, split over model by default as test_layouts checks).
    Two: ``--remat block`` on two pipeline stages, which turn ``--scan-layers`` on (the
    stacked names show that the flag reached the first run's model: the initial values
    cannot, every form of the model starts from the same ones)."""
    (tmp_path / "rules.yaml").write_text("logical:\n  heads: null\n")
    rules = ["--rules", str(tmp_path / "rules.yaml")]
    want, ruled = run_gpt("--scan-layers", "--mesh", "data=2,fsdp=2,model=2", *rules)
    placed = specs(ruled.state.params)  # (layers, in, out); layers -> stage, size 1 here
    assert placed["blocks/layers/qkv/kernel"] == jax.P(None, "fsdp", None)
    assert placed["blocks/layers/proj/kernel"] == jax.P(None, None, "fsdp")
    assert placed["blocks/layers/fc/kernel"] == jax.P(None, "fsdp", "model")
    capsys.readouterr()
    losses, run = run_gpt("--mesh", "data=4,stage=2", "--remat", "block")
    first = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("jaxdist:"))
    assert "pipeline: 2 stages x 8 microbatches (GPipe), bubble (S-1)/(M+S-1) = 1/9" in first
    assert len(losses) == 3 and losses[-1] < losses[0], losses
    np.testing.assert_allclose(losses, want, rtol=1e-5)
    params, want_params = run.dp.host_params(run.state), ruled.dp.host_params(ruled.state)
    assert params.keys() == want_params.keys() and "blocks/layers/fc/kernel" in params
    for name, value in want_params.items():
        assert relative_error(params[name], value) < 1e-5, name
    assert run.dp.merge(run.state).blocks.remat == "block"  # the flag reached the stack
