"""The layout flags through ``train()``: ``--rules FILE`` changes where parameters live
(its path rules and its logical part), not the numbers, and a bad one is exit 2 with a
message naming it; ``--remat block`` on two pipeline stages, with a replica check every 2
steps, a checkpoint and ``--save-params``, states its bubble first, passes its replica
checks and saves what training computes. The numbers' reference is a plain one-device
flax/optax loop over the unscanned GPT without remat (no jaxdist step, layout or
optimizer code)."""

from __future__ import annotations

import re

import jax
import numpy as np
import optax
import pytest
from flax import nnx

from helpers import per_layer, relative_error, saved_params
from jaxdist.data.sampler import DistributedSampler
from jaxdist.data.synthetic import ByteWindows, grammar_corpus
from jaxdist.health.replica_check import ReplicaCheck
from jaxdist.models.gpt import GPT as GPT_MODEL
from jaxdist.parallel.layout import path_name
from jaxdist.train.config import parse_args
from jaxdist.train.trainer import main, train

GPT = ["--model", "gpt", "--data", "grammar", "--seq-len", "16", "--vocab-size", "260"]
STEPS = 3
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


def run_gpt(*flags, write=False):
    common = [*GPT, "--steps", str(STEPS), "--log-every", "1", "--global-batch-size", "32"]
    common += ["--optimizer", "sgd", "--lr", "0.5"]
    run = train(parse_args([*common, *flags]), write=write)
    return [h["loss"] for h in run.history], run


@pytest.fixture(scope="module")
def plain_loop():
    """One device, flax and optax only: the unscanned GPT without remat, built from
    ``nnx.Rngs(seed)`` as the trainer documents, the optimizer the flags ask for
    (clipping, weight decay, momentum, warmup into a cosine), the grammar corpus's global
    batches in the sampler's order. (losses, {"blocks/0/fc/kernel": ...})."""
    c = parse_args([*GPT, "--global-batch-size", "32", "--optimizer", "sgd", "--lr", "0.5"])
    m, o, t = c.model, c.optim, c.train

    def build():
        return GPT_MODEL(m.vocab_size, m.seq_len, m.d_model, m.n_layers, m.n_heads,
                         attention="xla", rngs=nnx.Rngs(t.seed))  # fmt: skip

    graphdef, _ = nnx.split(nnx.eval_shape(build), nnx.Param)
    warmup = min(o.warmup_steps, STEPS - 1)
    schedule = optax.warmup_cosine_decay_schedule(0.0, o.lr, warmup, STEPS, o.lr * o.min_lr_ratio)
    tx = optax.chain(
        optax.clip_by_global_norm(o.clip_norm),
        optax.add_decayed_weights(o.weight_decay),
        optax.sgd(schedule, momentum=o.momentum),
    )

    def loss(p, tokens):
        logits = nnx.merge(graphdef, p)(tokens[:, :-1])
        return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()

    @jax.jit
    def step(params, opt_state, tokens):
        value, grads = jax.value_and_grad(loss)(params, tokens)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, value

    data = ByteWindows(m.seq_len, grammar_corpus(seed=1234))  # what --data grammar reads
    order = DistributedSampler(len(data), t.global_batch_size, seed=t.seed)

    @jax.jit  # one program: op by op, every initializer and zeros_like would compile alone
    def init():
        params = nnx.state(build(), nnx.Param)
        return params, tx.init(params)

    (params, opt_state), losses = init(), []
    for k in range(STEPS):
        # numpy, as init's outputs are uncommitted: a device_put array would commit the
        # step's outputs and compile it again for the second step
        tokens = data[order.global_indices(k)]["tokens"]
        params, opt_state, value = step(params, opt_state, tokens)
        losses.append(float(value))
    flat = nnx.to_flat_state(params)
    return losses, {"/".join(map(str, p)): np.asarray(v.get_value()) for p, v in flat}


def assert_trains_as(losses, params, reference):
    want_losses, want = reference
    np.testing.assert_allclose(losses, want_losses, rtol=1e-5)
    params = per_layer(params)
    assert params.keys() == want.keys()
    for name, value in want.items():
        assert relative_error(params[name], value) < 1e-5, name


def test_a_rules_file_changes_where_arrays_live_not_the_numbers(tmp_path, plain_loop):
    """``--scan-layers`` on a 2 x 2 x 2 mesh with a rules file whose logical part
    replicates "heads" (QKV's columns and the attention projection's rows, split over
    model by default as test_layouts checks) trains as the plain loop does."""
    (tmp_path / "rules.yaml").write_text("logical:\n  heads: null\n")
    rules = ["--rules", str(tmp_path / "rules.yaml")]
    losses, ruled = run_gpt("--scan-layers", "--mesh", "data=2,fsdp=2,model=2", *rules)
    placed = specs(ruled.state.params)  # (layers, in, out); layers -> stage, size 1 here
    assert placed["blocks/layers/qkv/kernel"] == jax.P(None, "fsdp", None)
    assert placed["blocks/layers/proj/kernel"] == jax.P(None, None, "fsdp")
    assert placed["blocks/layers/fc/kernel"] == jax.P(None, "fsdp", "model")
    assert len(losses) == STEPS and losses[-1] < losses[0], losses
    assert_trains_as(losses, ruled.dp.host_params(ruled.state), plain_loop)


def test_two_stages_checked_and_saved_train_as_the_plain_loop(tmp_path, capsys, plain_loop):
    """``--remat block`` on two pipeline stages (``--scan-layers`` follows), with a replica
    check every 2 steps, a checkpoint and ``--save-params``: the pipeline states its bubble
    first; the replicas are compared at step 2 and before the final checkpoint, and agree
    (each stage's layers held by its 4 data replicas, the two stages' different); the
    saved params, the checkpoint and the logged losses are the plain loop's (one device,
    unscanned, no remat)."""
    tables = []
    fingerprints = ReplicaCheck.fingerprints

    def kept(check, params):
        tables.append(fingerprints(check, params))
        return tables[-1]

    saved, run_dir = tmp_path / "params.npz", tmp_path / "run"
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(ReplicaCheck, "fingerprints", kept)
        losses, run = run_gpt(
            "--mesh", "data=4,stage=2", "--remat", "block", "--check-replicas-every", "2",
            "--save-params", str(saved), "--run-dir", str(run_dir), write=True,
        )  # fmt: skip
    first = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("jaxdist:"))
    assert "pipeline: 2 stages x 8 microbatches (GPipe), bubble (S-1)/(M+S-1) = 1/9" in first
    assert run.dp.merge(run.state).blocks.remat == "block"  # the flag reached the stack
    params = saved_params(saved)  # per layer, as checkpoints hold a stack
    assert "blocks/1/fc/kernel" in params
    assert_trains_as(losses, params, plain_loop)
    restored, _ = run.dp.restore(run_dir / "checkpoints", step=STEPS)
    for name, value in per_layer(run.dp.host_params(restored)).items():
        np.testing.assert_array_equal(value, params[name], err_msg=name)
    # Steps 2 and 3: a (devices, params) table each; per parameter, devices holding the
    # same block agree: one value on all 8 (replicated), or one per stage on 4 each.
    assert len(tables) == 2
    names = list(run.dp.host_params(run.state))
    for table in tables:
        for name, column in zip(names, table.T, strict=True):
            _, counts = np.unique(column, return_counts=True)
            want = [4, 4] if name.startswith("blocks/layers/") else [8]
            assert sorted(counts) == want, (name, column)
