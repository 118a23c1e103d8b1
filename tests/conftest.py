"""Tests run from the repo root; make its modules importable however pytest is started."""

import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

# One OpenMP thread a process, in the workers and in all they launch (torchrun's ranks, engines,
# helpers): the workers already keep the cores busy, and more threads a process only spin against
# each other (`make test` on 2 cores, the same tests: 8:54 with torch's default, 7:58 with one).
os.environ.setdefault("OMP_NUM_THREADS", "1")

# `make test` runs the test files on two workers (pytest-xdist, --dist loadfile
# --no-loadscope-reorder), handing out whole files in the order collected. The files that launch the
# train scripts (or torchrun) take minutes each: they go first, longest first, and the quick files
# fill in at the end, so the two workers finish close together.
SLOW_FIRST = [
    "test_train_grpo.py",
    "test_train_ppo.py",
    "test_engine_pool.py",
    "test_train_grpo_filter.py",
    "test_bench.py",
    "test_sharding.py",
    "test_examples.py",
    "test_train_grpo_off_policy.py",
    "test_compile_ahead.py",
    "test_ending.py",
    "test_engine.py",
    "test_update.py",
    "test_fork.py",
    "test_gpu_scripts.py",
    "test_demo.py",
    "test_memory.py",
    "test_loggers.py",
    "test_docs.py",
]


def pytest_collection_modifyitems(items):
    rank = {name: i for i, name in enumerate(SLOW_FIRST)}
    # stable: a file's tests keep their order
    items.sort(key=lambda item: rank.get(item.path.name, len(SLOW_FIRST)))
