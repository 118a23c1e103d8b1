"""GPU-only checks; skipped without CUDA. Run on a GPU machine with `make test-gpu`.

The model is $GPU_TEST_MODEL (default /tmp/models/qwen2.5-coder-0.5b-instruct); without it, a
random model shaped like Qwen2.5-0.5B is built.
"""

import json
import os
import subprocess
import sys
import time

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def model_path():
    path = os.environ.get("GPU_TEST_MODEL", "/tmp/models/qwen2.5-coder-0.5b-instruct")
    if os.path.exists(os.path.join(path, "config.json")):
        return path
    sys.path.insert(0, os.path.join(ROOT, "bench"))
    from bench_engine import random_qwen25_05b

    return random_qwen25_05b("/tmp/models/random-qwen2.5-0.5b")


def assert_device_independent(res):
    """What gpu_checks.py finds on a GPU and on CPU alike (tests/test_gpu_scripts.py runs it on
    CPU)."""
    assert res["varlen_attention_max_diff"] < 5e-2  # bf16 inputs against an fp32 reference
    assert res["varlen_attention_grad_rel_diff"] < 2e-2
    assert res["perturbed_changes_output"]
    assert res["restore_restores_output"]
    assert res["sync_from_sleep_same_output"]
    assert res["logprob_gap_bf16"] < 0.05
    # the fused output layer computes the same bf16 logits chunk by chunk (a wrong row, target or
    # temperature is off by nats), and gradients within bf16 rounding
    assert res["fused_log_prob_mean_diff"] < 1e-2 and res["fused_entropy_mean_diff"] < 1e-2
    assert res["fused_log_prob_grad_rel_diff"] < 2e-2 and res["fused_entropy_grad_rel_diff"] < 2e-2
    # the log-probs' compiled kernels (Triton on a GPU) against the eager math, both in fp32 from
    # the same bf16 logits; the gradients both rounded to bf16
    assert (
        res["compiled_log_probs_max_diff"] < 1e-3 and res["compiled_log_probs_grad_rel_diff"] < 1e-2
    )
    assert res["compiled_entropy_max_diff"] < 1e-3
    assert res["checkpoint_roundtrip_max_diff"] == 0.0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_engine_on_gpu(tmp_path):
    out = tmp_path / "res.json"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc_per_node=1",
            os.path.join(ROOT, "tests/gpu/gpu_checks.py"),
            model_path(),
            str(out),
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=900,
    )
    assert out.exists(), proc.stdout[-3000:] + proc.stderr[-5000:]
    res = json.loads(out.read_text())
    print(json.dumps(res, indent=1))
    assert_device_independent(res)
    assert res["varlen_flash_kernel_ran"]
    # the same bf16 computation, on shards kept on the CPU
    assert res["offloaded_log_prob_max_diff"] < 1e-3
    assert res["freed_by_sleep_gib"] > 1.0
    # the pool the sleeping engine released is what torch keeps counting: without it, the allocated
    # bytes fit in what the driver reports in use
    assert res["unbacked_gib_awake"] == 0 and res["unbacked_gib_asleep"] > 1.0
    # sleeping released the pool
    assert res["unbacked_gib_asleep"] <= res["freed_by_sleep_gib"] + 0.5
    assert 0 <= res["allocated_less_unbacked_gib"] <= res["used_asleep_gib"]
    # --gpu_memory_gib's cap follows the engine's sleep, and holds asleep too
    assert not res["fenced_3gib_fit_awake"] and res["fenced_3gib_fit_asleep"]
    assert not res["fenced_beyond_release_fits_asleep"]
    # no torch.compile
    assert res["engine_compilation"] == {
        "mode": 0,
        "cudagraph_mode": "FULL_DECODE_ONLY",
    }
    # the export, loaded by vLLM in a fresh process (configured as the engine, so that bf16 rounding
    # in different kernels cannot tell the two apart), generates what the engine generated
    script = (
        "import json,sys; from vllm import LLM, SamplingParams; from rollout import "
        "graphs_without_compile; llm=LLM(model=sys.argv[1], gpu_memory_utilization=0.3, "
        "max_model_len=1024, compilation_config=graphs_without_compile(1024)); "
        "o=llm.generate([{'prompt_token_ids': p} for p in json.loads(sys.argv[2])], "
        "SamplingParams(temperature=0, max_tokens=24)); "
        "print('TOKENS', json.dumps([list(x.outputs[0].token_ids) for x in o]))"
    )
    proc = subprocess.run(
        [sys.executable, "-c", script, res["export_dir"], json.dumps(res["prompts"])],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=ROOT,
    )
    line = [x for x in proc.stdout.splitlines() if x.startswith("TOKENS ")]
    assert line, proc.stderr[-5000:]
    assert json.loads(line[0][len("TOKENS ") :]) == res["greedy_tokens"]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_busy_reads_nvml():
    """bench_engine's measure of how busy the GPU was: near 100% while matmuls queue back to back,
    low while the host sleeps between short kernels."""
    sys.path.insert(0, os.path.join(ROOT, "bench"))
    import bench_engine

    read = bench_engine.nvml_gpu_busy()
    assert read is not None and 0 <= read() <= 100
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)

    def matmuls(seconds, pause):
        end = time.perf_counter() + seconds
        while time.perf_counter() < end:
            a @ a
            torch.cuda.synchronize()
            time.sleep(pause)

    _, busy = bench_engine.busy_while(lambda: matmuls(3.0, 0.0), read)
    # ~1 ms of work, then 50 ms asleep
    _, idle = bench_engine.busy_while(lambda: matmuls(3.0, 0.05), read)
    print(f"GPU busy: {busy:.0f}% back to back, {idle:.0f}% with pauses")
    assert busy > 80 and idle < 40


