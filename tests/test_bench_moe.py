"""experiments/bench_moe.py --cpu, its smallest run: the dense Llama and the MoE on
expert=2,data=4, one JSON line each with every field, the MoE's active parameters the
dense's (the router's D x E per layer aside), and the compiled program's all-to-all bytes
exactly the padded exchange the docstring counts (twice the ideal here: E/N = 4 >= K)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

EXPERIMENTS = Path(__file__).resolve().parents[1] / "experiments"
FIELDS = {"model", "mesh", "expert", "devices", "n_params", "active_params", "step_s",
          "tokens_per_s", "temp_bytes", "total_bytes", "all_to_all_bytes", "ideal_bytes",
          "padded_bytes", "loss", "lm_loss"}  # fmt: skip


def test_bench_moe_cpu_writes_a_record_per_row(tmp_path):
    out = tmp_path / "moe.jsonl"
    command = [sys.executable, str(EXPERIMENTS / "bench_moe.py"), "--cpu", "--experts", "2"]
    proc = subprocess.run(
        [*command, "--steps", "1", "--out", str(out)], capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    dense, moe = [json.loads(x) for x in out.read_text().splitlines()]
    for r in (dense, moe):
        assert set(r) >= FIELDS, FIELDS - set(r)
        assert r["devices"] == 8 and r["step_s"] > 0 and r["total_bytes"] > r["temp_bytes"] > 0
        assert r["tokens_per_s"] == r["batch"] * r["seq_len"] / r["step_s"]
        assert 0 < r["loss"] < 10
    assert (dense["model"], dense["mesh"], dense["all_to_all_bytes"]) == ("dense", "data=8", 0)
    assert (moe["model"], moe["mesh"]) == ("moe", "expert=2,data=4")
    router = moe["d_model"] * moe["experts"] * moe["n_layers"]
    assert moe["active_params"] == dense["n_params"] + router < moe["n_params"]
    ids = 2 * 16 * 64 / 8 * 2 * 4 * moe["n_layers"] / 2  # N n m int32 ids x layers x (N-1)/N
    assert moe["all_to_all_bytes"] == moe["padded_bytes"] == 2 * moe["ideal_bytes"] + ids
    assert "moe   expert=2,data=4" in proc.stdout
