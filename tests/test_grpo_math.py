"""train_grpo.py's own math against small examples worked out by hand (the math it shares with
train_ppo.py: tests/test_shared_math.py; its update against a computation of its own:
tests/test_update.py), and its properties: micro-batching leaves the gradient unchanged (packed or
padded), update_actor steps as its flags say; check_args names the flag it rejects. The passes
under it (log-probs, packing, compiling, the optimizer step) are tested in tests/test_sharding.py,
the run around it in tests/test_run.py.

Shapes as in train_grpo.py: N sequences (B prompts x n samples), T response tokens, V vocabulary.
"""

import dataclasses
import math

import pytest
import torch

import ops
import passes
import sharding
import train_grpo
from passes import forward_log_probs
from tests.tiny_model import LENGTHS, GradRecorder, make_samples, tiny_policy
from train_grpo import (
    Args,
    agg_loss,
    check_args,
    compute_grpo_outcome_advantage,
    compute_policy_loss,
    kl_penalty,
)

MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm")


def close(actual, expected, atol=1e-4, rtol=0.0):
    torch.testing.assert_close(
        torch.as_tensor(actual, dtype=torch.float32),
        torch.as_tensor(expected, dtype=torch.float32),
        atol=atol,
        rtol=rtol,
    )


# --- advantages ----------------------------------------------------------------------------------


def test_grpo_advantage_group_of_three():
    # group [1, 0, 0]: mean = 1/3, deviations [2/3, -1/3, -1/3]
    # unbiased var = (4/9 + 1/9 + 1/9) / (3 - 1) = 1/3, std = sqrt(1/3) = 0.57735
    # A = [2/3, -1/3, -1/3] / (0.57735 + 1e-6) = [1.1547, -0.57735, -0.57735]
    scores = torch.tensor([1.0, 0.0, 0.0])
    mask = torch.ones(3, 2)
    adv = compute_grpo_outcome_advantage(scores, mask, n=3)  # (N, T)
    close(adv, [[1.1547, 1.1547], [-0.57735, -0.57735], [-0.57735, -0.57735]])
    # eps sits in the denominator: 1e-6 / 0.57735 = 1.7e-6 relative, below the 4 digits above
    std = math.sqrt(1 / 3)
    close(
        adv[:, 0],
        [(2 / 3) / (std + 1e-6), (-1 / 3) / (std + 1e-6), (-1 / 3) / (std + 1e-6)],
        atol=1e-6,
    )
    assert adv[0, 0] < (2 / 3) / std  # eps pulls the magnitude down, never up


def test_dr_grpo_advantage_is_not_divided_by_std():
    # Dr.GRPO: A = r - mean = [1 - 1/3, 0 - 1/3, 0 - 1/3] = [0.6667, -0.3333, -0.3333]
    adv = compute_grpo_outcome_advantage(
        torch.tensor([1.0, 0.0, 0.0]), torch.ones(3, 1), n=3, norm_adv_by_std=False
    )
    close(adv[:, 0], [2 / 3, -1 / 3, -1 / 3], atol=1e-6)


def test_groups_are_consecutive_rows_and_equal_scores_give_zero():
    # two groups of n = 2: [3, 1] -> mean 2, std = sqrt(((1)^2 + (-1)^2) / 1) = 1.4142, A = [0.7071,
    # -0.7071]
    #                      [5, 5] -> all equal: mean 5, std 0, A = 0 / (0 + eps) = 0 (no signal, no
    #                      nan)
    adv = compute_grpo_outcome_advantage(torch.tensor([3.0, 1.0, 5.0, 5.0]), torch.ones(4, 1), n=2)
    close(adv[:, 0], [0.70711, -0.70711, 0.0, 0.0])
    assert torch.isfinite(adv).all()
    adv = compute_grpo_outcome_advantage(torch.tensor([0.5] * 4), torch.ones(4, 3), n=4)
    assert torch.equal(adv, torch.zeros(4, 3))


def test_advantage_is_zero_on_padding():
    # response lengths 3, 1, 2: the mask zeroes the rest of each row
    mask = torch.tensor([[1, 1, 1], [1, 0, 0], [1, 1, 0]], dtype=torch.float)
    adv = compute_grpo_outcome_advantage(torch.tensor([1.0, 0.0, 0.0]), mask, n=3)
    close(adv, [[1.1547, 1.1547, 1.1547], [-0.57735, 0, 0], [-0.57735, -0.57735, 0]])


# --- start-up checks -----------------------------------------------------------------------------


