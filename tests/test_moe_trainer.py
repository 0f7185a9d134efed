"""The trainer's side of the MoE Llama (``--moe-experts``; the model against its equations:
``test_moe_llama.py``): two processes of four devices on ``expert=4,data=2`` log what one
device logs, the router metrics in metrics.jsonl and TensorBoard, the capacity mode
dropping the same pairs on every layout, the balance loss falling where the router
starts lopsided, and the flags that cannot work together refused by name."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from helpers import launch, run_cli
from jaxdist.errors import ConfigError
from jaxdist.losses import next_token_loss
from jaxdist.models.llama import Llama
from jaxdist.models.moe import MoESettings
from jaxdist.train import config as config_lib
from jaxdist.train.trainer import train

FLAGS = [
    *("--model", "llama", "--moe-experts", "4", "--moe-top-k", "2", "--moe-ffn-dim", "24"),
    *("--d-model", "32", "--n-layers", "2", "--n-heads", "4", "--n-kv-heads", "2"),
    *("--seq-len", "16", "--data", "grammar", "--global-batch-size", "8", "--steps", "3"),
    *("--log-every", "1", "--checkpoint-every", "0", "--moe-balance-coef", "0.1"),
]
TESTS = Path(__file__).resolve().parent
MOE_METRICS = ("lm_loss", "moe/balance_loss", "moe/z_loss", "moe/share_min", "moe/share_max",
               "moe/dropped_per_row", "moe/share/0", "moe/share/3")  # fmt: skip


def logged(run_dir) -> list[dict]:
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]


# one worker for the module: its fixture is made once, not once per worker
pytestmark = pytest.mark.xdist_group("moe_trainer")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """One device, and 2 processes x 4 devices on expert=4,data=2: their metrics."""
    root = tmp_path_factory.mktemp("moe")
    one = run_cli(*FLAGS, "--cpu-devices", "1", "--run-dir", str(root / "one"), cwd=TESTS)
    assert one.returncode == 0, one.stderr[-3000:]
    two, _ = launch(
        *("--nproc", "2", "--cpu-devices-per-proc", "4", "--"),
        *(sys.executable, "-m", "jaxdist.train", *FLAGS, "--mesh", "expert=4,data=2"),
        *("--run-dir", str(root / "two")),
        cwd=TESTS,
    )
    assert two.returncode == 0, two.stdout[-3000:]
    return root, logged(root / "one"), logged(root / "two")


def test_two_processes_with_experts_split_log_what_one_device_logs(runs):
    _, one, two = runs
    assert len(one) == len(two) == 3
    for name in ("loss", "lm_loss", "moe/balance_loss", "moe/z_loss", "moe/share/1"):
        np.testing.assert_allclose([r[name] for r in two], [r[name] for r in one], rtol=1e-5)


def test_router_metrics_reach_metrics_jsonl_and_tensorboard(runs):
    root, one, _ = runs
    for record in one:
        assert set(MOE_METRICS) <= set(record), sorted(record)
        shares = [record[f"moe/share/{e}"] for e in range(4)]
        assert abs(sum(shares) - 1) < 1e-5  # of the routed pairs
        assert record["moe/share_min"] == pytest.approx(min(shares), abs=1e-6)
        assert record["loss"] > record["lm_loss"]  # the aux losses are in the loss
    events = list((root / "one").rglob("events.out.tfevents*"))
    assert events, "no TensorBoard events written"
    assert b"moe/balance_loss" in b"".join(p.read_bytes() for p in events)


def dropped(*extra: str) -> list[float]:
    config = config_lib.parse_args([*FLAGS, "--moe-capacity-factor", "0.75", *extra])
    return [h["moe/dropped_per_row"] for h in train(config, write=False, quiet=True).history]


def test_capacity_drops_the_same_pairs_on_every_layout():
    """Capacity is per sequence, by position: what one device drops, every layout drops."""
    one = dropped("--num-devices", "1")
    assert all(d > 0 for d in one), one  # 0.75: some pairs do not fit
    for mesh in ("expert=4,data=2", "data=2,fsdp=2,model=2"):
        np.testing.assert_allclose(dropped("--mesh", mesh), one, rtol=1e-6)


def balance_after(coef: float, steps: int = 25) -> tuple[float, float]:
    """(first, last) balance loss of a plain AdamW loop whose router starts sending every
    token to experts 0 and 1, with the balance loss weighted ``coef``."""
    moe = MoESettings(4, 2, ffn_dim=24, balance_coef=coef, z_coef=0.0)
    model = Llama(64, 32, 2, 4, rngs=nnx.Rngs(0), moe=moe)
    for router in (model.blocks[0].moe.router, model.blocks[1].moe.router):
        router.set_value(
            router.get_value().at[:, :2].add(3.0 * jnp.sign(router.get_value()[:, :2]))
        )
    tokens = jax.random.randint(jax.random.key(1), (8, 17), 0, 64)
    graphdef, params = nnx.split(model)
    opt = optax.adam(1e-2)
    state = opt.init(params)

    @jax.jit
    def step(params, state):
        def loss(params):
            return next_token_loss(nnx.merge(graphdef, params), {"tokens": tokens})

        (_, metrics), grads = jax.value_and_grad(loss, has_aux=True)(params)
        updates, state = opt.update(grads, state, params)
        return optax.apply_updates(params, updates), state, metrics["moe/balance_loss"]

    balances = []
    for _ in range(steps):
        params, state, balance = step(params, state)
        balances.append(float(balance))
    return balances[0], balances[-1]


def test_the_balance_loss_falls_where_the_router_starts_lopsided():
    first, last = balance_after(1.0)
    assert first > 1.3, first  # lopsided: 1 is balanced
    assert last < first - 0.2, (first, last)
    # without its weight in the loss it stays where it was: the fall is the loss's doing
    unweighted = balance_after(0.0)
    assert unweighted[1] > last + 0.1, (unweighted, last)


@pytest.mark.parametrize(
    "flags, says",
    [
        (["--moe-top-k", "3"], "--moe-top-k 3 without --moe-experts"),
        (["--moe-experts", "4", "--moe-top-k", "5"], "--moe-top-k 5 exceeds --moe-experts 4"),
        (["--moe-experts", "4", "--moe-dense-layers", "2"], "leaves none of the 2 layers"),
        (["--moe-experts", "4", "--mesh", "expert=2,stage=2,model=2", "--scan-layers"],
         "expert=2 with stage=2: pipeline stages run experts split over expert per replica"),
    ],
)  # fmt: skip
def test_what_cannot_work_is_refused_by_name(flags, says):
    pairs = zip(FLAGS[::2], FLAGS[1::2], strict=True)
    base = [x for flag, value in pairs if not flag.startswith("--moe") for x in (flag, value)]
    with pytest.raises(ConfigError, match=says):
        train(config_lib.parse_args([*base, *flags]), write=False, quiet=True)


def test_experts_for_gemma_or_the_gpt_are_refused():
    for model, says in (("gemma", "--model gemma: its GELU-tanh MLP"),
                        ("gpt", "flag\\(s\\) of --model llama")):  # fmt: skip
        with pytest.raises(ConfigError, match=says):
            config = config_lib.parse_args(["--model", model, "--moe-experts", "4"])
            train(config, write=False, quiet=True)