def pool_cycles(model_dir, device, model_dtype, cycles=3, **engine_kwargs):
    """An EnginePool of 2 engines through `cycles` trainer steps: push (the first perturbed from the
    model's weights, the others each perturbed from the last), greedy generation, sleep. Each step's
    answers are scored by the model as pushed and by the weights of the step before: the log-prob
    gaps to both, and the GPU memory in use after each sleep (the driver's count; NaN on CPU)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import engine_pool

    tok = AutoTokenizer.from_pretrained(model_dir)
    prompts = [
        tok.encode(p)
        for p in [
            "Natalia sold clips to 48 of her friends in April.",
            "What is 12 * 7?",
            "Write one sentence about the sea.",
            "List three prime numbers:",
        ]
    ]
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=model_dtype).to(device).eval()

    def score(samples):  # the model's log-prob of each sampled token, beside the engine's
        gaps = []
        for ids, s in samples:
            x = torch.tensor([ids + s.token_ids], device=device)
            logp = torch.log_softmax(model(x).logits[0, len(ids) - 1 : -1].float(), -1)
            mine = logp.gather(-1, torch.tensor(s.token_ids, device=device)[:, None])[:, 0]
            gaps.append((mine - torch.tensor(s.logprobs, device=device)).abs().mean().item())
        return sum(gaps) / len(gaps)

    pool = engine_pool.EnginePool(
        model_dir, engines=2, load_format="dummy", seed=0, **engine_kwargs
    )
    res = {"gap": [], "gap_to_previous": [], "used_asleep_gib": []}
    try:
        torch.manual_seed(0)
        with torch.no_grad():
            for _ in range(cycles):
                previous = {n: p.clone() for n, p in model.named_parameters()}
                for p in model.parameters():
                    p.add_(0.05 * p.std() * torch.randn_like(p))
                pool.update_weights(model.named_parameters())
                out = pool.generate(prompts, n=1, temperature=0, max_tokens=24)
                samples = [(ids, group[0]) for ids, group in zip(prompts, out)]
                res["gap"].append(score(samples))
                pushed = {n: p.clone() for n, p in model.named_parameters()}
                model.load_state_dict(previous, strict=False)
                res["gap_to_previous"].append(score(samples))  # as if the push had not arrived
                model.load_state_dict(pushed, strict=False)
                del previous, pushed  # nothing of this process's own is left in the count below
                pool.sleep()
                if device.type == "cuda":
                    torch.cuda.synchronize()
                    free, total = torch.cuda.mem_get_info()
                    res["used_asleep_gib"].append((total - free) / 2**30)
                else:
                    res["used_asleep_gib"].append(float("nan"))
    finally:
        pool.close()
    return res


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_engine_pool_on_gpu():
    """`--engines_per_gpu 2` on a GPU: each push reaches both engines (by CUDA IPC, into a buffer
    mapped anew after every sleep), and the memory held between steps does not grow."""
    res = pool_cycles(
        model_path(),
        torch.device("cuda"),
        torch.bfloat16,
        gpu_memory_utilization=0.3,
        max_model_len=1024,
    )
    print(json.dumps(res, indent=1))
    assert all(g < 0.05 for g in res["gap"])  # bf16 kernels apart: about 1e-2
    assert all(g > 0.1 for g in res["gap_to_previous"])  # the weights pushed are the ones served
    first, *later = res["used_asleep_gib"]
    # a leak: +1.2 GiB a step
    assert all(abs(u - later[0]) < 0.25 for u in later) and later[0] <= first + 0.25
