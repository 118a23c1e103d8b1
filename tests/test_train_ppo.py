"""train_ppo.py end to end on CPU: two real steps under `torchrun --nproc_per_node=2` (gloo) with
each rollout engine, critic warm-up, and resume equivalence (actor, critic and the adaptive KL
coefficient).

Data, model and reward as in tests/test_train_grpo.py: a GSM8K-shaped fixture made by data/gsm8k.py,
the tiny random Qwen2 of bench/tiny.py (the critic loads the same body with a new value head),
and the share of ASCII letters and digits in the response, which varies from response to response.
"""

import json
import math
import os
import subprocess
import sys

import pyarrow.parquet as pq
import pytest
import torch
from safetensors.torch import load_file
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from tests import test_train_grpo
from tests.test_train_grpo import ROOT, metrics_by_step
from tests.tiny_model import free_port

assets = test_train_grpo.assets  # the same fixture: parquet files, tiny model, reward file
LR, CRITIC_LR = 1e-4, 1e-3
N = 4  # sequences per step: --train_batch_size 4 x --rollout_n 1
# every metric the trainer logs on each step; STEP2_ONLY appear with validation (--test_freq 2)
METRICS = [
    "critic/score/mean",
    "critic/score/max",
    "critic/score/min",
    "critic/rewards/mean",
    "critic/advantages/mean",
    "critic/values/mean",
    "critic/returns/mean",
    "critic/vf_loss",
    "critic/vf_clipfrac",
    "critic/vpred_mean",
    "critic/vf_explained_var",
    "critic/grad_norm",
    "critic/lr",
    "actor/reward_kl_penalty",
    "actor/reward_kl_penalty_coeff",
    "actor/pg_loss",
    "actor/pg_clipfrac",
    "actor/pg_clipfrac_lower",
    "actor/ppo_kl",
    "actor/entropy",
    "actor/grad_norm",
    "actor/lr",
    "response_length/mean",
    "response_length/max",
    "prompt_length/mean",
    "timing_s/gen",
    "timing_s/old_log_prob",
    "timing_s/ref",
    "timing_s/values",
    "timing_s/adv",
    "timing_s/update_critic",
    "timing_s/update_actor",
    "timing_s/update_weights",
    "timing_s/step",
    "timing_s/since_launch",
    "perf/throughput",
    "perf/mfu/actor",
    "perf/mfu/old_log_prob",
    "perf/mfu/values",
    "perf/mfu/critic",
    "rollout/logprob_gap_mean",
]
# what only the actor's update logs (the policy's entropy comes from the old log-prob pass, every
# step)
ACTOR_ONLY = [
    k for k in METRICS if k.startswith("actor/") and "reward_kl" not in k and k != "actor/entropy"
] + ["timing_s/update_actor", "perf/mfu/actor"]
STEP2_ONLY = [
    "timing_s/testing",
    "val-core/openai/gsm8k/reward/mean@1",
    "val-core/openai/gsm8k/acc/mean@1",
]


def flags(assets, out_dir, engine, steps, resume="disable", *extra):
    return [
        "--model",
        assets["model"],
        "--train_files",
        str(assets["data"] / "train.parquet"),
        "--val_files",
        str(assets["data"] / "test.parquet"),
        "--custom_reward_function_path",
        str(assets["reward"]),
        "--rollout_engine",
        engine,
        "--max_prompt_length",
        "256",
        "--max_response_length",
        "16",
        "--train_batch_size",
        "4",
        "--ppo_mini_batch_size",
        "2",
        "--ppo_micro_batch_size_per_gpu",
        "1",
        "--critic_ppo_micro_batch_size_per_gpu",
        "1",
        "--log_prob_micro_batch_size_per_gpu",
        "2",
        "--total_training_steps",
        str(steps),
        "--test_freq",
        "2",
        "--max_val_samples",
        "8",
        "--actor_lr",
        str(LR),
        "--critic_lr",
        str(CRITIC_LR),
        "--lr_warmup_steps",
        "2",
        # adaptive with a short horizon, so the coefficient moves visibly: 1 + e * 4 / 10
        "--kl_ctrl_type",
        "adaptive",
        "--kl_horizon",
        "10",
        "--save_freq",
        "1",
        "--logger",
        "console,jsonl",
        "--default_local_dir",
        str(out_dir),
        "--resume_mode",
        resume,
        *extra,
    ]


