#!/usr/bin/env bash
# The GPU checks and benchmarks, each with a time limit, logs and results under $OUT (default bench_out):
#   bash bench/gpu_all.sh test      # make test-gpu: the engine's checks with NCCL, bf16, level-2 sleep
#   bash bench/gpu_all.sh engine    # bench_engine: plain vLLM vs ours (and how busy the GPU was), sync, sleep/wake,
#                                   # memory, parity, the host's time while generating by part of vLLM (--profile)
#   bash bench/gpu_all.sh sync      # bench_engine without the plain vLLM run (ours, sync, sleep/wake, parity)
#   bash bench/gpu_all.sh grpo      # 3 GRPO steps of the tutorial shape + the per-phase table
#   bash bench/gpu_all.sh card card_ppo  # the README's command, data paths only (the defaults), 5 steps, +
#                                   # the per-phase table and the memory plan against the measured peaks
#   COLD=1 bash bench/gpu_all.sh card card_nowarm  # GRPO's with its default --warm_compile_caches, then with it
#                                   # off, each from empty compile caches: the time to the first step (card_warm,
#                                   # card_ppo_warm: with --warm_compile_caches true)
#   COLD=1 bash bench/gpu_all.sh card_compile  # the README's GRPO command, 3 steps, through
#                                   # bench/compile_times.py: where torch.compile's time went (TORCH_LOGS=recompiles
#                                   # adds why it compiled again; COMPILE_WORKERS_AT_LAUNCH=1 starts inductor's workers first)
#   bash bench/gpu_all.sh gib_24 gib_40 gib_80 gib_none gib_ppo_24  # the README's GRPO (PPO) command as on a
#                                   # GPU of 24, 40, 80 GiB (--gpu_memory_gib) and on the GPU itself, 3 steps, the
#                                   # last validated, checkpointed and exported: the plan against the peaks, and
#                                   # every process's memory by NVML (bench/nvml_peak.py); qwen3_gib_80,
#                                   # qwen3_gib_40, qwen3_gib_none: one step of the random Qwen3-1.7B with
#                                   # what the planner chose (160 prompts: the tutorial's micro-batches and
#                                   # plan); then
#                                   # `python bench/gib_table.py $OUT`: one row per size
#   bash bench/gpu_all.sh card trl  # TRL 1.16.0's GRPOTrainer at the same shape, model and data
#                                   # (bench/trl_grpo.py, TRL_STEPS=5 steps; TRL's wheels in .whl/trl,
#                                   # docs/gpu.md), then its steps beside the card part's (bench/ab_table.py:
#                                   # A = TRL)
#   bash bench/gpu_all.sh card verl  # verl's GRPO tutorial command at the same model and data (verl 0.9.1;
#                                   # bench/verl_grpo.py, VERL_STEPS=3 steps, its raw log kept), then beside
#                                   # the card run
#   bash bench/gpu_all.sh plan_grpo plan_ppo  # the same, 3 steps, on a random-init model of Qwen2.5-0.5B's shape
#                                   # (responses at the length limit, as the planner plans them)
#   bash bench/gpu_all.sh grpo_compiled  # 5 GRPO steps, update compiled, 49k/64k-token micro-batches
#   bash bench/gpu_all.sh grpo_off_policy  # the same with --one_step_off_policy (the next batch generated while
#                                   # a step trains; the engine awake throughout, at 0.3 of the GPU's memory)
#   bash bench/gpu_all.sh engine_pool  # bench_engine with 1, 4 and 2 engines per GPU (POOL_KS), each against the
#                                   # same plain vLLM run: tokens/s, how busy the GPU was, sync (engine_pool.EnginePool)
#   bash bench/gpu_all.sh grpo_pool # grpo_compiled with --engines_per_gpu POOL_K (default 4)
#   bash bench/gpu_all.sh scale_1 scale_1_warm gen_seqs  # 3 GRPO steps on a fresh machine, again with its
#                                   # caches warm, and with all 1,280 sequences of a step decoding at once
#   bash bench/gpu_all.sh scale_1_vllm_compile  # the same 3 steps with vLLM's torch.compile (--rollout_compile)
#   bash bench/gpu_all.sh ppo       # 3 PPO steps of the quickstart shape + the per-phase table
#   bash bench/gpu_all.sh learn     # GRPO on GSM8K, resumable across calls (LEARN_DIR), + the per-phase table
#                                   # and the results table (bench/learn_table.py)
#   bash bench/gpu_all.sh learn_filter  # the same, with --filter_groups (DAPO's dynamic sampling) from step
#                                   # FILTER_FROM (default 8) on
#   bash bench/gpu_all.sh val       # --val_only of the base model: strict/flexible greedy mean@1, pass@5
#                                   # (VAL_ARGS="--val_n 16": pass@16, the room GRPO has to sharpen into)
#   bash bench/gpu_all.sh profile   # log-prob and update passes, eager, compiled and fused: TFLOP/s, host vs device, kernels,
#                                   # where compiling took its time and why it recompiled
#   bash bench/gpu_all.sh qwen3     # 1 GRPO step of the Qwen3-1.7B tutorial shape on a random-init Qwen3-1.7B
#   bash bench/gpu_all.sh plan_qwen3  # the same with the memory planner's budgets, + the plan against the peaks
#   bash bench/gpu_all.sh fused     # --use_fused_kernels: the output layer alone, bf16, at Qwen2.5-0.5B's and
#                                   # Qwen3-1.7B's width, with and without gradients (the response tokens of
#                                   # 37,888- and 65,536-token log-prob micro-batches; bench/fused_head.py);
#                                   # the update's peak memory and speed
#                                   # on the random Qwen3-1.7B with gradient checkpointing, with and without it
#   NPROC=2 bash bench/gpu_all.sh scale  # 3 GRPO steps on 1 and NPROC GPUs (TP 1, TP 2), 3 PPO steps on NPROC,
#                                        # and the scaling table (bench/scaling_table.py); the same in parts
#                                        # that fit one call each: scale_1 scale_tp1 scale_tp2 scale_ppo
#                                        # scale_table
#                                        # (runs under RUNS, their metrics copied to OUT)
# MODEL (a Hugging Face folder), DATA (GSM8K parquet folder), PY (python), LIMIT (seconds per part),
# RUNS (a folder that outlives one call, for checkpoints), LEARN_DIR (the learning run's folder, default
# RUNS/learn), LEARN_ARGS (extra flags of the learning run; a flag given twice takes the last value),
# FILTER_FROM (the step from which learn_filter filters), FILTER_ARGS (flags of its filtering part only, such as
# --gen_batch_size 768),
# VAL_ARGS (extra flags of the val part), QWEN3_ARGS (of the qwen3 part, e.g. --use_fused_kernels), COLD=1 (each
# part starts with empty compile caches, Triton's, inductor's and vLLM's, as on a freshly started machine: cold
# starts to compare in one hold; the OS's file cache stays warm).
set -u
OUT=${OUT:-bench_out}
MODEL=${MODEL:-/tmp/models/qwen2.5-coder-0.5b-instruct}
DATA=${DATA:-/tmp/data/gsm8k}
PY=${PY:-python3}
LIMIT=${LIMIT:-540}
RUNS=${RUNS:-/tmp/runs}
LEARN_DIR=${LEARN_DIR:-$RUNS/learn}
LEARN_ARGS=${LEARN_ARGS:-}
FILTER_FROM=${FILTER_FROM:-8}
FILTER_ARGS=${FILTER_ARGS:-}
VAL_ARGS=${VAL_ARGS:-}
QWEN3_ARGS=${QWEN3_ARGS:-}
NPROC=${NPROC:-2}
POOL_KS=${POOL_KS:-1 4 2}
POOL_K=${POOL_K:-4}
mkdir -p "$OUT"
# micro-batches by token budget: few, large forwards (the sequences are packed, attention is varlen)
fast="--use_dynamic_bsz --ppo_max_token_len_per_gpu 12288 --log_prob_max_token_len_per_gpu 32768"
plain=""
[ -f "$OUT/bench_engine.json" ] && plain="--plain_tok_s $OUT/bench_engine.json"
data="--train_files $DATA/train.parquet --val_files $DATA/test.parquet"
# the random-init Qwen3-1.7B of the qwen3 and fused parts, written once per machine (bench/random_model.py)
qwen3=/tmp/models/random-qwen3-1.7b
make_qwen3="$PY bench/random_model.py --shape qwen3-1.7b --tokenizer $MODEL --out $qwen3"
random05=/tmp/models/random-qwen2.5-0.5b
make_random05="$PY bench/random_model.py --shape qwen2.5-0.5b --tokenizer $MODEL --out $random05"
# the learning run: the tutorial's GRPO settings with response length 512, lr 5e-6 and the update compiled at
# the micro-batches where that pays (docs/benchmarks.md); stopped by LIMIT, resumed by the next call. Each
# validation's responses go to LEARN_DIR/val_generations/STEP.jsonl
learn="$PY -m torch.distributed.run --nproc_per_node=1 train_grpo.py --model $MODEL $data \
       --use_dynamic_bsz --ppo_max_token_len_per_gpu 49152 --log_prob_max_token_len_per_gpu 65536 \
       --compile_update true --max_response_length 512 --actor_lr 5e-6 --total_training_steps 32 \
       --test_freq 4 --val_before_train true --save_freq 4 --export_final false --resume_mode auto \
       --default_local_dir $LEARN_DIR \
       --validation_data_dir $LEARN_DIR/val_generations"
