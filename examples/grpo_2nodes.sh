#!/usr/bin/env bash
# The GRPO tutorial on two nodes: run this same script on each, with HEAD_NODE_IP the address of one
# of them (torchrun's c10d rendezvous; no Ray). Every node must see the checkpoint folder
# (--default_local_dir on a shared file system); --resume_mode auto (the default) resumes from it.
set -euo pipefail
ROOT=$(dirname "$0")/..  # the train scripts
[ -x "$ROOT/.venv/bin/torchrun" ] && : "${TORCHRUN:=$ROOT/.venv/bin/torchrun}"  # make install's, else PATH's
MODEL=${MODEL:-Qwen/Qwen2.5-0.5B-Instruct}
DATA=${DATA:-$HOME/data/gsm8k}
exec ${TORCHRUN:-torchrun} --nnodes=2 --nproc_per_node=${NPROC:-8} --rdzv_backend=c10d \
    --rdzv_endpoint=${HEAD_NODE_IP:?set HEAD_NODE_IP}:${PORT:-29500} \
    --rdzv_id=${RDZV_ID:-grpo_2nodes} \
    "$ROOT/train_grpo.py" --model "$MODEL" \
    --train_files "$DATA/train.parquet" --val_files "$DATA/test.parquet" \
    --default_local_dir ${CKPT_DIR:-checkpoints/grpo/2nodes} "$@"
