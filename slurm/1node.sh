#!/bin/bash
# jaxdist on one node with 8 GPUs: one process per GPU.
#
#   sbatch slurm/1node.sh --model gpt --global-batch-size 128
#
# (On one node a single process driving all 8 GPUs works too: --ntasks-per-node=1.)
# Stopped on SIGUSR1 or SIGTERM, the job saves, exits 75, requeues itself and resumes from
# its run dir's checkpoints: the default run dir is named by SLURM_JOB_ID (see 8node.sh).
#SBATCH --job-name=jaxdist-1node
#SBATCH --nodes=1
#SBATCH --ntasks-per-node=8
#SBATCH --gpus-per-node=8
#SBATCH --cpus-per-task=12
#SBATCH --time=04:00:00
#SBATCH --output=%x-%j.out
#SBATCH --signal=USR1@120
#SBATCH --requeue
#SBATCH --open-mode=append
set -uo pipefail

# The same settings as slurm/8node.sh (see there for why each helps), repeated rather than
# sourced: sbatch runs a copy of this file from its spool folder, not from slurm/.
export XLA_FLAGS="${XLA_FLAGS:-} --xla_gpu_enable_latency_hiding_scheduler=true"
export XLA_PYTHON_CLIENT_MEM_FRACTION="${XLA_PYTHON_CLIENT_MEM_FRACTION:-0.90}"
export NCCL_NVLS_ENABLE="${NCCL_NVLS_ENABLE:-1}"
export NCCL_DEBUG="${NCCL_DEBUG:-WARN}"
export JAX_COMPILATION_CACHE_DIR="${JAX_COMPILATION_CACHE_DIR:-$PWD/.jax-cache}"

# Why --kill-on-bad-exit=0, --wait, which exit codes requeue and at most
# JAXDIST_MAX_REQUEUES times: see 8node.sh.
srun --kill-on-bad-exit=0 --wait=120 python -m jaxdist.train "$@"
rc=$?
# jaxdist's exit codes (README "Exit codes"). srun returns the highest of its tasks'.
# Requeue when running again can succeed: 75 preempted (checkpoint saved), 76 a process
# died, 77 hang, and a task killed by a signal (>= 128: a lost node, the OOM killer).
# Never after 1 (training failed: a non-finite loss), 2 (bad input), 78 (the processes
# differ: mismatch) or 79 (replicas diverged): they would fail the same way again.
requeue=0
case "$rc" in 75|76|77) requeue=1 ;; esac
[ "$rc" -ge 128 ] && requeue=1
if [ "$rc" -ne 0 ] && [ "$requeue" -eq 0 ]; then
    echo "jaxdist: exit $rc: not requeueing job $SLURM_JOB_ID: running it again would fail the same way"
elif [ "$requeue" -eq 1 ]; then
    # Never requeue forever (a run that cannot finish, or is stopped at every start):
    # SLURM counts this job's requeues in SLURM_RESTART_COUNT (unset on the first start).
    max_requeues="${JAXDIST_MAX_REQUEUES:-20}"
    requeues="${SLURM_RESTART_COUNT:-0}"
    if [ "$requeues" -lt "$max_requeues" ]; then
        echo "jaxdist: exit $rc: requeueing job $SLURM_JOB_ID ($((requeues + 1)) of $max_requeues)"
        scontrol requeue "$SLURM_JOB_ID"
    else
        echo "jaxdist: exit $rc: not requeueing job $SLURM_JOB_ID: requeued $requeues times" \
            "(JAXDIST_MAX_REQUEUES=$max_requeues); to continue, sbatch again with --run-dir" \
            "set to the run dir named at the top of this log"
    fi
fi
exit "$rc"
