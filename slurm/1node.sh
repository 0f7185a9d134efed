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

# Why --kill-on-bad-exit=0 and at most JAXDIST_MAX_REQUEUES requeues: see 8node.sh.
srun --kill-on-bad-exit=0 python -m jaxdist.train "$@"
rc=$?
if [ "$rc" -eq 75 ]; then
    max_requeues="${JAXDIST_MAX_REQUEUES:-20}"
    requeues="${SLURM_RESTART_COUNT:-0}"
    if [ "$requeues" -lt "$max_requeues" ]; then
        echo "jaxdist: exit 75: requeueing job $SLURM_JOB_ID ($((requeues + 1)) of $max_requeues)"
        scontrol requeue "$SLURM_JOB_ID"
    else
        echo "jaxdist: exit 75: not requeueing job $SLURM_JOB_ID: requeued $requeues times" \
            "(JAXDIST_MAX_REQUEUES=$max_requeues); to continue, sbatch again with --run-dir" \
            "set to the run dir named at the top of this log"
    fi
fi
exit "$rc"
