#!/usr/bin/env bash
# verl's Qwen3-1.7B GRPO tutorial on one GPU (80 GB or more): 1,024 prompts x 3, mini-batches of 80
# prompts, responses up to 1,024, activations recomputed, the reference model on the CPU. The memory
# planner picks the micro-batches (`--print_plan --gpu_memory_gib 80` shows them).
set -euo pipefail
ROOT=$(dirname "$0")/..  # the train scripts
[ -x "$ROOT/.venv/bin/torchrun" ] && : "${TORCHRUN:=$ROOT/.venv/bin/torchrun}"  # make install's, else PATH's
MODEL=${MODEL:-Qwen/Qwen3-1.7B}
DATA=${DATA:-$HOME/data/gsm8k}
exec ${TORCHRUN:-torchrun} --nproc_per_node=${NPROC:-1} "$ROOT/train_grpo.py" --model "$MODEL" \
    --train_files "$DATA/train.parquet" --val_files "$DATA/test.parquet" \
    --train_batch_size 1024 --rollout_n 3 --ppo_mini_batch_size 80 --max_response_length 1024 \
    --enable_gradient_checkpointing --ref_param_offload --filter_overlong_prompts --test_freq 5 "$@"