def good_args(**kw):
    return Args(
        **{
            **dict(
                train_batch_size=8,
                rollout_n=2,
                ppo_mini_batch_size=4,
                ppo_micro_batch_size_per_gpu=2,
                default_local_dir="/tmp/unused",
            ),
            **kw,
        }
    )


def test_check_args_accepts_the_qwen3_tutorial_shape():
    # 1024 prompts in mini-batches of 80 (the last one 64), micro-batches of 20: verl runs it as is
    check_args(
        good_args(
            train_batch_size=1024,
            rollout_n=3,
            ppo_mini_batch_size=80,
            ppo_micro_batch_size_per_gpu=20,
        ),
        world_size=1,
    )


def test_check_args_accepts_a_good_config_and_fills_defaults():
    args = good_args()
    check_args(args, world_size=2)
    assert args.kl_loss_coef == 0.001 and args.kl_coef == 0.001


@pytest.mark.parametrize(
    "kw, world, flag",
    [
        (dict(rollout_n=1), 2, "--rollout_n"),
        (
            dict(train_batch_size=6),
            4,
            "--train_batch_size 6 must be divisible by the number of GPUs 4",
        ),
        (
            dict(ppo_mini_batch_size=16),
            2,
            "--ppo_mini_batch_size 16 must not exceed --train_batch_size 8",
        ),
        (dict(ppo_mini_batch_size=3, rollout_n=3), 2, "--ppo_mini_batch_size x --rollout_n"),
        (
            dict(use_kl_loss=False, kl_loss_coef=0.01),
            2,
            "--kl_loss_coef is set but --use_kl_loss is false",
        ),
        (dict(kl_coef=0.01), 2, "--kl_coef is set but --use_kl_in_reward is false"),
        (dict(rollout_engine="sglang"), 2, "--rollout_engine"),
        (dict(engines_per_gpu=0), 2, "--engines_per_gpu 0 must be at least 1"),
        (
            dict(engines_per_gpu=2, rollout_engine="hf"),
            2,
            "--engines_per_gpu above 1 needs --rollout_engine vllm",
        ),
        (
            dict(engines_per_gpu=2, tensor_model_parallel_size=2),
            2,
            "and --tensor_model_parallel_size 1",
        ),
        (dict(resume_mode="/no/such/global_step_3"), 2, "--resume_mode"),
        (dict(rollout_is="geometric"), 2, "--rollout_is 'geometric' must be token or sequence"),
        (
            dict(rollout_is="token", rollout_is_threshold=0.5),
            2,
            "--rollout_is_threshold 0.5 must be at least 1",
        ),
        (dict(gen_batch_size=16), 2, "--gen_batch_size only applies with --filter_groups"),
        (
            dict(gen_batch_size=6, filter_groups=True),
            4,
            "--gen_batch_size 6 must be 0 or a multiple of the number of GPUs",
        ),
        (
            dict(gen_batch_size=-8, filter_groups=True),
            2,
            "--gen_batch_size -8 must be 0 or a multiple",
        ),
        (
            dict(filter_groups_from_step=8),
            2,
            "--filter_groups_from_step only applies with --filter_groups",
        ),
        (
            dict(filter_groups_from_step=0, filter_groups=True),
            2,
            "--filter_groups_from_step 0 must be >= 1",
        ),
        (dict(skip_all_equal=True), 2, "--skip_all_equal only applies with --filter_groups"),
        (dict(lr_scheduler_type="linear"), 2, "--lr_scheduler_type must be constant or cosine"),
        (
            dict(lr_scheduler_type="cosine", min_lr_ratio=1.5),
            2,
            r"--min_lr_ratio 1.5 must be in \[0, 1\]",
        ),
        (
            dict(lr_scheduler_type="cosine", lr_decay_steps_ratio=0.0),
            2,
            r"--lr_decay_steps_ratio 0.0 must be in \(0, 1\]",
        ),
        (dict(min_lr_ratio=0.1), 2, "shape the cosine schedule: add --lr_scheduler_type cosine"),
        (
            dict(lr_decay_steps_ratio=0.3),
            2,
            "shape the cosine schedule: add --lr_scheduler_type cosine",
        ),
        (
            dict(skip_all_equal=True, filter_groups=True, skip_explore_prob=0.0),
            2,
            r"--skip_explore_prob 0.0 must be in \(0, 1\]",
        ),
    ],
)
def test_check_args_names_the_flag(kw, world, flag):
    with pytest.raises(SystemExit, match=flag):
        check_args(good_args(**kw), world_size=world)


