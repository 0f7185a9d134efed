"""MFU: a run with --peak-tflops on a CPU shows it in metrics.jsonl, TensorBoard, the
FLOPs line, the progress lines and the summary table; a run without a peak shows none;
the GPT's formula and XLA's count; the peak table. The MLP runs are test_observe's."""

from __future__ import annotations

import re

import pytest

from helpers import metrics_of
from jaxdist.train import config as config_lib
from jaxdist.train.trainer import train
from test_observe import PEAK_TFLOPS, runs, scalars, summary_rows  # noqa: F401

FLOPS_LINE = r"FLOPs per step: XLA cost analysis (\S+); (.*) \(cpu\)"


def test_a_known_peak_shows_mfu_everywhere_a_run_reports(runs):  # noqa: F811
    """The plain run: 2 devices at PEAK_TFLOPS each; an MLP has no formula, so MFU uses
    XLA's count, the same for every step."""
    dirs, _, printed = runs
    logged = metrics_of(dirs["plain"])
    peak = PEAK_TFLOPS * 1e12 * 2
    assert "mfu" not in logged[0]  # the first step compiles: no MFU of it
    flops = [r["mfu"] * r["step_time_s"] * peak for r in logged[1:]]
    assert flops == pytest.approx([flops[0]] * len(flops), rel=1e-9)
    xla, peak_text = re.search(FLOPS_LINE, printed["plain"]).groups()
    assert float(xla) == pytest.approx(flops[0], rel=5e-3) and peak_text == "peak 2e+09 FLOP/s"
    for r in logged[1:]:  # the progress lines (plain ones: not a terminal)
        assert re.search(rf"step {r['step']}/4 .* mfu {r['mfu']:.1%} ", printed["plain"])
    tensorboard = [(e.step, e.value) for e in scalars(dirs["plain"] / "tb").Scalars("perf/mfu")]
    assert tensorboard == [(r["step"], pytest.approx(r["mfu"], rel=1e-6)) for r in logged[1:]]
    # the summary: XLA's FLOPs over the mean step time of steps 2..4, against the peak
    mean_s = sum(r["step_time_s"] for r in logged[1:]) / 3  # logged every step
    mfu = float(summary_rows(printed["plain"])["MFU"].rstrip("%")) / 100
    assert mfu == pytest.approx(flops[0] / mean_s / peak, abs=5e-4 + 1e-9)


def test_without_a_peak_a_cpu_run_shows_no_mfu(runs):  # noqa: F811
    dirs, _, printed = runs
    assert not any("mfu" in r for r in metrics_of(dirs["eval"]))
    assert "perf/mfu" not in scalars(dirs["eval"] / "tb").Tags()["scalars"]
    xla, peak_text = re.search(FLOPS_LINE, printed["eval"]).groups()
    assert float(xla) > 0 and peak_text == "no peak"
    assert "MFU" not in summary_rows(printed["eval"]) and " mfu " not in printed["eval"]


def test_mfu_uses_the_gpt_formula_and_xla_counts_every_device(tmp_path):
    """The GPT's 6N + 12 L d T per token, N counted here from a model built here; XLA's
    count, per device x devices, is the same FLOPs on 2 devices and on 8."""
    import jax
    from flax import nnx

    from jaxdist.models.gpt import GPT

    dims = dict(seq_len=8, d_model=16, n_layers=1, n_heads=2)
    n = sum(x.size for x in jax.tree.leaves(nnx.state(GPT(257, **dims, rngs=nnx.Rngs(0)))))
    formula = (6 * n + 12 * 1 * 16 * 8) * 8 * 8  # per token x tokens per step
    flops = {}
    for devices in (2, 8):
        config = _gpt_config(dims, devices)
        run = train(config, write=False, quiet=True)
        flops[devices] = run.flops
        mfu_records = [r for r in run.history if "mfu" in r]
        assert mfu_records and all(r["mfu"] > 0 for r in mfu_records)
        for r in mfu_records:  # mfu x step time x peak of all devices = the formula's FLOPs
            peak = 1e-3 * 1e12 * devices
            assert r["mfu"] * r["step_time_s"] * peak == pytest.approx(formula, rel=1e-9)
    assert flops[2].analytic == flops[8].analytic == formula
    # Not divided by the devices (that would be 1/4): more only by the optimizer update
    # every replica repeats on its copy of the parameters.
    assert 1 <= flops[8].xla / flops[2].xla < 1.5
    assert 0.5 < flops[8].xla / formula < 2  # the same order: nothing counted once per device


def _gpt_config(dims: dict, devices: int):
    return config_lib.from_dict(
        {
            "model": {"name": "gpt", **dims},
            "data": {"path": "grammar"},
            "train": dict(
                steps=3, global_batch_size=8, log_every=1, num_devices=devices, peak_tflops=1e-3
            ),
        }
    )


def test_peak_table_by_device_kind_and_dtype():
    from jaxdist.flops import peak_flops

    assert peak_flops("NVIDIA H100 80GB HBM3", "bfloat16") == 989e12
    assert peak_flops("NVIDIA H100 PCIe", "bfloat16") == 756e12
    assert peak_flops("NVIDIA A100-SXM4-80GB", "float32") == 156e12  # JAX's default: TF32
    assert peak_flops("NVIDIA B200", "bfloat16", peak_tflops=100) == 100e12
    assert peak_flops("cpu", "float32") is None
