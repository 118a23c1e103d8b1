"""The hybrid engine: rollout.py's layout helpers and transformers engine (in this process), and
sharding.py + the vLLM engine under torchrun with 2 gloo ranks on CPU (tests/dist/engine_checks.py),
then a world-size-1 resume and the exported folders (tests/dist/load_checks.py).

The two torchrun launches run once per session (~40 s together); their scripts record numbers into
JSON files and the tests below assert on them, one property per test.
"""

import gc
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import rollout
from bench.tiny import make_tiny_model, make_tiny_tokenizer
from rollout import HFEngine, group_share, logprob_gap, tp_layout
from tests.tiny_model import torchrun

ROOT = Path(__file__).resolve().parents[1]
HAS_VLLM = importlib.util.find_spec("vllm") is not None


# --------------------------------------------------------------------------- layout (pure)


def test_tp_layout_blocks_of_consecutive_ranks():
    # world 4, tp 2: ranks {0, 1} are group 0 and {2, 3} group 1, as vLLM's external launcher lays
    # them out
    assert [tp_layout(r, 4, 2) for r in range(4)] == [(0, 2, 0), (0, 2, 1), (1, 2, 0), (1, 2, 1)]
    groups = {g: [r for r in range(8) if tp_layout(r, 8, 4)[0] == g] for g in range(2)}
    assert groups == {0: [0, 1, 2, 3], 1: [4, 5, 6, 7]}
    # tp 1: every rank is its own data-parallel group; tp = world: one group
    assert [tp_layout(r, 4, 1) for r in range(4)] == [(r, 4, 0) for r in range(4)]
    assert [tp_layout(r, 4, 4) for r in range(4)] == [(0, 1, r) for r in range(4)]


@pytest.mark.parametrize("world, tp", [(4, 3), (4, 0), (2, -1), (6, 4)])
def test_tp_layout_rejects_sizes_that_do_not_divide(world, tp):
    with pytest.raises(ValueError, match="must divide"):
        tp_layout(0, world, tp)


def test_group_share_tp2():
    # 8 prompts, world 4, tp 2: each group generates 4, each rank trains on 2
    items = list(range(8))
    shares = [group_share(items, r, 4, 2) for r in range(4)]
    assert [mine for mine, _ in shares] == [[0, 1, 2, 3], [0, 1, 2, 3], [4, 5, 6, 7], [4, 5, 6, 7]]
    assert [sl for _, sl in shares] == [slice(0, 2), slice(2, 4), slice(0, 2), slice(2, 4)]
    # each rank's training share is its own block of the global list, so the ranks cover it once
    assert [x for mine, sl in shares for x in mine[sl]] == items


@pytest.mark.parametrize("world", [1, 2, 4])
def test_group_share_tp1_gives_each_rank_its_own_share(world):
    items = [f"p{i}" for i in range(4 * world)]
    for r in range(world):
        mine, sl = group_share(items, r, world, 1)
        assert mine == items[4 * r : 4 * (r + 1)]
        assert mine[sl] == mine


def test_group_share_rejects_uneven_splits():
    with pytest.raises(ValueError, match="do not split evenly"):
        group_share(list(range(6)), 0, 4, 1)
    with pytest.raises(ValueError, match="must divide"):
        group_share(list(range(6)), 0, 6, 4)


def test_logprob_gap_by_hand():
    log_probs = torch.tensor([[-1.0, -2.0, -3.0], [-0.5, -0.5, -0.5]])
    rollout_log_probs = torch.tensor([[-1.1, -2.0, -9.0], [-0.2, -0.5, -0.5]])
    response_mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    # |diffs| on the 3 response tokens: 0.1, 0.0, 0.3 (the masked 6.0 never counts) -> mean 0.4 / 3
    assert logprob_gap(log_probs, rollout_log_probs, response_mask) == pytest.approx(0.4 / 3)
    assert logprob_gap(log_probs, rollout_log_probs, torch.zeros(2, 3)) == 0.0


