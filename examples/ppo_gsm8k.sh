#!/usr/bin/env bash
# verl's PPO quickstart on GSM8K (Qwen2.5-0.5B-Instruct with a critic on the same body, 256 prompts
# x 1, responses up to 512, KL in the reward 0.001): the defaults of train_ppo.py. Its step time:
# the README's Results (the PPO row).
set -euo pipefail
ROOT=$(dirname "$0")/..  # the train scripts
[ -x "$ROOT/.venv/bin/torchrun" ] && : "${TORCHRUN:=$ROOT/.venv/bin/torchrun}"  # make install's, else PATH's
MODEL=${MODEL:-Qwen/Qwen2.5-0.5B-Instruct}
DATA=${DATA:-$HOME/data/gsm8k}
exec ${TORCHRUN:-torchrun} --nproc_per_node=${NPROC:-1} "$ROOT/train_ppo.py" --model "$MODEL" \
    --train_files "$DATA/train.parquet" --val_files "$DATA/test.parquet" "$@"
