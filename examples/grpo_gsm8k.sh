#!/usr/bin/env bash
# verl's GSM8K GRPO tutorial (Qwen2.5-0.5B-Instruct, 256 prompts x 5, KL loss 0.001 low_var_kl, lr
# 1e-6, responses up to 1,024 tokens) on one GPU: the defaults. Its step time and its accuracy after
# 26 steps: the README's Results (the rows of the one-GPU command). Extra flags go after the
# script's name: bash examples/grpo_gsm8k.sh --seed 2 --total_training_steps 26
set -euo pipefail
ROOT=$(dirname "$0")/..  # the train scripts
[ -x "$ROOT/.venv/bin/torchrun" ] && : "${TORCHRUN:=$ROOT/.venv/bin/torchrun}"  # make install's, else PATH's
MODEL=${MODEL:-Qwen/Qwen2.5-0.5B-Instruct}
DATA=${DATA:-$HOME/data/gsm8k}  # python data/gsm8k.py --local_save_dir $DATA
exec ${TORCHRUN:-torchrun} --nproc_per_node=${NPROC:-1} "$ROOT/train_grpo.py" --model "$MODEL" \
    --train_files "$DATA/train.parquet" --val_files "$DATA/test.parquet" "$@"