def run_ppo(args, timeout=300, nproc=2):
    """train_ppo.py under torchrun with `nproc` ranks; fails the test on a non-zero exit."""
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "MASTER_PORT": str(free_port())}
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nproc_per_node={nproc}",
        "--master_port",
        env["MASTER_PORT"],
        "train_ppo.py",
        *args,
    ]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    proc.output = proc.stdout + proc.stderr
    assert proc.returncode == 0, proc.output[-6000:]
    return proc


def checkpoint(out_dir, step):
    """The model state dicts of a global_step_N folder, read without a process group."""
    dst = out_dir / f"step{step}.pt"
    dcp_to_torch_save(out_dir / f"global_step_{step}", dst)
    state = torch.load(dst, weights_only=False)
    return state["model.actor"], state["model.critic"]


TOKEN_BUDGET = [
    "--use_dynamic_bsz",
    "--ppo_max_token_len_per_gpu",
    "300",
    "--log_prob_max_token_len_per_gpu",
    "300",
    "--critic_ppo_max_token_len_per_gpu",
    "300",
]


def two_step_run(assets, engine, *extra, name=None):
    out = assets["tmp"] / (name or f"ppo_{engine}{'_'.join(extra)}")
    proc = run_ppo(flags(assets, out, engine, 2, "disable", *extra))
    (assets["tmp"] / f"{out.name}.log").write_text(proc.output)
    return out


@pytest.fixture(scope="module")
def hf_run(assets):
    """Micro-batches by token budget (the same count on both ranks; the vLLM run by count).
    Activations recomputed in both updates (Hugging Face's checkpointing under FSDP2). Every
    response written out as text."""
    dumps = assets["tmp"] / "ppo_dumps"
    checkpointing = ["--enable_gradient_checkpointing", "--critic_enable_gradient_checkpointing"]
    dirs = [
        "--rollout_data_dir",
        str(dumps / "rollouts"),
        "--validation_data_dir",
        str(dumps / "val"),
    ]
    return two_step_run(assets, "hf", *TOKEN_BUDGET, *checkpointing, *dirs, name="ppo_hf")


@pytest.fixture(scope="module")
def vllm_run(assets):
    """Actor, reference and critic compiled, the updates too (the hf run stays eager); vLLM decodes
    one sequence at a time, the others waiting for its slot; the policy loss weighted by the
    engine's log-probs (--rollout_is)."""
    compiled = [
        "--use_torch_compile",
        "true",
        "--compile_layers",
        "true",
        "--compile_update",
        "true",
    ]
    return two_step_run(
        assets, "vllm", *compiled, "--max_num_seqs", "1", "--rollout_is", "sequence"
    )


def check_metrics(m, names, step):
    missing = [k for k in names if k not in m]
    assert not missing, f"step {step} lacks {missing}"
    bad = {k: m[k] for k in names if not math.isfinite(m[k])}
    assert not bad, f"step {step}: non-finite {bad}"


