#!/usr/bin/env bash
# The GRPO tutorial on one node with 8 GPUs: each GPU trains on its share of the batch (FSDP2) and
# generates with its own vLLM replica.
set -euo pipefail
ROOT=$(dirname "$0")/..  # the train scripts
[ -x "$ROOT/.venv/bin/torchrun" ] && : "${TORCHRUN:=$ROOT/.venv/bin/torchrun}"  # make install's, else PATH's
MODEL=${MODEL:-Qwen/Qwen2.5-0.5B-Instruct}
DATA=${DATA:-$HOME/data/gsm8k}
exec ${TORCHRUN:-torchrun} --nproc_per_node=${NPROC:-8} "$ROOT/train_grpo.py" --model "$MODEL" \
    --train_files "$DATA/train.parquet" --val_files "$DATA/test.parquet" "$@"