def test_graphs_without_compile_capture_sizes():
    # vLLM's grid (1, 2, 4, then every 8 tokens) below 256, every 32 to 1024, every 128 above, up to
    # max_num_seqs (one token per decoding sequence), at most 4,096
    sizes = lambda n: rollout.graphs_without_compile(n)["cudagraph_capture_sizes"]  # noqa: E731
    assert sizes(1) == [1]
    assert sizes(6) == [1, 2, 4, 6]
    assert sizes(300)[-3:] == [256, 288, 300]
    assert sizes(1024)[32:38] == [240, 248, 256, 288, 320, 352]
    assert sizes(1024)[-3:] == [960, 992, 1024] and len(sizes(1024)) == 3 + 31 + 24 + 1
    assert sizes(2048)[-3:] == [1792, 1920, 2048]
    assert sizes(10_000)[-1] == 4096 and sizes(10_000) == sizes(4096)
    assert all(a < b for a, b in zip(sizes(4096), sizes(4096)[1:]))


@pytest.mark.skipif(not HAS_VLLM, reason="needs vLLM")
def test_graphs_without_compile_is_a_valid_vllm_config():
    from vllm.config import CompilationConfig, CompilationMode, CUDAGraphMode

    config = CompilationConfig(**rollout.graphs_without_compile(16))
    assert (
        config.mode == CompilationMode.NONE
        and config.cudagraph_mode == CUDAGraphMode.FULL_DECODE_ONLY
    )
    assert config.cudagraph_capture_sizes == [1, 2, 4, 8, 16]


def test_make_engine_rejects_unknown_kind():
    with pytest.raises(ValueError, match="vllm or hf"):
        rollout.make_engine("sglang", "unused")


# --------------------------------------------------------------------------- HFEngine


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return make_tiny_model(str(tmp_path_factory.mktemp("engine") / "tiny"))


@pytest.fixture(scope="module")
def prompts():
    tok = make_tiny_tokenizer()
    # lengths 2, 19, 7: left padding
    return [tok.encode(p) for p in ["hi", "The quick brown fox", "1 + 2 ="]]


def test_hf_engine_fixed_seed_is_reproducible(tiny_dir, prompts):
    kw = {"n": 2, "temperature": 1.0, "max_tokens": 12}
    first = HFEngine(tiny_dir, seed=3).generate(prompts, **kw)
    assert HFEngine(tiny_dir, seed=3).generate(prompts, **kw) == first
    engine = HFEngine(tiny_dir, seed=3)
    engine.generate(prompts, **kw)
    assert engine.generate(prompts, **kw) != first  # the next call draws new samples
    assert HFEngine(tiny_dir, seed=4).generate(prompts, **kw) != first
    # an explicit seed overrides the engine's
    assert HFEngine(tiny_dir, seed=0).generate(prompts, **kw, seed=7) == HFEngine(
        tiny_dir, seed=9
    ).generate(prompts, **kw, seed=7)
    assert [len(group) for group in first] == [2, 2, 2]


def test_hf_engine_logprobs_are_log_softmax_of_logits_over_temperature(tiny_dir, prompts):
    engine = HFEngine(tiny_dir, seed=1)
    temperature = 0.7
    samples = engine.generate(prompts, n=2, temperature=temperature, max_tokens=12)
    for p, group in zip(prompts, samples):
        for s in group:
            # unpadded: the batched, left-padded run must agree
            ids = torch.tensor([p + s.token_ids])
            logits = engine.model(input_ids=ids).logits[0, len(p) - 1 : -1].float()  # (T, V)
            expected = torch.log_softmax(logits / temperature, -1).gather(
                -1, torch.tensor(s.token_ids)[:, None]
            )
            torch.testing.assert_close(
                torch.tensor(s.logprobs), expected.squeeze(-1), atol=1e-5, rtol=0
            )