@pytest.mark.parametrize(
    "kw, flag",
    [
        (dict(loss_agg_mode="token-sum"), "--loss_agg_mode"),
        (dict(kl_loss_type="k4"), "--kl_loss_type"),
    ],
)
def test_check_args_rejects_unknown_variants(kw, flag):
    with pytest.raises(ValueError, match=flag):
        check_args(good_args(**kw), world_size=2)


# --- properties on a tiny model -------------------------------------------------------------------


@pytest.fixture(scope="module")
def model():
    return tiny_policy()


def accumulated_grads(
    model, samples, micro, packed, mode, old_log_probs, ref_log_probs, advantages, mask
):
    """The loss of update_actor's inner loop (pg + kl - entropy bonus) with global denominators,
    accumulated over micro-batches of `micro` sequences; returns the gradient of every parameter."""
    model.zero_grad(set_to_none=True)
    agg_kw = dict(
        mode=mode, num_tokens=mask.sum().item(), num_seqs=len(samples), max_response_length=8
    )
    for i in range(0, len(samples), micro):
        mb = slice(i, i + micro)
        log_probs, entropy = forward_log_probs(model, samples[mb], 1.0, packed, with_entropy=True)
        Tm = log_probs.shape[1]
        m = mask[mb, :Tm]
        pg_losses, _ = compute_policy_loss(
            old_log_probs[mb, :Tm], log_probs, advantages[mb, :Tm], m, 0.2, 0.28, 3.0
        )
        kl = kl_penalty(log_probs, ref_log_probs[mb, :Tm], "low_var_kl")
        loss = (
            agg_loss(pg_losses, m, **agg_kw)
            + 0.1 * agg_loss(kl, m, **agg_kw)
            - 0.01 * agg_loss(entropy, m, **agg_kw)
        )
        loss.backward()
    return {name: p.grad.clone() for name, p in model.named_parameters()}


@pytest.mark.parametrize("packed", [True, False], ids=["packed", "padded"])
@pytest.mark.parametrize("mode", MODES)
def test_micro_batching_leaves_the_gradient_unchanged(model, mode, packed):
    samples = make_samples(LENGTHS, seed=1)
    with torch.no_grad():
        log_probs, _ = forward_log_probs(model, samples, 1.0, packed, with_entropy=False)  # (N, T)
    mask = passes.response_targets(samples, 6, "cpu")[1]
    g = torch.Generator().manual_seed(2)
    # old log-probs off by up to +-0.5, so some ratios clip; a group of 4 with scores [1, 0, 0.5, 0]
    old_log_probs = (log_probs + (torch.rand(4, 6, generator=g) - 0.5)) * mask
    ref_log_probs = (log_probs + 0.3 * torch.randn(4, 6, generator=g)) * mask
    advantages = compute_grpo_outcome_advantage(torch.tensor([1.0, 0.0, 0.5, 0.0]), mask, n=4)
    args = (packed, mode, old_log_probs, ref_log_probs, advantages, mask)
    whole = accumulated_grads(model, samples, 4, *args)
    assert sum(g.abs().sum() for g in whole.values()) > 0
    for micro in (1, 2):
        split = accumulated_grads(model, samples, micro, *args)
        for name in whole:
            torch.testing.assert_close(split[name], whole[name], atol=1e-5, rtol=1e-5, msg=name)


def test_update_actor_weighs_the_policy_gradient_by_the_is_weights(model, monkeypatch):
    """--rollout_is: weights of 1 take the same steps as none; weights of 0.5 halve the first step's
    gradient (no KL or entropy term, no clipping of the norm: the loss is the policy loss alone)."""
    monkeypatch.setattr(train_grpo.dist, "get_world_size", lambda: 1)
    args = Args(
        rollout_n=2, train_batch_size=2, ppo_mini_batch_size=1, grad_clip=1e9, use_kl_loss=False
    )
    plain = update_actor_steps(model, args, ref=False)
    ones = update_actor_steps(model, args, ref=False, is_weights=torch.ones(4, 6))
    halves = update_actor_steps(model, args, ref=False, is_weights=torch.full((4, 6), 0.5))
    for name in plain[0][0]:
        torch.testing.assert_close(ones[0][0][name], plain[0][0][name], msg=name)
        torch.testing.assert_close(halves[0][0][name], 0.5 * plain[0][0][name], msg=name)
    assert ones[1]["actor/pg_loss"] == pytest.approx(plain[1]["actor/pg_loss"])