steps="--total_training_steps 3 --val_before_train false --test_freq -1 --export_final false --resume_mode disable"
# one run of the tutorial's shape, afresh in RUNS/NAME, metrics copied to OUT: GPUS TP SCRIPT NAME [FLAGS]
scale_run() {
  echo "rm -rf $RUNS/$4 && $PY -m torch.distributed.run --nproc_per_node=$1 $3 --model $MODEL $data $steps $fast \
        --tensor_model_parallel_size $2 --default_local_dir $RUNS/$4 ${*:5}; s=\$?; \
        cp $RUNS/$4/metrics.jsonl $OUT/$4.jsonl; $PY bench/phase_table.py $RUNS/$4/metrics.jsonl; test \$s = 0"
}
# a part named ..._G runs as on a GPU of G GiB; ..._none, at the GPU's own size
gib_cap() { [ "${1##*_}" = none ] || echo "--gpu_memory_gib ${1##*_}"; }
parts=()
for part in "$@"; do
  if [ "$part" = scale ]; then parts+=(scale_1 scale_tp1 scale_tp2 scale_ppo scale_table); else parts+=("$part"); fi
done
for part in "${parts[@]}"; do
  case $part in
    test)   cmd="GPU_TEST_MODEL=$MODEL $PY -m pytest tests/gpu -q -s" ;;
    engine) cmd="$PY bench/bench_engine.py --plain --model $MODEL --out $OUT && \
                 $PY -m torch.distributed.run --nproc_per_node=1 bench/bench_engine.py --model $MODEL --out $OUT \
                 --profile 20" ;;
    engine_pool) cmd="$PY bench/bench_engine.py --plain --model $MODEL --out $OUT"
            for k in $POOL_KS; do
              cmd="$cmd && mkdir -p $OUT/pool_$k && cp $OUT/plain_vllm.json $OUT/pool_$k/ && \
                   $PY -m torch.distributed.run --nproc_per_node=1 bench/bench_engine.py --model $MODEL \
                   --out $OUT/pool_$k --engines_per_gpu $k"
            done ;;
    sync)   cmd="$PY -m torch.distributed.run --nproc_per_node=1 bench/bench_engine.py --model $MODEL --out $OUT" ;;
    card|card_ppo|card_warm|card_ppo_warm|card_nowarm) script=train_grpo.py; [[ $part = card_ppo* ]] && script=train_ppo.py
            warm=""; [[ $part = *_warm ]] && warm="--warm_compile_caches true"
            [ $part = card_nowarm ] && warm="--warm_compile_caches false"
            cmd="$PY -m torch.distributed.run --nproc_per_node=1 $script --model $MODEL $data $warm \
                 --total_training_steps 5 --default_local_dir $RUNS/$part && cp $RUNS/$part/metrics.jsonl \
                 $OUT/$part.jsonl && $PY bench/phase_table.py $OUT/$part.jsonl $plain && \
                 $PY bench/plan_table.py $OUT/$part.jsonl" ;;
    # the README's command, data paths only, as on a GPU of G GiB (--gpu_memory_gib G; none: the GPU's
    # own size): 3 steps, validated and checkpointed at the last, then exported; the GPU memory all its
    # processes held, by NVML, beside the plan's phases against their measured peaks. GIB_FLAGS, GIB_ENV:
    # more flags, and VAR=value settings, for a variant (e.g. GIB_FLAGS="--use_fused_kernels true",
    # GIB_ENV=PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True where a phase ran out in pieces)
    gib_*|gib_ppo_*) script=train_grpo.py; [[ $part = gib_ppo_* ]] && script=train_ppo.py
            cap=$(gib_cap $part)
            cmd="rm -rf $RUNS/$part; $PY bench/nvml_peak.py --out $OUT/$part.nvml.json & s=\$!; \
                 env ${GIB_ENV:-} $PY -m torch.distributed.run --nproc_per_node=1 $script --model $MODEL $data $cap \
                 --total_training_steps 3 --test_freq 3 --save_freq 3 --default_local_dir $RUNS/$part ${GIB_FLAGS:-}; r=\$?; \
                 kill -INT \$s; wait \$s; cp $RUNS/$part/metrics.jsonl $OUT/$part.jsonl && \
                 $PY bench/phase_table.py $OUT/$part.jsonl $plain && \
                 $PY bench/plan_table.py $OUT/$part.jsonl $OUT/$part.nvml.json $OUT/$part.log; test \$r = 0" ;;
    # the Qwen3-1.7B tutorial's shape on random weights as on a GPU of G GiB, with what the planner
    # turns on there: one step, and the plan against the peaks. 160 prompts a step, two of the
    # tutorial's mini-batches of 80, not its 1,024: a phase's peak is set by its micro-batches, which
    # either batch fills to the budget (random weights answer at the length limit), so the plan is
    # the same (--print_plan) and the step a sixth as long
    qwen3_gib_*) cap=$(gib_cap $part)
            cmd="$make_qwen3 && rm -rf $RUNS/$part; $PY bench/nvml_peak.py --out $OUT/$part.nvml.json & \
                 s=\$!; $PY -m torch.distributed.run --nproc_per_node=1 train_grpo.py --model $qwen3 $data \
                 $cap --total_training_steps 1 --val_before_train false --test_freq -1 \
                 --export_final false --train_batch_size 160 --rollout_n 3 --ppo_mini_batch_size 80 \
                 --max_response_length 1024 --default_local_dir $RUNS/$part; r=\$?; kill -INT \$s; wait \$s; \
                 cp $RUNS/$part/metrics.jsonl $OUT/$part.jsonl && $PY bench/phase_table.py $OUT/$part.jsonl \
                 $plain && $PY bench/plan_table.py $OUT/$part.jsonl $OUT/$part.nvml.json; test \$r = 0" ;;
    trl)    cmd="rm -rf $RUNS/trl; PYTHONPATH=/tmp/trlsite:\${PYTHONPATH:-} $PY bench/trl_grpo.py --model $MODEL \
                 --train_files $DATA/train.parquet --out $RUNS/trl --steps ${TRL_STEPS:-5} && cp $RUNS/trl/trl_steps.jsonl \
                 $OUT/trl.jsonl && if [ -f $OUT/card.jsonl ]; then $PY bench/ab_table.py $OUT/trl.jsonl \
                 $OUT/card.jsonl; fi" ;;
    # vLLM as verl runs it (its own processes): not this project's in-process setting
    verl)   cmd="rm -rf $RUNS/verl; env -u VLLM_ENABLE_V1_MULTIPROCESSING PYTHONPATH=/tmp/verlsite:\${PYTHONPATH:-} \
                 $PY bench/verl_grpo.py --model $MODEL \
                 --data $DATA --out $RUNS/verl --steps ${VERL_STEPS:-3}; r=\$?; cp $RUNS/verl/verl.log $OUT/verl.log; \
                 cp $RUNS/verl/verl_steps.jsonl $OUT/verl.jsonl && if [ -f $OUT/card.jsonl ]; then \
                 $PY bench/ab_table.py $OUT/verl.jsonl $OUT/card.jsonl; fi; test \$r = 0" ;;
    card_compile) cmd="$PY -m torch.distributed.run --nproc_per_node=1 bench/compile_times.py train_grpo.py \
                 --model $MODEL $data --total_training_steps 3 --default_local_dir $RUNS/$part && cp \
                 $RUNS/$part/metrics.jsonl $OUT/$part.jsonl && $PY bench/phase_table.py $OUT/$part.jsonl $plain" ;;
    plan_grpo|plan_ppo) script=train_grpo.py; [ $part = plan_ppo ] && script=train_ppo.py
            cmd="$make_random05 && $PY -m torch.distributed.run --nproc_per_node=1 $script --model $random05 \
                 $data $steps --default_local_dir $RUNS/$part && cp $RUNS/$part/metrics.jsonl $OUT/$part.jsonl && \
                 $PY bench/phase_table.py $OUT/$part.jsonl $plain && $PY bench/plan_table.py $OUT/$part.jsonl" ;;
    grpo)   cmd="$PY -m torch.distributed.run --nproc_per_node=1 train_grpo.py --model $MODEL $data $steps $fast \
                 --default_local_dir $OUT/grpo && $PY bench/phase_table.py $OUT/grpo/metrics.jsonl $plain" ;;
    ppo)    cmd="$PY -m torch.distributed.run --nproc_per_node=1 train_ppo.py --model $MODEL $data $steps $fast \
                 --critic_ppo_max_token_len_per_gpu 32768 --default_local_dir $OUT/ppo \
                 && $PY bench/phase_table.py $OUT/ppo/metrics.jsonl $plain" ;;
    learn)  cmd="$learn $LEARN_ARGS" ;;
    # the same, with DAPO's dynamic sampling (--filter_groups) from step FILTER_FROM on, resumed from that
    # step's checkpoint: the base model's strict reward has almost no groups with signal to keep before.
    # A first part that LIMIT stopped earlier (it exits 0, checkpointed) is resumed by the next call instead
    learn_filter) cmd="$learn $LEARN_ARGS --total_training_steps $FILTER_FROM --save_freq $FILTER_FROM && \
                       { [ \$(cat $LEARN_DIR/latest_checkpointed_iteration.txt) -lt $FILTER_FROM ] || \
                       $learn $LEARN_ARGS --filter_groups $FILTER_ARGS; }" ;;
    val)    cmd="$PY -m torch.distributed.run --nproc_per_node=1 train_grpo.py --model $MODEL $data --val_only \
                 --val_n 5 --val_temperature 1.0 --max_response_length 512 --default_local_dir $OUT/val \
                 --resume_mode disable $VAL_ARGS" ;;
    # the Qwen3 tutorial: 1024 prompts x 3, mini-batch 80, responses up to 1024 (random weights rarely stop)
    qwen3)  cmd="$make_qwen3 && $PY -m torch.distributed.run --nproc_per_node=1 train_grpo.py --model $qwen3 \
                 $data $fast --total_training_steps 1 --val_before_train false --test_freq -1 --export_final false \
                 --resume_mode disable --train_batch_size 1024 --rollout_n 3 --ppo_mini_batch_size 80 \
                 --max_response_length 1024 --enable_gradient_checkpointing --ref_param_offload \
                 --default_local_dir $OUT/qwen3 $QWEN3_ARGS && $PY bench/phase_table.py $OUT/qwen3/metrics.jsonl $plain" ;;
    # the same with the memory planner's defaults (no $fast), + the plan against the measured peaks
    plan_qwen3) cmd="$make_qwen3 && $PY -m torch.distributed.run --nproc_per_node=1 train_grpo.py --model $qwen3 \
                 $data --total_training_steps 1 --val_before_train false --test_freq -1 --export_final false \
                 --resume_mode disable --train_batch_size 1024 --rollout_n 3 --ppo_mini_batch_size 80 \
                 --max_response_length 1024 --enable_gradient_checkpointing --ref_param_offload \
                 --default_local_dir $RUNS/plan_qwen3 && cp $RUNS/plan_qwen3/metrics.jsonl $OUT/plan_qwen3.jsonl && \
                 $PY bench/phase_table.py $OUT/plan_qwen3.jsonl $plain && $PY bench/plan_table.py $OUT/plan_qwen3.jsonl" ;;
    fused)  cmd="$PY bench/fused_head.py --dtype bfloat16 --tokens 12288 49152 && \
                 $PY bench/fused_head.py --dtype bfloat16 --no_grad --tokens 26624 59392 && \
                 $PY bench/fused_head.py --dtype bfloat16 --hidden 2048 --tokens 12288 49152 && \
                 $make_qwen3 && $PY -m torch.distributed.run --nproc_per_node=1 bench/profile_step.py \
                 --model $qwen3 --gradient_checkpointing --modes all fused --sequences 320 \
                 --log_prob_tokens 32768 --update_tokens 12288 24576 49152 --repeats 1" ;;
    # the tutorial's shape at 1 and NPROC GPUs (per-GPU batch shrinks: strong scaling of one step),
    # rollout TP 1 and 2; then PPO on NPROC GPUs. Each run starts afresh in RUNS/scale_*; its
    # metrics.jsonl is copied to OUT/scale_*.jsonl
    # 5 GRPO steps with the update compiled at the micro-batches where that pays (docs/benchmarks.md)
    grpo_compiled) cmd="$(scale_run 1 1 train_grpo.py grpo_compiled --total_training_steps 5 --compile_update true \
                          --ppo_max_token_len_per_gpu 49152 --log_prob_max_token_len_per_gpu 65536)" ;;
    grpo_pool) cmd="$(scale_run 1 1 train_grpo.py "grpo_pool_$POOL_K" --total_training_steps 5 \
                      --compile_update true --ppo_max_token_len_per_gpu 49152 \
                      --log_prob_max_token_len_per_gpu 65536 --engines_per_gpu $POOL_K)" ;;
    grpo_off_policy) cmd="$(scale_run 1 1 train_grpo.py grpo_off_policy --total_training_steps 5 \
                            --compile_update true --ppo_max_token_len_per_gpu 49152 \
                            --log_prob_max_token_len_per_gpu 65536 --one_step_off_policy --gpu_memory_utilization 0.3)" ;;
    scale_1) cmd="$(scale_run 1 1 train_grpo.py scale_1_tp1)" ;;
    scale_1_warm) cmd="$(scale_run 1 1 train_grpo.py scale_1_warm)" ;;  # after scale_1: time to step 1, caches warm
    # the same 3 steps with vLLM compiling (its default) instead of the engine's graphs without compile
    scale_1_vllm_compile) cmd="$(scale_run 1 1 train_grpo.py scale_1_vllm_compile --rollout_compile true)" ;;
    # the same seeds and prompts with no sequence waiting for a decoding slot (1,280 per step <= 2,048)
    gen_seqs) cmd="$(scale_run 1 1 train_grpo.py gen_seqs --max_num_seqs 2048)" ;;
    scale_tp1) cmd="$(scale_run "$NPROC" 1 train_grpo.py "scale_${NPROC}_tp1")" ;;
    scale_tp2) cmd="$(scale_run "$NPROC" 2 train_grpo.py "scale_${NPROC}_tp2")" ;;
    scale_ppo) cmd="$(scale_run "$NPROC" 1 train_ppo.py "scale_ppo_$NPROC" --critic_ppo_max_token_len_per_gpu 32768)" ;;
    scale_table) runs=""  # GPUS:TP:metrics of the runs that exist
        for r in 1:1:scale_1_tp1 "$NPROC:1:scale_${NPROC}_tp1" "$NPROC:2:scale_${NPROC}_tp2"; do
          [ -f "$RUNS/${r##*:}/metrics.jsonl" ] && runs="$runs ${r%:*}:$RUNS/${r##*:}/metrics.jsonl"
        done
        cmd="$PY bench/scaling_table.py $runs" ;;
    profile) cmd="TORCH_LOGS=recompiles $PY -m torch.distributed.run --nproc_per_node=1 bench/profile_step.py --model $MODEL --out $OUT \
                  --modes eager all train fused --log_prob_tokens 32768 65536 --update_tokens 12288 24576 49152 \
                  --repeats 2" ;;
    *) echo "unknown part $part (test, engine, engine_pool, sync, card, card_ppo, card_warm, card_ppo_warm, card_nowarm, card_compile, trl, verl, gib_G, gib_ppo_G, qwen3_gib_G, plan_grpo, plan_ppo, plan_qwen3, grpo, grpo_compiled, grpo_pool, grpo_off_policy,"\
            "ppo, learn, learn_filter, val, profile, qwen3, scale, fused, scale_1, scale_1_warm,"\
            "scale_1_vllm_compile, gen_seqs, scale_tp1, scale_tp2, scale_ppo, scale_table)"; exit 2 ;;
  esac
  echo "== $part: $cmd"
  if [ "${COLD:-0}" = 1 ]; then
    cold=$(mktemp -d /tmp/cold.XXXX)
    export TRITON_CACHE_DIR=$cold/triton TORCHINDUCTOR_CACHE_DIR=$cold/inductor VLLM_CACHE_ROOT=$cold/vllm
  fi
  # SIGTERM to the workers at LIMIT: a training run checkpoints the step in progress and stops
  # (ending.StopRequest) within the 45 s before everything is killed (bench/limit.sh)
  bash bench/limit.sh "$LIMIT" 45 "$cmd" > "$OUT/$part.log" 2>&1
  echo "== $part: exit $?" | tee -a "$OUT/$part.log"
  if [ "${part%_filter}" = learn ] && [ -f "$LEARN_DIR/metrics.jsonl" ]; then
    cp "$LEARN_DIR/metrics.jsonl" "$OUT/learn_metrics.jsonl"
    $PY bench/phase_table.py "$OUT/learn_metrics.jsonl" $plain >> "$OUT/$part.log" 2>&1
    $PY bench/learn_table.py "$OUT/learn_metrics.jsonl" >> "$OUT/$part.log" 2>&1
  fi
  grep -v -E "it/s\]|it/s$|^INFO|^\(|^WARNING" "$OUT/$part.log" | tail -25
done