def test_hf_engine_top_k_logprobs_are_renormalised(tiny_dir, prompts):
    engine = HFEngine(tiny_dir, seed=1)
    samples = engine.generate(prompts[:1], n=4, temperature=1.0, top_k=3, max_tokens=8)
    p = prompts[0]
    for s in samples[0]:
        logits = (
            engine.model(input_ids=torch.tensor([p + s.token_ids]))
            .logits[0, len(p) - 1 : -1]
            .float()
        )
        top = logits.topk(3, -1)
        # only top-3 tokens drawn
        assert all(t in row for t, row in zip(s.token_ids, top.indices.tolist()))
        expected = torch.log_softmax(top.values, -1)[
            top.indices == torch.tensor(s.token_ids)[:, None]
        ]
        torch.testing.assert_close(torch.tensor(s.logprobs), expected, atol=1e-5, rtol=0)


def test_hf_engine_finish_reasons(tiny_dir, prompts):
    engine = HFEngine(tiny_dir, seed=0)
    greedy = engine.generate(prompts, temperature=0, max_tokens=16)
    assert all(g[0].finish_reason == "length" and len(g[0].token_ids) == 16 for g in greedy)
    # make a greedy token of prompt 0 that prompt 2 never emits the EOS: prompt 0 stops there with
    # "stop", prompt 2 runs to "length", unchanged by its neighbour having finished
    eos = next(t for t in greedy[0][0].token_ids[1:] if t not in greedy[2][0].token_ids)
    first = greedy[0][0].token_ids.index(eos)
    engine.model.generation_config.eos_token_id = eos
    stopped = engine.generate([prompts[0], prompts[2]], temperature=0, max_tokens=16)
    assert stopped[0][0].token_ids == greedy[0][0].token_ids[: first + 1]
    assert stopped[0][0].finish_reason == "stop"
    assert stopped[1][0].token_ids == greedy[2][0].token_ids
    assert stopped[1][0].finish_reason == "length"


def test_hf_engine_stop_token_ends_a_sampled_response(tiny_dir, prompts):
    # one prompt, one sample: the same seed draws the same tokens until the stop token is sampled
    sample = HFEngine(tiny_dir, seed=0).generate(
        prompts[1:2], temperature=1.0, max_tokens=16, seed=5
    )[0][0]
    assert sample.finish_reason == "length" and len(sample.token_ids) == 16
    stop = sample.token_ids[6]
    first = sample.token_ids.index(stop)
    stopped = HFEngine(tiny_dir, seed=0).generate(
        prompts[1:2], temperature=1.0, max_tokens=16, seed=5, stop_token_ids=[stop]
    )[0][0]
    assert stopped.token_ids == sample.token_ids[: first + 1]
    assert stopped.logprobs == sample.logprobs[: first + 1]
    assert stopped.finish_reason == "stop"


def test_hf_engine_update_weights(tiny_dir, prompts):
    engine = HFEngine(tiny_dir, seed=0)
    before = engine.generate(prompts, temperature=0, max_tokens=8)
    named = {k: v.clone() for k, v in engine.model.named_parameters()}
    engine.update_weights((k, v + 0.05 * torch.randn_like(v)) for k, v in named.items())
    assert engine.generate(prompts, temperature=0, max_tokens=8) != before
    engine.update_weights(named.items())
    assert engine.generate(prompts, temperature=0, max_tokens=8) == before
    with pytest.raises(KeyError, match="unknown parameter"):
        engine.update_weights([("lm_head.weight.typo", torch.zeros(1))])


def test_a_push_of_the_trainers_full_tensors_reaches_every_parameter(tiny_dir):
    """sharding.iter_full_tensors, as the trainer pushes after each update, into an engine: every
    weight of the engine's model is then the trainer's."""
    from transformers import AutoModelForCausalLM

    import sharding

    trainer = AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32)
    with torch.no_grad():
        for p in trainer.parameters():
            p.add_(0.01 * torch.randn_like(p))
    engine = HFEngine(tiny_dir, seed=0)
    engine.update_weights(sharding.iter_full_tensors(trainer))
    engine_state, trainer_state = engine.model.state_dict(), trainer.state_dict()
    assert engine_state.keys() == trainer_state.keys()
    for name, tensor in trainer_state.items():
        assert torch.equal(engine_state[name], tensor), name


