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
# JAXDIST_MAX_REQUEUES times: see 8node.sh and jaxdist/launch/requeue.py.
srun --kill-on-bad-exit=0 --wait=120 python -m jaxdist.train "$@"
rc=$?
python -m jaxdist.launch.requeue "$rc"
exit "$rc"
