"""``python -m jaxdist.launch.requeue RC``: what a SLURM batch script does after ``srun`` returned
RC (the highest of its tasks' exit codes; ``slurm/*.sh``).

Requeue when running again can succeed (``failures.requeues``): the job goes back in the
queue and resumes from its run dir's checkpoints. Never forever: SLURM counts a job's
requeues in ``SLURM_RESTART_COUNT`` (unset on its first start), and at
``JAXDIST_MAX_REQUEUES`` (default 20) the job ends instead, saying how to continue.
"""

from __future__ import annotations

import os
import subprocess
import sys

from jaxdist.cluster import failures

DEFAULT_MAX_REQUEUES = 20


def decide(rc: int, job_id: str, requeues: int, max_requeues: int) -> tuple[bool, str]:
    """(requeue?, the line the job's log gets: "" for a run that finished)."""
    if rc == 0:
        return False, ""
    if not failures.requeues(rc):
        return False, (
            f"jaxdist: exit {rc}: not requeueing job {job_id}: running it again would fail "
            "the same way"
        )
    if requeues >= max_requeues:
        return False, (
            f"jaxdist: exit {rc}: not requeueing job {job_id}: requeued {requeues} times "
            f"(JAXDIST_MAX_REQUEUES={max_requeues}); to continue, sbatch again with "
            "--run-dir set to the run dir named at the top of this log"
        )
    return True, (f"jaxdist: exit {rc}: requeueing job {job_id} ({requeues + 1} of {max_requeues})")


def main(argv: list[str]) -> int:
    (rc,) = argv
    job_id = os.environ["SLURM_JOB_ID"]
    requeues = int(os.environ.get("SLURM_RESTART_COUNT") or 0)
    max_requeues = int(os.environ.get("JAXDIST_MAX_REQUEUES") or DEFAULT_MAX_REQUEUES)
    requeue, line = decide(int(rc), job_id, requeues, max_requeues)
    if line:
        print(line, flush=True)
    if requeue:
        return subprocess.run(["scontrol", "requeue", job_id], check=False).returncode
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