def test_hf_engine_holds_exactly_the_pushed_tensors_and_refuses_a_partial_push(tiny_dir):
    engine = HFEngine(tiny_dir, seed=0)
    g = torch.Generator().manual_seed(0)
    pushed = {k: torch.randn(v.shape, generator=g) for k, v in engine.model.named_parameters()}
    engine.update_weights(pushed.items())
    state = engine.model.state_dict()
    for name, tensor in pushed.items():
        assert torch.equal(state[name], tensor), name
    assert torch.equal(state["lm_head.weight"], pushed["model.embed_tokens.weight"])  # tied
    partial = [(k, v) for k, v in pushed.items() if k != "model.norm.weight"]
    with pytest.raises(ValueError, match="missing model.norm.weight"):
        engine.update_weights(partial)


# --------------------------------------------------------------------------- torchrun: FSDP2 + vLLM


@pytest.fixture(scope="module")
def dist_results(tmp_path_factory):
    """(per-rank results of the 2-rank run, results of the world-size-1 run)."""
    if not HAS_VLLM:
        pytest.skip("vLLM is not installed")
    work = tmp_path_factory.mktemp("dist")
    torchrun(2, "tests/dist/engine_checks.py", work)
    torchrun(1, "tests/dist/load_checks.py", work)
    return json.loads((work / "engine_checks.json").read_text()), json.loads(
        (work / "load_checks.json").read_text()
    )


@pytest.fixture(scope="module")
def ranks(dist_results):
    return dist_results[0]


def test_fsdp2_step_equals_unsharded(ranks):
    for r in ranks:
        assert r["sharded"]
        assert r["loss_diff"] < 1e-6 and r["loss_diff_gc"] < 1e-6
        assert r["grad_diff"] < 1e-6 and r["grad_diff_gc"] < 1e-6, (r["grad_diff"], r["grad_max"])
        # against two accumulated micro-batches (the ranks' rows) the gradients sum in the same
        # order
        assert r["param_diff_mb"] < 1e-6
        # against one backward over the concatenation the gradients differ by fp32 summation order
        # (~4e-7); AdamW divides by sqrt(v), which grows that to ~1e-5 in near-zero gradients
        # at lr 1e-2, still a thousandth of one step
        assert r["param_diff"] < 5e-5 and r["param_diff_gc"] < 5e-5


SINGLE_RANK = """
import os, sys, torch, torch.distributed as dist
sys.path.insert(0, os.getcwd())
import checkpoint, compile_ahead, models, ops, passes, sharding  # noqa: F401
from transformers import AutoModelForCausalLM
from bench.tiny import tiny_config
dist.init_process_group("gloo", rank=0, world_size=1)
torch.manual_seed(0)
model = AutoModelForCausalLM.from_config(tiny_config(tie=False))
expected = {k: v.clone() for k, v in model.state_dict().items()}
sharding.apply_fsdp2(model, param_dtype=torch.float32)
params = {sharding.hf_name(n): p for n, p in model.named_parameters()}
for dtype in (None, torch.bfloat16):
    full = dict(sharding.iter_full_tensors(model, dtype=dtype))
    assert sorted(full) == sorted(expected), sorted(set(full) ^ set(expected))
    for name, tensor in full.items():
        assert type(tensor) is torch.Tensor and tensor.dtype == (dtype or torch.float32), name
        assert torch.equal(tensor, expected[name].to(tensor.dtype)), name
        assert tensor.data_ptr() != params[name].to_local().data_ptr(), (
            name + " aliases the parameter")
print("OK")
"""


