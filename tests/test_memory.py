"""memory.py, the memory planner: a plan worked by hand on a made-up shape, the budgets it picks,
its predictions against peaks one H200 measured (docs/runs), what it says when nothing fits, and
--print_plan from the command line (no GPU, no weights, no data)."""

import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

import compile_ahead
import flags
import memory
import metrics
import ops
from bench.random_model import SHAPES
from bench.tiny import make_tiny_model

ROOT = Path(__file__).resolve().parents[1]
GiB = 2**30
H200 = 139.8 * GiB  # what torch reports for the H200 (docs/runs)

# h 4, intermediate 8, 2 layers, 2 heads of 2 (q_dim 4), 1 kv head (kv_dim 2), vocabulary 10
TINY = SimpleNamespace(
    hidden_size=4,
    intermediate_size=8,
    num_hidden_layers=2,
    num_attention_heads=2,
    num_key_value_heads=1,
    vocab_size=10,
    tie_word_embeddings=False,
)
# the real shapes, as bench/random_model.py writes them; Qwen2.5-Coder-0.5B-Instruct's export, which
# the H200 runs measured, unties the head
QWEN25_05B = SimpleNamespace(**{**SHAPES["qwen2.5-0.5b"], "tie_word_embeddings": False})
QWEN3_17B = SimpleNamespace(**SHAPES["qwen3-1.7b"])


def test_shape_counts_parameters_by_hand():
    shape = memory.Shape.of(TINY)
    # a layer: q 4x4 + o 4x4 = 32, k and v 4x2 each = 16, their biases 4 + 2 + 2 = 8, the MLP
    # 3 x 4 x 8 = 96, two norms 8: 160. Root: embeddings and head 2 x 10 x 4 = 80, final norm 4.
    assert (shape.q_dim, shape.kv_dim) == (4, 2)
    assert shape.layer_params == 160 and shape.root_params == 84
    assert shape.params == 2 * 160 + 84
    # Qwen2.5-0.5B with an untied head: 630.2M (docs/runs: 2.35 GiB of fp32 masters)
    assert memory.Shape.of(QWEN25_05B).params == pytest.approx(630.2e6, rel=1e-3)
    assert memory.Shape.of(QWEN3_17B).params == pytest.approx(1.72e9, rel=1e-2)


def test_a_plan_by_hand(monkeypatch):
    """TINY on a 'GPU' of 700,000 bytes, all of it usable (no margin, no overhead), prompts of 24
    tokens and responses of 8 (a quarter of a sequence is response: the head sees 8 of its 32)."""
    monkeypatch.setattr(memory, "MARGIN", 1.0)
    monkeypatch.setattr(memory, "OVERHEAD", 0)
    p = memory.plan(
        memory.Shape.of(TINY),
        700_000,
        prompt_len=24,
        response_len=8,
        batch_seqs=256,  # 8,192 tokens
        mini_batch_seqs=128,  # 4,096 tokens
        compile_update=False,
    )
    # resident: actor masters 4 x 404 + AdamW 8 x 404, reference masters 4 x 404, two roots in
    # bf16 2 x 84 each: 16 x 404 + 336 = 6,800
    # update at budget t: a micro-batch of t tokens (the mini-batch holds 4,096); each token keeps
    # 1.05 x 2 x (8x4 + 2x4 + 2x2 + 4x8) = 159.6 bytes a layer, 2 layers; the logits and their
    # gradient 0.25 x 20 x 2 = 10 bytes a token; fp32 gradients 4 x 404:
    # t = 2048: 6,800 + 1,616 + 2048 x 319.2 + 2048 x 10 = 682,617.6 <= 700,000
    # t = 3072: 1,019,718.4 > 700,000. So 2,048.
    assert p.budgets["update"] == 2048
    assert p.phases["update_actor"][0] == pytest.approx(682_617.6)
    # log-prob passes: no micro-batch holds more than the step's 8,192 tokens:
    # 6,800 + 8192 x 0.25 x 20 (logits) + 8192 x 4 x 8 (the MLP's) = 309,904; so the cap
    assert p.budgets["log_prob"] == memory.LOG_PROB_CAP
    assert p.phases["old_log_prob"][0] == pytest.approx(309_904)
    assert p.phases["ref"] == p.phases["old_log_prob"]
    # the engine: 0.6 of the GPU (the trainer leaves more); but that is no room for its weights
    assert p.engine_share == 0.6 and p.phases["gen"][0] == pytest.approx(6_800 + 420_000)
    assert not p.fits and p.problems[0].startswith("gen: the engine needs 2.0 GiB")


