"""The layout x feature matrix's covering subset (experiments/matrix.py runs it whole):
for every layout but data=8 (whose pairs other files test), 3 or 4 runs cover every
feature. Run A (every float32 feature at once: checkpoints every 3 steps, evaluation,
``--save-params``, the replica check, ``--grad-accum 2``, ``--remat block``, a NaN step
skipped, ``--shard-optimizer``, ``--offload optimizer``; on stage layouts the interleaved
schedule) equals 1 device with the same flags within 1e-4 (losses, eval losses, saved
params, the skipped step); stopped after its step-3 checkpoint it resumes bit for bit on
its own layout (2 processes: in other files), and from 2 processes within 1e-4 on data=8
unscanned (elastic, where no other file tests it); run B (``--dtype bfloat16 --dropout
0.1``; on stage layouts 1F1B) is within 3e-2 of 1 device's. The rows of the
explicit-style model (tests/explicit_model.py) run A without remat (the GPT's flags are
n/a there). The 1-device run equals a plain optax loop elsewhere (test_equivalence.py;
the explicit model's: test_explicit_sharding.py)."""

from __future__ import annotations

import pytest

from helpers import load_experiment

matrix = load_experiment("matrix")
matrix.IN_PROCESS = True  # one process's layouts in this process (its 8 CPU devices)
# and the session's compilation cache (tests/conftest.py), as test_checkpoint.py's resumes:
# a resumed run loads its first run's programs, a stage row's pipelined step among them
# (a stage row 73 s -> 51 s on 2 cores). Each is XLA's own for the same program, so the
# resumes are still bit for bit against a run that compiled it.
matrix.IN_PROCESS_CACHE = []
ALL = [f for f in matrix.FEATURES if f != "defaults"]


# Every pair of a layout and a feature in 4 runs per layout, not 11: run A has every
# float32 feature at once, then is resumed on its own layout and on data=8; run B has
# bf16 with dropout (both loose).
SGD, RTOL, LOOSE, run, close, verdict = (
    matrix.SGD, matrix.RTOL, matrix.LOOSE, matrix.run, matrix.close, matrix.verdict
)  # fmt: skip
COMBINED = [*SGD, "--checkpoint-every", "3", "--eval-every", "6", "--check-replicas-every", "2",
            "--grad-accum", "2", "--remat", "block", "--nan-policy", "skip",
            # evaluated once (step 6), on the held-out set's first 2 batches of 64 rows, not
            # its 11,237 rows: a stage row's evaluations were a fifth of its time in 10 of 128
            "--eval-batch-size", "64", "--eval-batches", "2",
            # an optimizer state to split over data and keep in host memory: momentum's
            "--momentum", "0.9", "--lr", "0.1", "--shard-optimizer", "--offload", "optimizer",
            ]  # fmt: skip
# a pipeline's schedules: interleaved (4 layers: 2 stages x 2 chunks) with every float32
# feature; 1F1B in the loose run (its masks per microbatch are GPipe's: within 3e-2 at
# 2 layers, as GPipe's; 4 layers of per-microbatch masks drift past it)
STAGED = {"COMBINED": ["--pipeline-schedule", "interleaved", "--n-layers", "4"],
          "LOOSE": ["--pipeline-schedule", "1f1b"]}  # fmt: skip
NAN_ENV = {"JAXDIST_FAULT": f"nan@0:{matrix.NAN_STEP}"}
LOOSE_FLAGS = [*SGD, "--dtype", "bfloat16", "--dropout", "0.1"]