@pytest.mark.parametrize("run", ["hf_run", "vllm_run"])
def test_two_steps_log_every_metric_and_change_actor_and_critic(run, assets, request):
    out = request.getfixturevalue(run)
    m = metrics_by_step(out)
    assert sorted(m) == [1, 2]  # no validation before training (verl's quickstart)
    log = (out.parent / f"{out.name}.log").read_text()  # the critic's new head said in a line
    assert "with score.bias, score.weight initialised afresh" in log, log[-3000:]
    assert "LOAD REPORT" not in log
    for step, names in ((1, METRICS), (2, METRICS + STEP2_ONLY)):
        check_metrics(m[step], names, step)
        # the fp32 engine holds exactly the trainer's weights: what is left is the two forwards'
        # float rounding (~1e-6; a push without model.norm.weight made it ~7e-5)
        assert m[step]["rollout/logprob_gap_mean"] < 1e-5
        assert (
            m[step]["actor/grad_norm"] > 0
            and m[step]["critic/grad_norm"] > 0
            and m[step]["critic/vf_loss"] > 0
        )
        assert m[step]["critic/lr"] == pytest.approx(CRITIC_LR)  # constant
        assert 0 <= m[step]["critic/vf_clipfrac"] <= 1
        assert abs(m[step]["critic/advantages/mean"]) < 1e-5  # whitened over the batch
    # --lr_warmup_steps 2: the actor trains at LR / 2, then LR
    assert m[1]["actor/lr"] == pytest.approx(LR / 2) and m[2]["actor/lr"] == pytest.approx(LR)
    # adaptive beta: step 1's policy is the reference, KL = 0 -> e = clip(0 / 6 - 1) = -0.2, beta
    # *= 1 - 0.2 * 4 / 10
    assert m[1]["actor/reward_kl_penalty"] == pytest.approx(0.0, abs=1e-6)
    # ... so the step's rewards are its scores, each once (on the last token)
    assert m[1]["critic/rewards/mean"] == pytest.approx(m[1]["critic/score/mean"], rel=1e-5)
    assert m[1]["actor/reward_kl_penalty_coeff"] == pytest.approx(0.001)
    assert m[2]["actor/reward_kl_penalty_coeff"] == pytest.approx(0.001 * (1 - 0.2 * N / 10))
    assert m[2]["actor/reward_kl_penalty"] != 0  # the actor moved away from the reference
    # the critic learned from step 1: step 2's values come from the updated critic
    assert m[2]["critic/values/mean"] != pytest.approx(m[1]["critic/values/mean"], abs=1e-4)

    # --max_num_seqs reached the engine (vLLM logs the arguments it was given)
    if run == "vllm_run":
        assert "'max_num_seqs': 1," in (assets["tmp"] / f"{out.name}.log").read_text()
        # --rollout_is sequence: the fp32 engine samples from the trainer's distribution
        for step in (
            1,
            2,
        ):
            assert m[step]["rollout_corr/rollout_is_mean"] == pytest.approx(1.0, abs=1e-3)
            assert m[step]["rollout_corr/rollout_is_ratio_fraction_high"] == 0.0
    else:
        assert not [k for k in m[2] if k.startswith("rollout_corr/")]  # no --rollout_is: no weights

    initial = load_file(f"{assets['model']}/model.safetensors")
    final = load_file(out / "hf_model" / "model.safetensors")
    for name, w in initial.items():
        if w.dim() == 2:  # the export is bf16: ~half the entries move past rounding
            assert (w.to(final[name].dtype) != final[name]).float().mean().item() > 0.1, name
    actor, critic = checkpoint(out, 2)
    for name, w in initial.items():
        if w.dim() == 2:
            assert not torch.equal(critic[name], w), name  # the value model's body trained too
    # body + value head
    assert critic.keys() == actor.keys() - {"lm_head.weight"} | {
        "score.weight",
        "score.bias",
    }
    assert critic["score.weight"].shape == (1, 128)