def update_actor_steps(model, args, ref=True, is_weights=None):
    """update_actor at a world size of one (the caller patches dist.get_world_size) on 2 prompts x n
    = 2 of fixed samples, old and reference log-probs (none if not `ref`: no KL loss) and
    advantages: the gradient at each optimizer step (GradRecorder) and the metrics."""
    samples = make_samples(LENGTHS, seed=3)
    with torch.no_grad():
        log_probs, _ = forward_log_probs(model, samples, 1.0, True, with_entropy=False)
    mask = passes.response_targets(samples, 6, "cpu")[1]
    g = torch.Generator().manual_seed(4)
    old_log_probs = (log_probs + 0.4 * (torch.rand(4, 6, generator=g) - 0.5)) * mask
    ref_log_probs = (log_probs + 0.3 * torch.randn(4, 6, generator=g)) * mask
    advantages = compute_grpo_outcome_advantage(torch.tensor([1.0, 0.0, 0.2, 0.7]), mask, n=2)
    recorder = GradRecorder(model)
    model.zero_grad(set_to_none=True)  # the trainer enters each update with no gradients
    metrics = train_grpo.update_actor(
        model,
        recorder,
        samples,
        old_log_probs,
        ref_log_probs if ref else None,
        advantages,
        mask,
        args,
        step=1,
        device=torch.device("cpu"),
        is_weights=is_weights,
    )
    return recorder.steps, metrics


def test_update_actor_logs_kl_loss_only_with_the_kl_term(model, monkeypatch):
    """Without --use_kl_loss the update gets no reference log-probs and logs no actor/kl_loss (as
    verl): a logged 0 would read as a policy that never left the reference."""
    monkeypatch.setattr(train_grpo.dist, "get_world_size", lambda: 1)
    args = Args(
        rollout_n=2, train_batch_size=2, ppo_mini_batch_size=1, grad_clip=1e9, kl_loss_coef=0.1
    )
    with_kl = update_actor_steps(model, args)[1]
    without = update_actor_steps(model, dataclasses.replace(args, use_kl_loss=False), ref=False)[1]
    assert with_kl["actor/kl_loss"] > 0
    assert set(with_kl) - set(without) == {"actor/kl_loss"} and set(without) <= set(with_kl)


def test_update_actor_gradient_does_not_depend_on_micro_batch_size(model, monkeypatch):
    # update_actor itself, at a world size of one: 2 prompts x n = 2 in mini-batches of 1 prompt (2
    # sequences)
    monkeypatch.setattr(train_grpo.dist, "get_world_size", lambda: 1)
    results = {}
    for micro in (1, 2):
        args = Args(
            rollout_n=2,
            train_batch_size=2,
            ppo_mini_batch_size=1,
            ppo_micro_batch_size_per_gpu=micro,
            kl_loss_coef=0.1,
            entropy_coeff=0.01,
            grad_clip=1e9,
            loss_agg_mode="seq-mean-token-mean",
        )
        results[micro] = update_actor_steps(model, args)
    (steps1, metrics1), (steps2, metrics2) = results[1], results[2]
    assert len(steps1) == len(steps2) == 2  # one optimizer step per mini-batch
    for a, b in zip(steps1, steps2):
        for name in a:
            torch.testing.assert_close(a[name], b[name], atol=1e-5, rtol=1e-5, msg=name)
    assert metrics1.keys() == metrics2.keys()
    for k in metrics1:
        # abs: ppo_kl sums log-ratios of both signs, so its float noise is large relative to the sum
        assert metrics1[k] == pytest.approx(metrics2[k], rel=1e-5, abs=1e-6), k
    assert metrics1["actor/grad_norm"] > 0 and metrics1["actor/kl_loss"] > 0


