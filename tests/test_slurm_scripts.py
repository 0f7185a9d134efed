"""What the SLURM scripts do with jaxdist's exit codes, with a stand-in ``srun`` (no
cluster needed): requeue on 75 (stopped, checkpoint saved), 76 (a dead process), 77 (a
hang) and deaths by a signal, at most ``JAXDIST_MAX_REQUEUES`` times; never on 1, 2, 78
or 79, which would fail the same way again."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def stand_ins(tmp_path: Path, code: int = 75) -> dict[str, str]:
    """A PATH whose ``srun`` exits ``code`` (75: a stopped run) and whose ``scontrol``
    records its arguments in ``scontrol.log``."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "srun").write_text(f"#!/bin/sh\nexit {code}\n")
    (bin_dir / "scontrol").write_text(f'#!/bin/sh\necho "$@" >> {tmp_path}/scontrol.log\n')
    for tool in bin_dir.iterdir():
        tool.chmod(0o755)
    path = os.pathsep.join([str(bin_dir), str(Path(sys.executable).parent), os.environ["PATH"]])
    return {"PATH": path, "SLURM_JOB_ID": "7"}  # the scripts' python: this one


@pytest.mark.parametrize("script", ["1node.sh", "8node.sh"])
@pytest.mark.parametrize(
    ("restarts", "limit", "requeued"),
    [(None, None, "1 of 20"), ("19", None, "20 of 20"), ("20", None, None), ("2", "2", None)],
)
def test_the_scripts_requeue_on_75_at_most_jaxdist_max_requeues_times(
    tmp_path, script, restarts, limit, requeued
):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "JAXDIST_"))}
    env.update(stand_ins(tmp_path))
    if restarts is not None:  # SLURM leaves it unset on a job's first start
        env["SLURM_RESTART_COUNT"] = restarts
    if limit is not None:
        env["JAXDIST_MAX_REQUEUES"] = limit
    done = subprocess.run(
        ["bash", str(ROOT / "slurm" / script)], env=env, capture_output=True, text=True, timeout=30
    )
    assert done.returncode == 75, done.stderr
    scontrol_log = tmp_path / "scontrol.log"
    if requeued:
        assert f"jaxdist: exit 75: requeueing job 7 ({requeued})" in done.stdout
        assert scontrol_log.read_text() == "requeue 7\n"
    else:
        assert f"not requeueing job 7: requeued {restarts} times" in done.stdout, done.stdout
        assert not scontrol_log.exists()


@pytest.mark.parametrize("script", ["1node.sh", "8node.sh"])
@pytest.mark.parametrize(
    ("code", "requeued"),
    [(76, True), (77, True), (137, True), (1, False), (2, False), (78, False), (79, False)],
)
def test_the_scripts_requeue_on_a_dead_peer_or_hang_never_on_bad_input(
    tmp_path, script, code, requeued
):
    """README "Exit codes": a dead process (76), a hang (77) or a task killed by a signal
    (a lost node) requeue; a failed loss (1), bad input (2), a mismatch (78) or diverged
    replicas (79) would fail the same way again: no requeue."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "JAXDIST_"))}
    env.update(stand_ins(tmp_path, code))
    done = subprocess.run(
        ["bash", str(ROOT / "slurm" / script)], env=env, capture_output=True, text=True, timeout=30
    )
    assert done.returncode == code, done.stderr
    scontrol_log = tmp_path / "scontrol.log"
    if requeued:
        assert f"jaxdist: exit {code}: requeueing job 7 (1 of 20)" in done.stdout
        assert scontrol_log.read_text() == "requeue 7\n"
    else:
        assert f"jaxdist: exit {code}: not requeueing job 7: running it again" in done.stdout
        assert not scontrol_log.exists()
