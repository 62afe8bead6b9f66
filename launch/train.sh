#!/usr/bin/env bash
# Launch megaflex training with the deepspeed launcher.
#
#   One machine, N GPUs:      NPROC=8 bash launch/train.sh --config configs/flexformer_n_41m.yaml
#   One machine, CPU ranks:   NPROC=2 bash launch/train.sh --config configs/tiny.yaml   (gloo, no GPU)
#   Several machines:         HOSTFILE=launch/hostfile bash launch/train.sh --config ...  (ssh to every node)
#
# Everything after the script name goes to megaflex-train (configs and key=value overrides).
# Environment: NPROC (ranks per node, default: GPUs, else 1), HOSTFILE, MASTER_ADDR (default:
# first host of the hostfile / localhost), MASTER_PORT (default 29500), OMP_NUM_THREADS (default 1
# per rank on CPU, 4 on GPU), NCCL_* are passed through (see docs/training.md).
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$repo/launch/setup_env.sh"
cd "$repo"
port="${MASTER_PORT:-29500}"
if python -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
  gpus="$(python -c 'import torch; print(torch.cuda.device_count())')"
  export OMP_NUM_THREADS="${OMP_NUM_THREADS:-4}"
else
  gpus=0
  export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
  export DS_ACCELERATOR=cpu
fi
nproc="${NPROC:-$(( gpus > 0 ? gpus : 1 ))}"
if [ -n "${HOSTFILE:-}" ]; then
  python launch/check_hostfile.py "$HOSTFILE" ${CHECK_SSH:+--ssh}
  master="${MASTER_ADDR:-$(grep -v '^\s*#' "$HOSTFILE" | awk 'NF{print $1; exit}')}"
  exec deepspeed --hostfile "$HOSTFILE" --master_addr "$master" --master_port "$port" \
    --module megaflex.train "$@"
fi
if [ "$gpus" -eq 0 ]; then
  # CPU: the launcher counts "slots" from LOCAL_SIZE; ranks talk over gloo.
  export LOCAL_SIZE="$nproc"
fi
exec deepspeed --num_gpus "$nproc" --master_port "$port" --module megaflex.train "$@"
