"""``experiments/long_context.py`` on 8 emulated devices at a short length: at one seq
size every split of attention trains the same model on the same tokens, so the losses
of ring, gather and all-to-all agree (within 1e-5), and each row reports its memory."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "experiments"))
import long_context  # noqa: E402


def test_every_way_gives_the_same_loss_and_reports_its_memory(tmp_path):
    out = tmp_path / "rows.jsonl"
    rows = long_context.main(["--lengths", "64", "--seq", "1", "4", "--steps", "1",
                              "--out", str(out)])  # fmt: skip
    assert [(r["seq"], r["way"]) for r in rows] == [
        (1, "-"),
        (4, "ring"),
        (4, "gather"),
        (4, "all-to-all"),
    ]
    np.testing.assert_allclose([r["loss"] for r in rows[1:]], rows[1]["loss"], rtol=1e-5)
    assert all(r["temp_bytes"] > 0 and r["step_s"] > 0 for r in rows)
    assert len(out.read_text().splitlines()) == 4