def test_iter_full_tensors_on_one_rank_copies_without_a_collective(tmp_path):
    """World size 1 (one GPU) takes the shortcut past DTensor: same names and values, new
    tensors."""
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29731"}
    proc = subprocess.run(
        [sys.executable, "-c", SINGLE_RANK],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0 and "OK" in proc.stdout, proc.stdout[-2000:] + proc.stderr[-3000:]


def test_compute_device_under_cpu_offload(monkeypatch):
    """Inputs go where the forward computes: the parameters' device, or the mesh's accelerator when
    FSDP2 offloads the shards to the CPU (as --param_offload / --ref_param_offload do on a GPU)."""
    import types

    import sharding

    plain = torch.nn.Linear(2, 2)
    assert sharding.compute_device(plain) == torch.device("cpu")

    class FakeDTensor(torch.nn.Parameter):  # a CPU shard of a parameter sharded over a CUDA mesh
        device_mesh = types.SimpleNamespace(device_type="cuda")

    offloaded = torch.nn.Module()
    offloaded.weight = FakeDTensor(torch.zeros(2))
    monkeypatch.setattr(sharding, "DTensor", FakeDTensor)
    monkeypatch.setattr(torch.accelerator, "current_device_index", lambda: 3)
    assert sharding.compute_device(offloaded) == torch.device("cuda", 3)
    FakeDTensor.device_mesh = types.SimpleNamespace(device_type="cpu")  # gloo on CPU: nothing moves
    assert sharding.compute_device(offloaded) == torch.device("cpu")


def test_iter_full_tensors_equals_unsharded_state_dict(ranks):
    for r in ranks:
        for tag in ("plain", "gc"):  # gc: gradient checkpointing on
            assert r[f"full_names_{tag}"], (
                "names differ from the state dict (minus the tied lm_head)"
            )
            assert r[f"full_exact_{tag}"]
            assert r[f"full_bf16_{tag}"]
        assert r["full_exact_after_bf16_forward"], (
            "a no-grad forward left bf16 root parameters in the stream"
        )


def test_vllm_after_push_matches_transformers(ranks):
    for r in ranks:
        # training moved the tied embeddings, so the push must carry them
        assert r["embed_moved"] > 1e-2
        assert r["greedy_changed_by_push"]
        assert r["greedy_equal_hf"]
        assert r["gap_trained"] < 1e-4 and r["gap_trained_ref"] < 1e-4
    assert ranks[0]["greedy_tokens"] == ranks[1]["greedy_tokens"]


def test_vllm_holds_the_pushed_weights_and_refuses_a_partial_push(ranks, dist_results):
    """After a push the engine's parameters equal those of an engine that loaded the same weights
    from their export on disk; a push without model.norm.weight is refused, naming it."""
    load = dist_results[1]
    assert load["engine_weight_names_equal"] and load["engine_weights_max_diff"] == 0.0
    for r in ranks:
        assert "missing model.norm.weight" in r["partial_push"], r["partial_push"]


def test_vllm_perturbed_weights_change_output_and_restore_exactly(ranks):
    for r in ranks:
        assert r["pert_tied"]
        assert r["gap_stale_head"] > 1e-2, "the gap check does not see a stale tied lm_head"
        assert r["pert_changed"] and r["pert_equal_hf"]
        assert r["gap_pert"] < 1e-4
        assert r["restored_tokens"] and r["restored_logprobs"]
        assert r["gap_restored"] < 1e-4
        assert r["gap_bf16_push"] < 5e-2  # a bf16 stream: close, not exact


def test_vllm_dp_groups_sample_differently(ranks):
    assert [r["dp_layout"] for r in ranks] == [[[0, 2, 0], [1, 2, 0]]] * 2  # tp=1: two groups
    assert ranks[0]["ranks_sample_differently"]


def test_checkpoint_saved_by_2_ranks_resumes_on_1(dist_results):
    load = dist_results[1]
    assert load["saved_world_size"] == 2
    assert load["trainer_state"] == load["trainer_state_expected"]
    assert load["logits_diff"] == 0.0
    assert load["optim_has_moments"] and load["optim_equal"]
    assert load["sched_equal"]
    assert load["logits_step3_diff"] < 1e-6  # the next AdamW step from the loaded state matches


def test_a_failed_save_is_named_and_keeps_the_previous_checkpoint(ranks):
    for r in ranks:
        # a full disk, as torch's writer reports it: named, the half-written folder removed
        assert r["crash_raised"]
        message = r["crash_message"]
        assert "writing checkpoint" in message and "global_step_3 failed" in message
        assert "is full (5 MiB free)" in message and "global_step_2, is untouched" in message
        assert "--resume_mode auto" in message
        assert r["latest_after_crash"] == "ckpt/global_step_2"
        assert r["list_after_crash"] == [2] and not r["tmp_left"]
        assert r["loaded_state_ws2"] == {
            "global_step": 2,
            "world_size": 2,
            "epoch": 0,
            "data_index": 7,
        }
        assert r["loaded_logits_diff_ws2"] == 0.0
        assert r["loaded_lr_ws2"][0] == r["loaded_lr_ws2"][1]
        assert r["list_after_retry"] == [2, 3] and not r["tmp_left_after_retry"]


def test_keep_last_prunes_old_checkpoints(ranks):
    for r in ranks:
        assert r["pruned"] == [
            "global_step_3",
            "global_step_4",
            "latest_checkpointed_iteration.txt",
        ]
        assert r["tracker"] == "4"


def test_export_hf_loads_in_transformers_and_vllm(dist_results):
    load = dist_results[1]
    assert load["export_dtype"] == "torch.float32" and load["export_tied"]
    assert load["export_logits_diff"] == 0.0
    assert load["export_hf_greedy"]
    assert load["export_vllm_greedy"]
    assert load["export_bf16_dtype"] == "torch.bfloat16" and load["export_bf16_weights"]


def test_vllm_log_probs_only_where_asked(tmp_path, monkeypatch):
    pytest.importorskip("vllm")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from vllm.model_executor.models import registry

    from bench.tiny import make_tiny_model

    def no_subprocess(fn):
        raise AssertionError("vLLM inspected the model class in a subprocess")

    # No model-info cache (vLLM's answer from an earlier subprocess): the engine must resolve the
    # architecture in this process.
    monkeypatch.setattr(
        registry._LazyRegisteredModel, "_load_modelinfo_from_cache", lambda self, module_hash: None
    )
    monkeypatch.setattr(registry, "_run_in_subprocess", no_subprocess)
    engine = rollout.VLLMEngine(
        make_tiny_model(str(tmp_path / "m")), max_model_len=128, **rollout.ON_CPU
    )
    prompts = [[1, 2, 3, 4], [5, 6, 7], [8, 9]]
    both = engine.generate(prompts, n=2, temperature=0, max_tokens=6)
    some = engine.generate(prompts, n=2, temperature=0, max_tokens=6, logprobs=[True, False, True])
    assert [[s.token_ids for s in o] for o in some] == [[s.token_ids for s in o] for o in both]
    assert [[s.logprobs is None for s in o] for o in some] == [
        [False, False],
        [True, True],
        [False, False],
    ]
    assert some[0][0].logprobs == pytest.approx(both[0][0].logprobs, abs=1e-6)
    none = engine.generate(prompts, temperature=1.0, max_tokens=6, logprobs=False, seed=0)
    assert all(s.logprobs is None for o in none for s in o)
    del engine  # vLLM tears down the process group it made for itself in this process
    gc.collect()


def test_update_weights_returns_the_trainers_cached_memory_before_each_wake(monkeypatch):
    """On a GPU, a sleeping engine wakes its weights, then its KV cache, each after torch's
    allocator has returned what it caches for the trainer: the update can leave nearly all of the
    GPU cached."""
    calls = []

    class FakeLLM:
        def wake_up(self, tags):
            calls.append(f"wake {tags[0]}")

        def apply_model(self, fn):
            calls.append("load")

        def reset_prefix_cache(self):
            calls.append("reset prefix cache")

    engine = object.__new__(rollout.VLLMEngine)  # the GPU path without a GPU
    engine.llm, engine.on_gpu, engine.sleeping, engine.fence = FakeLLM(), True, True, None
    engine.expected = set()  # the fake loads nothing
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: calls.append("empty_cache"))
    engine.update_weights(iter([]))
    assert calls == [
        "empty_cache",
        "wake weights",
        "load",
        "empty_cache",
        "wake kv_cache",
        "reset prefix cache",
    ]
    assert not engine.sleeping
    calls.clear()
    engine.update_weights(iter([]))  # awake: nothing to wake, nothing to return
    assert calls == ["load", "reset prefix cache"]