def within(predicted, low, high, tolerance=0.15):
    """A prediction (bytes) within 15% of every measured peak (GiB) from low to high."""
    return high * (1 - tolerance) <= predicted / GiB <= low * (1 + tolerance)


def test_the_qwen25_plan_against_the_h200s_peaks():
    """Qwen2.5-Coder-0.5B-Instruct's peaks on one H200 (docs/runs, the steps after the first),
    against plans for the same flags and the runs' mean lengths (prompts 105 tokens, responses
    about 280: the plan's responses, all of one length, are the runs' mean)."""
    shape = memory.Shape.of(QWEN25_05B)
    # GRPO at verl's tutorial shape (256 x 5, mini-batch 64) at 12,288 / 32,768-token budgets,
    # eager layers (ab_layout_grpo_h200_*, 2026-12-02): gen 94.55-94.56 GiB, the log-prob passes
    # 17.15-17.27, update_actor 33.21-33.79
    grpo = memory.plan(
        shape,
        H200,
        prompt_len=105,
        response_len=280,
        batch_seqs=1280,
        mini_batch_seqs=320,
        compile_update=False,
        engine_share=0.6,
        budgets={"update": 12288, "log_prob": 32768},
    )
    assert within(grpo.phases["gen"][0], 94.55, 94.56, 0.01)
    assert within(grpo.phases["old_log_prob"][0], 17.15, 17.27)
    assert within(grpo.phases["update_actor"][0], 33.21, 33.79)
    # PPO's quickstart (256 x 1, responses up to 512, utilization 0.4, the critic's budget 32,768;
    # ab_layout_ppo_h200_*): gen 72.10, old_log_prob 21.31-22.92, values 16.99-17.18,
    # update_critic 49.17-49.67, update_actor 38.87-38.96
    ppo = memory.plan(
        shape,
        H200,
        prompt_len=105,
        response_len=282,
        batch_seqs=256,
        mini_batch_seqs=64,
        critic=True,
        compile_update=False,
        engine_share=0.4,
        budgets={"update": 12288, "log_prob": 32768, "critic": 32768},
    )
    assert within(ppo.phases["gen"][0], 72.10, 72.10, 0.01)
    assert within(ppo.phases["old_log_prob"][0], 21.31, 22.92)
    assert within(ppo.phases["values"][0], 16.99, 17.18)
    assert within(ppo.phases["update_critic"][0], 49.17, 49.67)
    assert within(ppo.phases["update_actor"][0], 38.87, 38.96)
    # the defaults the planner picks for the tutorial's shape on an H200: the caps, 0.6
    default = memory.plan(
        shape, H200, prompt_len=105, response_len=1024, batch_seqs=1280, mini_batch_seqs=320
    )
    assert default.fits and default.budgets == {"update": 49152, "log_prob": 65536}
    assert default.engine_share == 0.6


def test_qwen3_fits_an_80gb_gpu_not_a_24gb_one_and_says_what_to_change():
    shape = memory.Shape.of(QWEN3_17B)
    kw = dict(prompt_len=512, response_len=1024, batch_seqs=3072, mini_batch_seqs=240)
    big = memory.plan(shape, 80 * GiB, **kw)
    assert big.fits and 1536 <= big.budgets["update"] < memory.UPDATE_CAP
    assert all(peak <= big.usable for peak, _ in big.phases.values())
    small = memory.plan(shape, 24 * GiB, **kw)
    assert not small.fits
    assert any(p.startswith("update_actor") for p in small.problems)
    flags = SimpleNamespace(
        enable_gradient_checkpointing=False,
        use_fused_kernels=False,
        optimizer_offload=False,
        param_offload=False,
        ref_param_offload=False,
        max_response_length=1024,
    )
    tips = " ".join(memory.advice(flags))
    for flag in ("--enable_gradient_checkpointing", "--optimizer_offload", "--param_offload"):
        assert flag in tips
    # with what the advice names, it fits the smaller GPU
    offloaded = memory.plan(
        shape,
        24 * GiB,
        **kw,
        gradient_checkpointing=True,
        fused_kernels=True,
        param_offload=True,
        ref_param_offload=True,
    )
    assert offloaded.fits, offloaded.table()