def test_update_actor_recomputes_with_gradient_checkpointing(model, monkeypatch):
    """--enable_gradient_checkpointing acts in the update: Hugging Face checkpoints only in train
    mode, and from_pretrained leaves a model in eval mode, so update_actor switches to train mode
    (and back). Each decoder layer then runs its forward again in the backward; the steps are the
    same."""
    monkeypatch.setattr(train_grpo.dist, "get_world_size", lambda: 1)
    args = Args(
        rollout_n=2,
        train_batch_size=2,
        ppo_mini_batch_size=1,
        ppo_micro_batch_size_per_gpu=1,
        kl_loss_coef=0.1,
        entropy_coeff=0.01,
        grad_clip=1e9,
    )
    calls = []
    hook = sharding.decoder_layers(model)[0].register_forward_pre_hook(lambda *_: calls.append(1))
    results = {}
    try:
        for checkpointing in (False, True):
            if checkpointing:
                model.gradient_checkpointing_enable(
                    gradient_checkpointing_kwargs={"use_reentrant": False}
                )
            model.eval()  # as from_pretrained returns it
            calls.clear()
            results[checkpointing] = update_actor_steps(model, args)[0], len(calls)
            assert not model.training  # eval again for the log-prob passes
    finally:
        hook.remove()
        model.gradient_checkpointing_disable()
    (plain, plain_calls), (recomputed, recomputed_calls) = results[False], results[True]
    # the helper's no-grad pass, then 2 mini-batches of 2 micro-batches, each forward once more in
    # the backward
    assert plain_calls == 1 + 4 and recomputed_calls == 1 + 4 + 4
    for a, b in zip(plain, recomputed):
        for name in a:
            torch.testing.assert_close(a[name], b[name], atol=1e-6, rtol=1e-6, msg=name)


def test_update_actor_with_fused_kernels_takes_the_same_steps(model, monkeypatch):
    """--use_fused_kernels reaches the update: every micro-batch's forward runs through
    ops.fused_log_probs, and the optimizer steps and metrics equal those without it (with an
    entropy bonus, so the entropy's gradient is taken through the chunks too)."""
    monkeypatch.setattr(train_grpo.dist, "get_world_size", lambda: 1)
    calls = []
    real = ops.fused_log_probs
    monkeypatch.setattr(ops, "fused_log_probs", lambda *a, **k: calls.append(1) or real(*a, **k))
    results = {}
    for fused in (False, True):
        args = Args(
            rollout_n=2,
            train_batch_size=2,
            ppo_mini_batch_size=1,
            ppo_micro_batch_size_per_gpu=1,
            kl_loss_coef=0.1,
            entropy_coeff=0.01,
            grad_clip=1e9,
            use_fused_kernels=fused,
        )
        results[fused] = update_actor_steps(model, args)
    # 4 micro-batches of one sequence, all with the fused head; none without the flag
    assert len(calls) == 4
    (steps, metrics), (fused_steps, fused_metrics) = results[False], results[True]
    for a, b in zip(steps, fused_steps):
        for name in a:
            torch.testing.assert_close(b[name], a[name], atol=1e-5, rtol=1e-5, msg=name)
    for k in metrics:
        assert fused_metrics[k] == pytest.approx(metrics[k], rel=1e-5, abs=1e-6), k


def test_a_last_partial_mini_batch_is_its_own_global_mean(model, monkeypatch):
    # 3 prompts x n = 2 = 6 sequences in mini-batches of 2 prompts: 4 + 2 sequences, micro-batches
    # of 3 (3 + 1, then 2). Each optimizer step must see the gradient of its own mini-batch alone.
    monkeypatch.setattr(train_grpo.dist, "get_world_size", lambda: 1)
    samples = make_samples(LENGTHS + [(4, 5), (6, 2)], seed=5)
    with torch.no_grad():
        log_probs, _ = forward_log_probs(model, samples, 1.0, True, with_entropy=False)
    mask = passes.response_targets(samples, 6, "cpu")[1]
    old_log_probs = log_probs + 0.1 * mask
    advantages = compute_grpo_outcome_advantage(
        torch.tensor([1.0, 0.0, 0.2, 0.7, 0.0, 1.0]), mask, n=2
    )

    def grads(rows, prompts, mini, micro):
        args = Args(
            rollout_n=2,
            train_batch_size=prompts,
            ppo_mini_batch_size=mini,
            ppo_micro_batch_size_per_gpu=micro,
            grad_clip=1e9,
            loss_agg_mode="seq-mean-token-mean",
        )
        recorder = GradRecorder(model)
        model.zero_grad(set_to_none=True)
        train_grpo.update_actor(
            model,
            recorder,
            [samples[i] for i in rows],
            old_log_probs[rows],
            None,
            advantages[rows],
            mask[rows],
            args,
            step=1,
            device=torch.device("cpu"),
        )
        return recorder.steps

    partial = grads(list(range(6)), 3, 2, 3)
    assert len(partial) == 2
    first, last = grads([0, 1, 2, 3], 2, 2, 4), grads([4, 5], 1, 1, 2)
    for got, want in ((partial[0], first[0]), (partial[1], last[0])):
        for name in want:
            torch.testing.assert_close(got[name], want[name], atol=1e-6, rtol=1e-5, msg=name)
