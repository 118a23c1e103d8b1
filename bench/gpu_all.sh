#!/usr/bin/env bash
# The GPU checks and benchmarks, each with a time limit, logs and results under $OUT (default bench_out):
#   bash bench/gpu_all.sh test      # make test-gpu: the engine's checks with NCCL, bf16, level-2 sleep
#   bash bench/gpu_all.sh engine    # bench_engine: plain vLLM vs ours, sync, sleep/wake, memory, parity
#   bash bench/gpu_all.sh grpo      # 3 GRPO steps of the tutorial shape + the per-phase table
#   bash bench/gpu_all.sh ppo       # 3 PPO steps of the quickstart shape + the per-phase table
# MODEL (a Hugging Face folder), DATA (GSM8K parquet folder), PY (python), LIMIT (seconds per part).
set -u
OUT=${OUT:-bench_out}
MODEL=${MODEL:-/tmp/models/qwen2.5-coder-0.5b-instruct}
DATA=${DATA:-/tmp/data/gsm8k}
PY=${PY:-python3}
LIMIT=${LIMIT:-540}
mkdir -p "$OUT"
data="--train_files $DATA/train.parquet --val_files $DATA/test.parquet"
steps="--total_training_steps 3 --val_before_train false --test_freq -1 --export_final false --resume_mode disable"
for part in "$@"; do
  case $part in
    test)   cmd="GPU_TEST_MODEL=$MODEL $PY -m pytest tests/gpu -q -s" ;;
    engine) cmd="$PY bench/bench_engine.py --plain --model $MODEL --out $OUT && \
                 $PY -m torch.distributed.run --nproc_per_node=1 bench/bench_engine.py --model $MODEL --out $OUT" ;;
    grpo)   cmd="$PY -m torch.distributed.run --nproc_per_node=1 train_grpo.py --model $MODEL $data $steps \
                 --ppo_micro_batch_size_per_gpu 16 --log_prob_micro_batch_size_per_gpu 32 \
                 --default_local_dir $OUT/grpo && $PY bench/phase_table.py $OUT/grpo/metrics.jsonl" ;;
    ppo)    cmd="$PY -m torch.distributed.run --nproc_per_node=1 train_ppo.py --model $MODEL $data $steps \
                 --ppo_micro_batch_size_per_gpu 16 --critic_ppo_micro_batch_size_per_gpu 16 \
                 --log_prob_micro_batch_size_per_gpu 32 --default_local_dir $OUT/ppo \
                 && $PY bench/phase_table.py $OUT/ppo/metrics.jsonl" ;;
    *) echo "unknown part $part (test, engine, grpo, ppo)"; exit 2 ;;
  esac
  echo "== $part: $cmd"
  timeout "$LIMIT" bash -c "$cmd" > "$OUT/$part.log" 2>&1
  echo "== $part: exit $?"
  grep -v -E "it/s\]|it/s$|^INFO|^\(|^WARNING" "$OUT/$part.log" | tail -25
done