def test_print_plan_needs_no_gpu_weights_or_data(tmp_path):
    model = make_tiny_model(str(tmp_path / "model"))
    common = [sys.executable, "train_grpo.py", "--model", model, "--print_plan"]
    out = subprocess.run(
        [*common, "--gpu_memory_gib", "80", "--train_files", str(tmp_path / "none.parquet")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert "memory plan for a GPU of 80.0 GiB" in out.stdout
    for phase in ("gen", "old_log_prob", "ref", "update_actor", "update_weights"):
        assert f"\n  {phase} " in out.stdout
    assert "--use_dynamic_bsz True --ppo_max_token_len_per_gpu 49152" in out.stdout
    assert not (tmp_path / "none.parquet").exists()
    ppo = subprocess.run(
        [
            sys.executable,
            "train_ppo.py",
            "--model",
            model,
            "--print_plan",
            "--gpu_memory_gib",
            "24",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert ppo.returncode == 0 and "update_critic" in ppo.stdout, ppo.stderr[-3000:]
    no_gpu = subprocess.run(common, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert no_gpu.returncode == 1 and "no GPU is visible" in no_gpu.stderr


def test_the_flags_left_to_the_planner_and_those_given(tmp_path, monkeypatch):
    """On a CPU nothing is planned unless --gpu_memory_gib asks: the small fixed budgets, per
    sequence micro-batches. With it, token budgets the plan picks and the update compiled; a flag
    given on the command line wins, and a per-sequence micro-batch size given there keeps verl's
    meaning (no token budgets)."""
    import dataclasses

    import torch

    import train_grpo

    model = make_tiny_model(str(tmp_path / "model"))
    cpu = torch.device("cpu")

    def resolved(argv, **kw):
        monkeypatch.setattr(sys, "argv", ["train_grpo.py", *argv])
        args = dataclasses.replace(train_grpo.Args(), model=model, **kw)
        specs = [m for m in train_grpo.models(args) if m]
        return args, memory.plan_memory(args, specs, 1, cpu, 100, flags.given_flags())

    args, plan = resolved([])
    assert plan is None and args.use_dynamic_bsz is False and args.compile_update is False
    assert args.ppo_max_token_len_per_gpu == 16384 and args.gpu_memory_utilization == 0.6
    args, plan = resolved(["--gpu_memory_gib", "80"], gpu_memory_gib=80.0)
    assert plan.fits and args.use_dynamic_bsz is True and args.compile_update is True
    assert args.ppo_max_token_len_per_gpu == memory.UPDATE_CAP
    assert plan.budgets["ppo_max_token_len_per_gpu"] == memory.UPDATE_CAP
    assert args.gpu_memory_utilization == 0.6
    args, _ = resolved(
        ["--gpu_memory_gib", "80", "--ppo_max_token_len_per_gpu", "4096"],
        gpu_memory_gib=80.0,
        ppo_max_token_len_per_gpu=4096,
        gpu_memory_utilization=0.3,
    )
    assert args.ppo_max_token_len_per_gpu == 4096 and args.gpu_memory_utilization == 0.3
    args, _ = resolved(["--gpu_memory_gib", "80", "--ppo_micro_batch_size_per_gpu", "2"])
    assert args.use_dynamic_bsz is False


def test_a_bare_switch_left_to_the_planner_reads_as_true():
    import train_grpo

    argv = ["--use_dynamic_bsz", "--actor_lr", "1e-6", "--compile_update", "--use_torch_compile"]
    assert flags.bare_switches(train_grpo.Args, [*argv, "false"]) == [
        "--use_dynamic_bsz",
        "true",
        "--actor_lr",
        "1e-6",
        "--compile_update",
        "true",
        "--use_torch_compile",
        "false",
    ]


def test_print_plan_under_torchrun_ends_every_rank_cleanly(tmp_path):
    """A clean exit is not a rank's failure: with two processes --print_plan exits 0, the plan
    printed once."""
    from tests.tiny_model import free_port

    model = make_tiny_model(str(tmp_path / "model"))
    port = str(free_port())
    out = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--master_port", port]
        + ["train_grpo.py", "--model", model, "--print_plan", "--gpu_memory_gib", "80"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.count("memory plan for a GPU of 80.0 GiB") == 1
    assert "failed" not in out.stderr


def test_the_eager_first_step_plans_eager_budgets_and_gives_the_compiled_ones_back(
    tmp_path, monkeypatch
):
    """--warm_compile_caches on an H200 at verl's GRPO tutorial shape: the first step runs eager at
    the budgets of a plan for eager passes on the GPU less the helper's memory (18.2 GiB, worked
    below), with the update's output layer chunk by chunk (--use_fused_kernels; without it the
    eager plan's update would take 33,792 tokens against the compiled plan's 49,152) and each
    phase starting with torch's cached memory given back; checkpoints and loggers get the flags as
    given meanwhile. After it the compiled plan, budgets and output layer are back, the compiler's
    stance too, and the step's passes compile on the helper's made-up batch (15 x (8 + 1,024)
    tokens: 14,848 response tokens, whose logits pass 2**31 elements at 151,936 wide)."""
    import dataclasses

    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    import run
    import train_grpo
    from bench.tiny import tiny_config

    config = {k: v for k, v in vars(QWEN25_05B).items() if k != "model_type"}
    AutoConfig.for_model("qwen2", **config).save_pretrained(tmp_path)
    monkeypatch.setattr(metrics.Timer, "release_cache", False)
    monkeypatch.setattr(sys, "argv", ["train_grpo.py"])
    args = dataclasses.replace(train_grpo.Args(), model=str(tmp_path), gpu_memory_gib=139.8)
    cpu = torch.device("cpu")
    # planned as on the GPU (nothing here runs on it)
    specs = [m for m in train_grpo.models(args) if m]
    r = run.Run(args, 0, 1, torch.device("cuda"), specs)
    r.plan, r.prompt_len = memory.plan_memory(args, specs, 1, cpu, 105, set()), 105
    r.loaded = {"actor": AutoModelForCausalLM.from_config(tiny_config())}  # a plain output layer
    warm = object.__new__(compile_ahead.WarmStart)  # without the helper process
    warm.run, warm.process, warm.eager = r, None, False
    r.warm = warm
    compiled = r.plan
    # the helper: one-layer models (the root's 272,270,208 parameters, untied, and a layer's
    # 14,912,384) at 10 bytes each, the reference's at 6, and the made-up batch's 15,360 response
    # tokens of logits and their gradient in bf16, a quarter more, and 2 GiB
    helper = int(1.25 * (287_182_592 * 16 + 15_360 * 151_936 * 4)) + 2 * GiB
    config = AutoConfig.from_pretrained(tmp_path)
    assert compile_ahead.helper_bytes(args, config, specs) == helper
    assert round(helper / GiB, 1) == 18.2
    budgets = {"ppo_max_token_len_per_gpu": 49152, "log_prob_max_token_len_per_gpu": 65536}
    assert compiled.budgets == budgets
    eager = {
        fused: memory.plan(
            memory.Shape.of(QWEN25_05B),
            compiled.gpu - helper,
            prompt_len=105,
            response_len=1024,
            batch_seqs=1280,
            mini_batch_seqs=320,
            fused_kernels=fused,
            compiled_log_probs=False,
            compile_update=False,
            engine_share=0.6,
        )
        for fused in (False, True)
    }
    assert eager[False].budgets == {"update": 33792, "log_prob": 65536}
    assert eager[True].budgets == {"update": 49152, "log_prob": 65536}
    warm.eager_budgets()
    assert (args.ppo_max_token_len_per_gpu, args.log_prob_max_token_len_per_gpu) == (49152, 65536)
    assert args.use_fused_kernels and metrics.Timer.release_cache
    assert r.plan.phases == eager[True].phases
    warm.eager = True  # as first_step_eager sets it
    given = r.flags()
    assert (given["ppo_max_token_len_per_gpu"], given["use_fused_kernels"]) == (49152, False)
    made_up = []
    monkeypatch.setattr(
        compile_ahead, "compile_ahead", lambda *a, tokens=None, **k: made_up.append(tokens)
    )
    torch.compiler.set_stance("force_eager")
    ops.compile_logits_math(False)
    try:
        warm.after_step()
        assert ops.LOGITS_MATH["log_probs"] is ops.compiled_log_probs  # a GPU's math
    finally:
        torch.compiler.set_stance("default")
        ops.compile_logits_math(False)
    assert (args.ppo_max_token_len_per_gpu, args.log_prob_max_token_len_per_gpu) == (49152, 65536)
    assert not args.use_fused_kernels and not metrics.Timer.release_cache
    assert r.plan is compiled and made_up == [15 * (8 + 1024)] and not warm.eager
