#!/usr/bin/env bash
# Launch megaflex training with the deepspeed launcher.
#
#   One machine, N GPUs:      NPROC=8 bash launch/train.sh --config configs/flexformer_n_41m.yaml
#   One machine, CPU ranks:   NPROC=2 bash launch/train.sh --config configs/tiny.yaml   (gloo, no GPU)
#   Several machines (ssh):   HOSTFILE=launch/hostfile bash launch/train.sh --config ...  (ssh to every node)
#   Several machines, no ssh: on every node, HOSTFILE=... NO_SSH=1 NODE_RANK=<i> MASTER_ADDR=<node 0>
#                             bash launch/train.sh --config ...   (what launch/slurm.sbatch runs via srun)
#
# Everything after the script name goes to megaflex-train (configs and key=value overrides).
# Device: the configs' train.device (cpu | cuda | auto). A node with NVIDIA GPUs that torch cannot use
# (CPU-only torch, driver mismatch, CUDA_VISIBLE_DEVICES='') is an error naming the cause; CPU ranks
# (gloo) run on a node without GPUs, or anywhere with train.device=cpu.
# Environment: NPROC (ranks per node, default: GPUs, else 1), CUDA_VISIBLE_DEVICES (one machine: the
# ranks use those GPUs, the first NPROC of them), HOSTFILE, NO_SSH, NODE_RANK (default $SLURM_NODEID,
# else 0), MASTER_ADDR (default: first host of the hostfile / localhost), MASTER_PORT (default
# 20000 + SLURM_JOB_ID % 10000 under Slurm, else 29500),
# OMP_NUM_THREADS (default 1 per rank on CPU, 4 on GPU), NCCL_* are passed through,
# MEGAFLEX_SKIP_SETUP=1 uses the current environment instead of launch/setup_env.sh.
#
# Signals: SIGTERM/SIGINT/SIGUSR1 to this script are forwarded to the rank processes (the deepspeed
# runner does not forward them), which save a checkpoint after the current step and exit; the
# runner ignores SIGUSR1 (Slurm's preemption warning may reach every process of the step). The exit
# status is megaflex-train's: 0 finished, 75 stopped by a signal (checkpoint saved), 2 config or
# checkpoint error, 3 non-finite abort, 1 other errors (docs/training.md, "Failure modes").
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
[ -n "${MEGAFLEX_SKIP_SETUP:-}" ] || source "$repo/launch/setup_env.sh"
cd "$repo"
port="${MASTER_PORT:-29500}"
if [ -z "${MASTER_PORT:-}" ] && [[ "${SLURM_JOB_ID:-}" =~ ^[0-9]+$ ]]; then
  # One port per job: two jobs whose first node is the same would both listen on 29500. Below the
  # ephemeral range (32768+), so no outgoing connection holds it.
  port=$(( 20000 + SLURM_JOB_ID % 10000 ))
fi
# "cuda <GPUs>" or "cpu 0" from the configs' train.device; a node whose GPUs torch cannot use stops
# here with the cause (exit 2), it never falls back to CPU unless train.device=cpu asks for it.
probe="$(python launch/resolve_device.py "$@")"   # set -e: its exit status 2 ends the script
read -r device gpus <<< "$probe"
if [ "$device" = cuda ]; then
  export OMP_NUM_THREADS="${OMP_NUM_THREADS:-4}"
else
  export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
  export DS_ACCELERATOR=cpu
fi
nproc="${NPROC:-$(( gpus > 0 ? gpus : 1 ))}"
if [ "$gpus" -eq 0 ]; then
  # CPU: the launcher counts "slots" from LOCAL_SIZE; ranks talk over gloo.
  export LOCAL_SIZE="$nproc"
