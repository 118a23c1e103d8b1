#!/usr/bin/env bash
# The fastest GSM8K learning recipe measured here (docs/benchmarks.md, "GRPO learns GSM8K"): GRPO
# with DAPO's dynamic sampling from step 8, GRESO's pre-rollout skip, no KL loss, 4 vLLM engines per
# GPU, lr 5e-6, responses up to 512 tokens, 32 steps, validation before training and every 4.
set -euo pipefail
ROOT=$(dirname "$0")/..  # the train scripts
[ -x "$ROOT/.venv/bin/torchrun" ] && : "${TORCHRUN:=$ROOT/.venv/bin/torchrun}"  # make install's, else PATH's
MODEL=${MODEL:-Qwen/Qwen2.5-0.5B-Instruct}
DATA=${DATA:-$HOME/data/gsm8k}
exec ${TORCHRUN:-torchrun} --nproc_per_node=${NPROC:-1} "$ROOT/train_grpo.py" --model "$MODEL" \
    --train_files "$DATA/train.parquet" --val_files "$DATA/test.parquet" \
    --filter_groups --filter_groups_from_step 8 --skip_all_equal --use_kl_loss false \
    --engines_per_gpu 4 --max_num_seqs 2048 --actor_lr 5e-6 --max_response_length 512 \
    --total_training_steps 32 --test_freq 4 --val_before_train true --save_freq 4 \
    --seed ${SEED:-1} "$@"
