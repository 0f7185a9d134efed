#!/bin/bash
# jaxdist on 8 nodes x 8 GPUs: one process per GPU, 64 in all.
#
#   sbatch slurm/8node.sh --model gpt --global-batch-size 512 --steps 5000
#
# Everything after the script name goes to `python -m jaxdist.train`. Each task is one
# process; JAX reads SLURM's environment (SLURM_PROCID, SLURM_NTASKS, SLURM_STEP_NODELIST)
# and makes the first node the coordinator. On a CPU-only cluster the same script runs as
#   JAXDIST_PLATFORM=cpu sbatch --gpus-per-node=0 --ntasks-per-node=1 slurm/8node.sh --cpu-devices 1 ...
#
# Preemption: SIGUSR1 (below) or SIGTERM makes every process stop after the same step,
# save a checkpoint and exit 75; the job then requeues itself and resumes from that
# checkpoint (as after a dead process, 76, or a hang, 77; see the exit codes below). It finds it because the default run dir, runs/<model>-<strategy>-slurm<id>,
# is named by SLURM_JOB_ID, which a requeued job keeps (with --run-dir, pass the same dir).
#SBATCH --job-name=jaxdist
#SBATCH --nodes=8
#SBATCH --ntasks-per-node=8          # one process per GPU: 8 nodes * 8 = 64 processes
#SBATCH --gpus-per-node=8
#SBATCH --cpus-per-task=12           # data loading and the host side of each GPU's process
#SBATCH --time=04:00:00
#SBATCH --output=%x-%j.out           # one log for the job; lines of ranks > 0 say [rank N]
#SBATCH --signal=USR1@120            # 2 minutes' warning: jaxdist stops cleanly (exit 75)
#SBATCH --requeue                    # a preempted or stopped job goes back in the queue
#SBATCH --open-mode=append           # a requeued job adds to its log instead of replacing it
set -uo pipefail

# XLA: overlap the gradient all-reduce with the backward pass instead of waiting for it.
export XLA_FLAGS="${XLA_FLAGS:-} --xla_gpu_enable_latency_hiding_scheduler=true"
# Let JAX take 90% of each H100's 80 GB up front (default 75%): fewer OOMs, no regrowth.
export XLA_PYTHON_CLIENT_MEM_FRACTION="${XLA_PYTHON_CLIENT_MEM_FRACTION:-0.90}"
# NCCL: NVLink SHARP (NVLS) on H100 NVSwitch systems does intra-node all-reduce in the
# switch; WARN makes NCCL say why a collective failed instead of hanging silently.
export NCCL_NVLS_ENABLE="${NCCL_NVLS_ENABLE:-1}"
export NCCL_DEBUG="${NCCL_DEBUG:-WARN}"
# Compiled programs cached on the shared filesystem: a requeued job skips recompiling.
export JAX_COMPILATION_CACHE_DIR="${JAX_COMPILATION_CACHE_DIR:-$PWD/.jax-cache}"
# JAXDIST_PLATFORM (cpu or gpu) is passed through to every task as it is.

# --kill-on-bad-exit=0: a stopping group's processes exit 75 one after another, and with =1
# the first exit kills the others (srun then returns 128 + the signal: no requeue).
# --wait=120: once one process has exited, the others get 2 minutes, then srun kills them
# (a frozen process never exits by itself; the others name it and exit 77 first).
srun --kill-on-bad-exit=0 --wait=120 python -m jaxdist.train "$@"
rc=$?
# jaxdist's exit codes (README "Exit codes"); srun returns the highest of its tasks'.
# Requeue when running again can succeed: 75 preempted (checkpoint saved), 76 a process
# died, 77 hang, a task killed by a signal (a lost node); never after 1, 2, 78 or 79, and
# at most JAXDIST_MAX_REQUEUES (20) times, so a run that cannot finish does not requeue
# forever (jaxdist/launch/requeue.py says which, and runs scontrol requeue).
python -m jaxdist.launch.requeue "$rc"
exit "$rc"
