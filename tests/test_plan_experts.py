"""The planner and an ``expert`` axis: layouts with expert for a model with experts
(found by an expert-annotated parameter), none for one without, and the experts'
all_to_all bytes counted among a compiled candidate's collective bytes."""

from __future__ import annotations

import jax
import pytest

from jaxdist.plan import candidates as cands
from jaxdist.plan.targets import parse_target
from jaxdist.train import compile_only
from jaxdist.train import config as config_lib

MOE = ["--model", "moe_model:build", "--in-features", "32", "--num-classes", "4"]
MOE += ["--global-batch-size", "16", "--steps", "1"]


def test_expert_layouts_only_for_a_model_with_experts():
    target = parse_target("cpu:8")
    plain = cands.meshes(target)
    assert all(layout.expert == 1 for layout in plain)
    with_experts = cands.meshes(target, n_experts=4)
    sizes = {layout.expert for layout in with_experts}
    assert sizes == {1, 2, 4}  # the divisors of E = 4 that fit a node of 8
    # with stages only without model: the step refuses expert, stage and model together
    staged = [x for x in with_experts if x.expert > 1 and x.stage > 1]
    assert staged and all(x.model == 1 for x in staged)
    assert any(x.stage > 1 and x.model > 1 and x.expert == 1 for x in with_experts)
    one = next(x for x in with_experts if (x.expert, x.data, x.model) == (4, 2, 1))
    assert one.mesh == "data=2,expert=4" and cands.accum_options(one, 16) == [1, 2]
    assert cands.meshes(target, {"data": 8}, n_experts=4) == [cands.Layout(8, 1, 1, 1)]
    assert "expert" in cands.crossing_axes(cands.Layout(1, 1, 1, 1, expert=8), per_node=4)


def test_the_experts_are_found_and_their_all_to_alls_counted():
    config = config_lib.parse_args(MOE)
    _, _, experts = compile_only.state_facts(config)
    assert experts == 4
    gpt = config_lib.parse_args(["--model", "mlp", "--global-batch-size", "16"])
    assert compile_only.state_facts(gpt)[2] == 0
    split = config_lib.parse_args([*MOE, "--mesh", "expert=4,data=2"])
    measured = compile_only.measure(split, jax.devices(), lambda d: 0)
    exchanged = measured.by_kind.get("all-to-all", 0.0)
    # 3 exchanges of (N, n m, D) rows: out, back, and the results' cotangents out (the
    # rows are the data's, so none goes back), n = 2 rows x 4 tokens a device, m =
    # min(k, E/N) = 1, D = 8 float32, 3/4 of it sent; plus one of the int32 expert ids
    rows = 3 * (4 * 8 * 1 * 8 * 4) * 3 / 4
    assert exchanged == pytest.approx(rows + 4 * 8 * 4 * 3 / 4)
    assert measured.wire_bytes["intra"] >= exchanged  # among the step's collective bytes