def covering(m, layout: str, elastic: bool = True) -> dict[str, tuple[str, str]]:
    """feature -> (status, detail) for every feature but ``defaults`` (and ``elastic
    resume`` unless ``elastic``), from 4 runs (3); an explicit-style model's row: the
    GPT's flags n/a, 3 runs (2)."""
    explicit = layout.startswith("explicit")
    staged = not matrix.applies(layout, "1f1b")
    combined = [*COMBINED, *STAGED["COMBINED"]] if staged else COMBINED
    if explicit:  # its own blocks: no remat to ask of them
        combined = [f for f in combined if f not in ("--remat", "block")]
    name = matrix.slug(layout, "combined")
    full = run(m.work, name, layout, combined, NAN_ENV)
    want = m.ref(tuple(combined), NAN_ENV, layout)
    params = matrix.params_close(full.params, want.params) if full.code == 0 else 0.0
    evals = close(full.losses("eval_loss"), want.losses("eval_loss"), RTOL)
    error = max(close(full.losses(), want.losses(), RTOL), evals, params)
    together = verdict(full, error, RTOL, "losses, eval losses, skip and params")
    found = {f: together for f in ("eval", "save-params", "replica check", "grad-accum 2")}
    found |= {"remat block": together, "nan skip": together}
    found |= {"shard-optimizer": together, "offload optimizer": together}
    found["interleaved"] = together if staged else ("n/a", matrix.applies(layout, "1f1b"))
    if layout not in RESUMED_ELSEWHERE:
        found["resume"] = matrix.continued(m, name, full, layout, combined, NAN_ENV, exact=True)
    if elastic:
        target = matrix.elastic_target(layout)
        found["elastic resume"] = matrix.continued(
            m, name, full, target, combined, NAN_ENV, exact=layout == target, model=layout
        )
    if explicit:
        return found | {f: ("n/a", matrix.applies(layout, f)) for f in matrix.GPT_ONLY}
    loose_flags = [*LOOSE_FLAGS, *STAGED["LOOSE"]] if staged else LOOSE_FLAGS
    loose = run(m.work, matrix.slug(layout, "loose"), layout, loose_flags)
    error = close(loose.losses(), m.ref(tuple(loose_flags), layout=layout).losses(), LOOSE)
    found["bfloat16"] = found["dropout"] = verdict(loose, error, LOOSE, "bf16 dropout losses")
    found["1f1b"] = found["bfloat16"] if staged else ("n/a", matrix.applies(layout, "1f1b"))
    return found


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return matrix.Matrix(tmp_path_factory.mktemp("matrix"))


# data=8's pairs are the rest of the suite's: resume (test_checkpoint.py), eval
# (test_cli.py), save-params, replica check (test_health_agreement.py), grad-accum
# (test_equivalence.py), bf16 (test_precision.py), remat (test_layouts_cli.py), dropout
# (test_dropout_contract.py), nan skip (test_cli_health.py).
SHARDED = [layout for layout in matrix.LAYOUTS if layout != "data=8"]
# Elastic resumes onto data=8 from data=4,model=2, fsdp=8, data=2,fsdp=2,model=2
# (test_sharded_save.py) and from stages (stage=2,data=4: test_initial_state_layouts.py)
# are tested there, bit for bit: here only from 2 processes' sharded checkpoint.
ELASTIC_HERE = ["2 procs x 4: fsdp=2,model=4", "explicit, 2 procs x 4: fsdp=4,model=2"]
# 2 processes resuming on their own layout, bit for bit: test_checkpoint_cluster.py (a
# requeued SLURM job, a group restarted twice) and test_preemption.py; not again here (a
# 2-process run is 16 s of the suite's 20 minutes).
RESUMED_ELSEWHERE = ["2 procs x 4: fsdp=2,model=4", "explicit, 2 procs x 4: fsdp=4,model=2"]


# Two workers' groups, each layout with the rows whose 1-device references it shares (a
# group's references are run once, in its worker): the stage layouts (4 layers,
# interleaved, 1F1B) in one, the others, the 2-process one among them, in the other.
SECOND_GROUP = {"stage=2,data=4", "stage=2,fsdp=2,model=2", "llama: stage=2,fsdp=2,model=2",
                "gemma: stage=2,fsdp=2,model=2"}  # fmt: skip


@pytest.mark.parametrize(
    "layout",
    [
        pytest.param(x, marks=pytest.mark.xdist_group("matrix2" if x in SECOND_GROUP else "matrix"))
        for x in SHARDED
    ],
)
def test_every_feature_runs_and_matches_its_reference(runs, layout):
    found = covering(runs, layout, elastic=layout in ELASTIC_HERE)
    want = [f for f in ALL if f != "elastic resume" or layout in ELASTIC_HERE]
    want = [f for f in want if f != "resume" or layout not in RESUMED_ELSEWHERE]
    assert sorted(found) == sorted(want)
    na = {f for f, (status, _) in found.items() if status == "n/a"}
    if layout.startswith("explicit"):
        assert na == matrix.GPT_ONLY, na
    else:
        assert na == ({"1f1b", "interleaved"} if "stage" not in layout else set()), na
    failed = {f: detail for f, (status, detail) in found.items() if status not in ("ok", "n/a")}
    assert not failed, failed


@pytest.mark.xdist_group("matrix")
def test_a_gradient_twice_too_large_fails_the_comparison(runs):
    """The comparison can fail: under SGD, twice the learning rate is what a gradient
    twice too large (a pmean of already-summed gradients on 2 devices) would do."""
    flags = [*matrix.SGD, "--steps", "3"]
    want = runs.ref(tuple(flags))
    got = matrix.run(runs.work, "doubled", "fsdp=8", [*flags, "--lr", "0.6"])
    assert got.code == 0 and want.code == 0
    assert matrix.close(got.losses(), want.losses(), matrix.RTOL) > matrix.RTOL
    assert matrix.params_close(got.params, want.params) > matrix.RTOL
