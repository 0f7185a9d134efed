"""``python -m jaxdist.report``: the page and its PNGs for runs of different lengths,
with and without evaluation, a run still being written, and a directory that is not a
run. The runs are test_observe's (real in-process CPU runs)."""

from __future__ import annotations

import base64
import re
import shutil

from jaxdist.report import main
from test_observe import runs  # noqa: F401 - the shared runs fixture

PNG = b"\x89PNG\r\n\x1a\n"
CHARTS = ("loss-step", "loss-seen", "throughput", "step-time", "goodput")


def test_report_on_two_runs_of_different_lengths_one_without_eval(runs, tmp_path, capsys):  # noqa: F811
    dirs = runs[0]
    out = tmp_path / "out" / "compare.html"
    assert main([str(dirs["eval"]), str(dirs["plain"]), "--out", str(out)]) == 0
    page = out.read_text()
    embedded = re.findall(r'src="data:image/png;base64,([^"]+)"', page)
    assert len(embedded) == len(CHARTS)
    for chart, data in zip(CHARTS, embedded, strict=True):
        png = (tmp_path / "out" / f"compare-{chart}.png").read_bytes()
        assert png.startswith(PNG) and base64.b64decode(data) == png, chart
    # the final figures: each run's steps (of its planned steps) and the config differences
    assert "<td>7 of 7</td>" in page and "<td>4 of 4</td>" in page
    assert "<td>train.steps</td><td>7</td><td>4</td>" in page
    assert "<td>train.eval_every</td><td>3</td><td>0</td>" in page
    assert "with-eval" in page and "no-eval" in page
    assert "wrote" in capsys.readouterr().out


def test_report_on_a_run_still_being_written(runs, tmp_path):  # noqa: F811
    dirs = runs[0]
    live = tmp_path / "live"
    shutil.copytree(dirs["plain"], live)
    (live / "goodput.json").unlink()  # not written yet
    with (live / "metrics.jsonl").open("a") as metrics:
        metrics.write('{"step": 5, "loss": 1.2')  # a record half written
    assert main([str(live), "--out", str(tmp_path / "r.html")]) == 0
    page = (tmp_path / "r.html").read_text()
    assert "<td>4 of 4</td>" in page  # the torn record left out
    assert not (tmp_path / "r-goodput.png").exists()  # no goodput to draw


def test_a_directory_that_is_not_a_run_is_exit_2_and_writes_nothing(runs, tmp_path, capsys):  # noqa: F811
    dirs = runs[0]
    (tmp_path / "empty").mkdir()
    out = tmp_path / "r.html"
    assert main([str(dirs["eval"]), str(tmp_path / "empty"), "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert f"jaxdist report: error: {tmp_path / 'empty'} is not a run directory" in err
    assert "no metrics.jsonl" in err and "Traceback" not in err
    assert main([str(tmp_path / "missing"), "--out", str(out)]) == 2
    assert "missing: no such directory" in capsys.readouterr().err
    assert list(tmp_path.glob("r*")) == []