def test_rollout_and_validation_data_dirs_hold_every_response(assets, hf_run):
    """As in GRPO: every response of each step and of the validation at step 2, with the scores the
    metrics averaged, validation in the data's order."""
    m, dumps = metrics_by_step(hf_run), assets["tmp"] / "ppo_dumps"
    assert sorted(os.listdir(dumps / "rollouts")) == ["1.jsonl", "2.jsonl"]
    for step in (1, 2):
        rows = test_train_grpo.read_jsonl(dumps / "rollouts" / f"{step}.jsonl")
        assert (
            len(rows) == N
            and {r["step"] for r in rows} == {step}
            and all("What is" in r["input"] for r in rows)
        )
        assert sum(r["score"] for r in rows) / N == pytest.approx(m[step]["critic/score/mean"])
    assert os.listdir(dumps / "val") == ["2.jsonl"]  # no validation before training
    rows = test_train_grpo.read_jsonl(dumps / "val" / "2.jsonl")
    assert len(rows) == 8 and sum(r["score"] for r in rows) / 8 == pytest.approx(
        m[2]["val-core/openai/gsm8k/reward/mean@1"]
    )
    assert sum(r["acc"] for r in rows) / 8 == pytest.approx(
        m[2]["val-core/openai/gsm8k/acc/mean@1"]
    )
    data = pq.read_table(assets["data"] / "test.parquet").to_pylist()[:8]
    assert [r["gts"] for r in rows] == [d["reward_model"]["ground_truth"] for d in data]


def test_critic_warmup_updates_only_the_critic_first(assets):
    out = two_step_run(assets, "hf", "--critic_warmup", "1")
    m = metrics_by_step(out)
    assert not [k for k in ACTOR_ONLY if k in m[1]], "the actor updated during the critic's warm-up"
    check_metrics(m[1], [k for k in METRICS if k not in ACTOR_ONLY], 1)
    check_metrics(m[2], METRICS, 2)
    # the actor's schedule starts at its first update
    assert m[2]["actor/lr"] == pytest.approx(LR / 2)
    initial = load_file(f"{assets['model']}/model.safetensors")
    actor1, critic1 = checkpoint(out, 1)
    actor2, _ = checkpoint(out, 2)
    for name, w in initial.items():
        # step 1: actor untouched
        torch.testing.assert_close(actor1[name], w, rtol=0, atol=0, msg=name)
        if w.dim() == 2:
            assert not torch.equal(critic1[name], w), name  # ... the critic trained
            assert not torch.equal(actor2[name], w), name  # step 2: the actor trains


def test_groups_filtered_and_generated_beside_the_training(assets):
    """The batch's extras are shared flags (batches.py): PPO with groups of 2, DAPO's filter and
    one-step off-policy generation trains two steps on groups whose scores vary; a fixed KL
    coefficient stays put."""
    out = two_step_run(
        assets,
        "hf",
        "--rollout_n",
        "2",
        "--filter_groups",
        "--one_step_off_policy",
        "--kl_ctrl_type",
        "fixed",
        "--rollout_data_dir",
        str(assets["tmp"] / "ppo_filter_rollouts"),
        name="ppo_filter",
    )
    m = metrics_by_step(out)
    # step 1's weights go into the engine at step 2's start, once the batch it generated is done
    check_metrics(m[2], METRICS, 2)
    # --kl_ctrl_type fixed: beta stays where it started while the KL moves
    assert m[2]["actor/reward_kl_penalty"] != 0
    for step in (1, 2):
        assert m[step]["actor/reward_kl_penalty_coeff"] == pytest.approx(0.001)
        assert m[step]["rollout/gen_prompts"] >= 4 and "timing_s/gen_background" in m[step]
        rows = [
            json.loads(line)
            for line in open(assets["tmp"] / "ppo_filter_rollouts" / f"{step}.jsonl")
        ]
        scores = {}
        for row in rows:  # the rows of a group: the same prompt
            scores.setdefault(row["input"], []).append(row["score"])
        assert len(scores) == 4 and all(
            len(set(s)) == 2 for s in scores.values()
        )  # every group varies