fi
if [ -n "${HOSTFILE:-}" ]; then
  python launch/check_hostfile.py "$HOSTFILE" ${CHECK_SSH:+--ssh}
  master="${MASTER_ADDR:-$(grep -v '^\s*#' "$HOSTFILE" | awk 'NF{print $1; exit}')}"
  hostfile="$HOSTFILE"
  node_args=()
  if [ -n "${NO_SSH:-}" ]; then
    # One launcher per node, each starting its own ranks (no pdsh/ssh).
    node_rank="${NODE_RANK:-${SLURM_NODEID:-0}}"
    node_args=(--no_ssh --node_rank "$node_rank")
    slurm_gpus="${CUDA_VISIBLE_DEVICES:-${SLURM_STEP_GPUS:-}}"
    if [ "$gpus" -gt 0 ] && [ -n "$slurm_gpus" ]; then
      # The launcher would hand this node's ranks GPUs 0..slots-1 over the ones Slurm allocated
      # (CUDA_VISIBLE_DEVICES, e.g. 4-7 on a shared node): name Slurm's in --include instead.
      hostfile="$(mktemp "${TMPDIR:-/tmp}/megaflex-hostfile-XXXXXX")"
      trap 'rm -f "$hostfile"' EXIT
      include="$(python launch/check_hostfile.py "$HOSTFILE" --node-rank "$node_rank" --gpus "$slurm_gpus" \
        --local-hostfile "$hostfile")"
      node_args+=(--include "$include")
    fi
  fi
  launcher=(deepspeed --hostfile "$hostfile" --master_addr "$master" --master_port "$port" ${node_args[@]+"${node_args[@]}"})
elif [ "$gpus" -gt 0 ] && [ -n "${CUDA_VISIBLE_DEVICES:-}" ]; then
  # --num_gpus would make deepspeed ignore CUDA_VISIBLE_DEVICES and take GPUs 0..N-1: name the
  # visible ones (the first NPROC of them) instead; deepspeed hands each rank its own.
  IFS=, read -ra visible <<< "$CUDA_VISIBLE_DEVICES"
  for id in "${visible[@]}"; do
    [[ "$id" =~ ^[0-9]+$ ]] || { echo "error: CUDA_VISIBLE_DEVICES=$CUDA_VISIBLE_DEVICES: the deepspeed launcher takes GPU indices, not '$id'" >&2; exit 2; }
  done
  if [ "$nproc" -gt "${#visible[@]}" ]; then
    echo "error: NPROC=$nproc but CUDA_VISIBLE_DEVICES=$CUDA_VISIBLE_DEVICES shows ${#visible[@]} GPUs" >&2
    exit 2
  fi
  launcher=(deepspeed --include "localhost:$(IFS=,; echo "${visible[*]:0:nproc}")" --master_port "$port")
else
  launcher=(deepspeed --num_gpus "$nproc" --master_port "$port")
fi

# Not `exec`: this shell stays to forward signals. The runner's children are the per-node
# `deepspeed.launcher.launch` processes, whose children are the ranks.
# USR1 is ignored by the runner and the launch processes (inherited: `trap ''` before starting
# them), whose default action on it is to die: a USR1 sent to every process of a Slurm step (srun
# forwarding it, `scancel --signal=USR1`) then reaches the ranks, which set their own handler, and
# this shell, which forwards it too (a rank takes a second one as the same request).
trap '' USR1
"${launcher[@]}" --module megaflex.train "$@" &
runner=$!
forward() {
  local launch
  for launch in $(pgrep -P "$runner" || true); do
    pkill "-$1" -P "$launch" || true
  done
}
trap 'forward TERM' TERM
trap 'forward INT' INT
trap 'forward USR1' USR1
status=0
while :; do
  wait "$runner" && status=0 || status=$?
  kill -0 "$runner" 2>/dev/null || break   # wait returned for a trapped signal: keep waiting
done
if [ "$status" -gt 128 ]; then   # interrupted by a trap just as the runner ended: its own status
  final=0; wait "$runner" 2>/dev/null || final=$?
  [ "$final" -eq 127 ] || status=$final
fi
exit "$status"
