#!/usr/bin/env bash
# Your own data and reward on a CPU, start to finish in under a minute: a tiny random model, a parquet
# of your prompts (examples/quickstart/data.py), a reward function (examples/quickstart/reward.py),
# and the few flags a small data set needs (the defaults are verl's GSM8K tutorial: 256 prompts a
# step). The engine is vLLM's CPU build, as on a GPU. Swap in your model (MODEL=a hub id or folder),
# your data (DATA=a folder with train.parquet and test.parquet) and your reward file; prompts longer
# than --max_prompt_length tokens are refused by name, so raise it for longer ones. The tiny model is
# random: this run shows the plumbing works (data, reward, engine, update, export), its scores stay
# near 0; a real MODEL learns.
#   bash examples/quickstart_cpu.sh [more flags]      # OUT=/tmp/quickstart by default
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
PY=${PY:-$ROOT/.venv/bin/python}
OUT=${OUT:-/tmp/quickstart}
MODEL=${MODEL:-$OUT/model}
DATA=${DATA:-$OUT/data}
[ -e "$MODEL" ] || [ "$MODEL" != "$OUT/model" ] || "$PY" "$ROOT/bench/tiny.py" --out "$MODEL"
[ -e "$DATA/train.parquet" ] || "$PY" "$ROOT/examples/quickstart/data.py" --out "$DATA"
# vLLM's notes on a CPU (its config, no Triton, no tcmalloc) are about speed: VLLM_LOGGING_LEVEL=INFO
# shows them. Its C++ line "NUMA binding: Using MEMBIND policy" says where it keeps the KV cache: on
# the one NUMA node of a small machine, nothing to do
export VLLM_LOGGING_LEVEL=${VLLM_LOGGING_LEVEL:-ERROR}
# exec: a SIGTERM to this script (or its group) reaches the trainer, which checkpoints and stops
exec "$PY" "$ROOT/train_grpo.py" --model "$MODEL" --train_files "$DATA/train.parquet" \
    --val_files "$DATA/test.parquet" --custom_reward_function_path "$ROOT/examples/quickstart/reward.py" \
    --train_batch_size 8 --ppo_mini_batch_size 4 --rollout_n 4 --max_prompt_length 128 \
    --max_response_length 16 --total_training_steps 4 --test_freq 2 --default_local_dir "$OUT/run" "$@"