def test_fused_kernels_train_the_same_step(assets, hf_run):
    """--use_fused_kernels changes how the actor's update computes its log-probs, not what it
    computes: the first step, on the same rollouts, logs the actor's and the critic's metrics of the
    run without it."""
    out = assets["tmp"] / "ppo_hf_fused"
    run_ppo(flags(assets, out, "hf", 1, "disable", *TOKEN_BUDGET, "--use_fused_kernels", "true"))
    fused, whole = metrics_by_step(out)[1], metrics_by_step(hf_run)[1]
    keys = [k for k in whole if k.startswith(("actor/", "critic/"))]
    assert {"actor/pg_loss", "actor/entropy", "actor/grad_norm", "critic/vf_loss"} <= set(keys)
    differ = {
        k: (whole[k], fused[k])
        for k in keys
        if fused[k] != pytest.approx(whole[k], rel=1e-5, abs=1e-9)
    }
    assert not differ, differ


def test_sigterm_checkpoints_the_step_in_progress_and_resume_continues(assets):
    """SIGTERM during a run that checkpoints every 10 steps loses no step (the GRPO test's
    procedure)."""
    out = assets["tmp"] / "ppo_sigterm"
    test_train_grpo.stop_by_sigterm_then_resume(
        "train_ppo.py",
        out,
        lambda steps, resume: flags(
            assets, out, "hf", steps, resume, *TOKEN_BUDGET, "--save_freq", "10", "--test_freq", "1"
        ),
    )


def test_sigterm_during_validation_stops_after_that_step(assets):
    """The GRPO test's procedure (test_train_grpo.stop_in_validation)."""
    out = assets["tmp"] / "ppo_sigterm_val"
    test_train_grpo.stop_in_validation(
        run_ppo,
        out,
        lambda reward_fn: flags(
            assets,
            out,
            "hf",
            20,
            "disable",
            *TOKEN_BUDGET,
            "--save_freq",
            "10",
            "--test_freq",
            "2",
            "--val_before_train",
            "false",
            "--custom_reward_function_path",
            str(reward_fn),
        ),
    )


def test_resume_replays_the_uninterrupted_run(assets, hf_run):
    """A run stopped after step 1 and resumed, from a checkpoint in the older trainer-state format,
    logs and saves what the uninterrupted run does."""
    out = assets["tmp"] / "ppo_hf_resumed"
    run_ppo(flags(assets, out, "hf", 1, "disable", *TOKEN_BUDGET))
    # the trainer state as train_ppo.py wrote it before it drew prompts through
    # data.dataset.PromptOrder: the batches used in the epoch (batch_idx) instead of the prompts
    # (data_offset); it resumes alike
    path = out / "global_step_1" / "trainer_state.json"
    state = json.loads(path.read_text())
    assert state["data_offset"] == 4 and not state["all_equal_streak"]  # one step of 4 prompts
    path.write_text(
        json.dumps(
            {
                "global_step": 1,
                "world_size": 2,
                "epoch": state["epoch"],
                "batch_idx": 1,
                "kl_coef": state["kl_coef"],
            }
        )
    )
    second = run_ppo(flags(assets, out, "hf", 2, "auto", *TOKEN_BUDGET))
    assert "resumed from" in second.output and "global_step_1" in second.output
    resumed, whole = metrics_by_step(out), metrics_by_step(hf_run)
    assert sorted(resumed) == [1, 2]
    for step in (1, 2):
        keys = {k for k in whole[step] if not k.startswith(("timing_s/", "perf/"))}
        # the first launch's last step (1) also validated, so its row has the val-* metrics on top
        assert keys <= resumed[step].keys()
        differ = {
            k: (whole[step][k], resumed[step][k])
            for k in keys
            if resumed[step][k] != pytest.approx(whole[step][k], rel=1e-6, abs=1e-12)
        }
        assert not differ, f"step {step} differs after resuming: {differ}"
    # the adaptive coefficient came back from the checkpoint (else step 2 would log 0.001 again)
    assert (
        resumed[2]["actor/reward_kl_penalty_coeff"]
        == whole[2]["actor/reward_kl_penalty_coeff"]
        != 0.001
    )
    for a, b in zip(checkpoint(hf_run, 2), checkpoint(out, 2)):  # actor and critic, bit for bit
        for name in a:
            torch.testing.assert_close(b[name], a[name], rtol=0, atol=0, msg=name)
