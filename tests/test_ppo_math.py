"""train_ppo.py's math against small examples worked out by hand, and its properties: GAE equals a
plain loop, padding never leaks in, whitening gives mean 0 / variance 1, the value clip picks the
right branch, the KL controllers follow Ziegler et al., micro-batching leaves the critic's gradient
unchanged, the fused head and the --rollout_is weights reach the actor's update. The value passes
and load_critic are tested in tests/test_sharding.py.

Shapes as in train_ppo.py: N sequences, T response tokens.
"""

import pytest
import torch

import batches
import ops
import passes
import train_ppo
from bench.tiny import tiny_config
from passes import forward_values
from tests.tiny_model import LENGTHS, GradRecorder, make_samples, tiny_critic
from train_ppo import (
    Args,
    adaptive_kl_coef,
    agg_loss,
    apply_kl_penalty,
    check_args,
    compute_gae_advantage_return,
    compute_value_loss,
    explained_variance,
)


def close(actual, expected, atol=1e-5):
    torch.testing.assert_close(
        torch.as_tensor(actual, dtype=torch.float32),
        torch.as_tensor(expected, dtype=torch.float32),
        atol=atol,
        rtol=0,
    )


# --- GAE -----------------------------------------------------------------------------------------


def test_gae_by_hand_gamma_lam_one():
    # r = [0, 0, 1], V = [0.5, 0.2, 0.3], gamma = lam = 1, V = 0 after the last token
    # t=2: delta = 1 + 0 - 0.3 = 0.7                 A2 = 0.7
    # t=1: delta = 0 + 0.3 - 0.2 = 0.1               A1 = 0.1 + 0.7 = 0.8
    # t=0: delta = 0 + 0.2 - 0.5 = -0.3              A0 = -0.3 + 0.8 = 0.5
    # (with gamma = lam = 1, A_t = sum of rewards from t on - V_t = 1 - V_t); returns = A + V = 1
    rewards, values, mask = (
        torch.tensor([[0.0, 0.0, 1.0]]),
        torch.tensor([[0.5, 0.2, 0.3]]),
        torch.ones(1, 3),
    )
    advantages, returns = compute_gae_advantage_return(
        rewards, values, mask, gamma=1.0, lam=1.0, whiten=False
    )
    close(advantages, [[0.5, 0.8, 0.7]])
    close(returns, [[1.0, 1.0, 1.0]])


def test_gae_by_hand_gamma_09_lam_095():
    # same r and V, gamma = 0.9, lam = 0.95, gamma * lam = 0.855
    # t=2: delta = 1 - 0.3 = 0.7                               A2 = 0.7
    # t=1: delta = 0 + 0.9 * 0.3 - 0.2 = 0.07                   A1 = 0.07 + 0.855 * 0.7 = 0.6685
    # t=0: delta = 0 + 0.9 * 0.2 - 0.5 = -0.32                  A0 = -0.32 + 0.855 * 0.6685
    #      = 0.2515675
    # returns = A + V = [0.7515675, 0.8685, 1.0]
    rewards, values, mask = (
        torch.tensor([[0.0, 0.0, 1.0]]),
        torch.tensor([[0.5, 0.2, 0.3]]),
        torch.ones(1, 3),
    )
    advantages, returns = compute_gae_advantage_return(
        rewards, values, mask, gamma=0.9, lam=0.95, whiten=False
    )
    close(advantages, [[0.2515675, 0.6685, 0.7]])
    close(returns, [[0.7515675, 0.8685, 1.0]])


def test_gae_ignores_whatever_the_padding_holds():
    # length 2 of T = 3: r = [0, 1], V = [0.4, 0.1]; t=1 is the last token, so V_2 counts as 0 even
    # though the padded slot holds V = 9 and r = 5.   A1 = 1 - 0.1 = 0.9,
    # A0 = (0 + 0.1 - 0.4) + 0.9 = 0.6
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    for pad_value, pad_reward in ((9.0, 5.0), (0.0, 0.0), (-3.0, 100.0)):
        advantages, returns = compute_gae_advantage_return(
            torch.tensor([[0.0, 1.0, pad_reward]]),
            torch.tensor([[0.4, 0.1, pad_value]]),
            mask,
            1.0,
            1.0,
            whiten=False,
        )
        close(advantages, [[0.6, 0.9, 0.0]])
        close(returns, [[1.0, 1.0, 0.0]])


def gae_loop(rewards, values, length, gamma, lam):
    """GAE of one sequence of `length` tokens, in plain Python (Schulman et al. 2016, eq. 16)."""
    advantages, next_adv = [0.0] * length, 0.0
    for t in reversed(range(length)):
        next_value = values[t + 1] if t + 1 < length else 0.0
        next_adv = rewards[t] + gamma * next_value - values[t] + gamma * lam * next_adv
        advantages[t] = next_adv
    return advantages


@pytest.mark.parametrize("gamma, lam", [(1.0, 1.0), (0.99, 0.95), (0.5, 0.0)])
def test_gae_equals_a_loop_on_ragged_random_input(gamma, lam):
    g = torch.Generator().manual_seed(0)
    lengths = [7, 1, 4, 0, 7, 3]  # an empty response too: all padding
    N, T = len(lengths), 7
    # garbage in padding too
    rewards, values = (
        torch.randn(N, T, generator=g),
        torch.randn(N, T, generator=g),
    )
    mask = torch.tensor([[1.0] * k + [0.0] * (T - k) for k in lengths])
    advantages, returns = compute_gae_advantage_return(
        rewards, values, mask, gamma, lam, whiten=False
    )
    for i, k in enumerate(lengths):
        expected = gae_loop(rewards[i].tolist(), values[i].tolist(), k, gamma, lam)
        close(advantages[i, :k], expected)
        close(returns[i, :k], [a + v for a, v in zip(expected, values[i, :k].tolist())])
        assert torch.equal(advantages[i, k:], torch.zeros(T - k)) and torch.equal(
            returns[i, k:], torch.zeros(T - k)
        )


def test_whitened_advantages_have_mean_0_var_1_over_valid_tokens():
    g = torch.Generator().manual_seed(1)
    lengths = [5, 2, 8, 3]
    mask = torch.tensor([[1.0] * k + [0.0] * (8 - k) for k in lengths])
    rewards, values = torch.randn(4, 8, generator=g) * 3 + 1, torch.randn(4, 8, generator=g)
    raw, returns = compute_gae_advantage_return(rewards, values, mask, 1.0, 0.95, whiten=False)
    white, white_returns = compute_gae_advantage_return(rewards, values, mask, 1.0, 0.95)
    valid = white[mask.bool()]
    close(valid.mean(), 0.0)
    close(valid.var(), 1.0, atol=1e-4)  # unbiased, as verl's masked_var
    assert torch.equal(white * (1 - mask), torch.zeros_like(white))  # zero on padding
    # a shift and a scale of the raw advantages; the returns are not whitened
    r = raw[mask.bool()]
    close(valid, (r - r.mean()) / torch.sqrt(r.var() + 1e-8))
    assert torch.equal(returns, white_returns)


# --- value loss ----------------------------------------------------------------------------------


def test_value_loss_clip_by_hand():
    # old values V = 1 everywhere, c = 0.5: vpredclipped = V + clip(vpred - V, -0.5, 0.5)
    # token 0: vpred 1.2 inside the range, clipped = 1.2; R = 2:  (1.2-2)^2 = 0.64 both
    #          -> 0.64
    # token 1: vpred 1.8 outside -> clipped 1.5; R = 2:  (1.8-2)^2 = 0.04 < (1.5-2)^2 = 0.25
    #          -> 0.25 (clipped)
    # token 2: vpred 1.8 outside -> clipped 1.5; R = 0:  (1.8-0)^2 = 3.24 > (1.5-0)^2 = 2.25
    #          -> 3.24 (unclipped)
    # token 3: vpred 0.9 inside; R = 1.2: (0.9-1.2)^2 = 0.09 both
    #          -> 0.09
    # token 4: padding (garbage everywhere)
    # vf_loss = 0.5 * (0.64 + 0.25 + 3.24 + 0.09) / 4 tokens = 0.5 * 4.22 / 4 = 0.5275
    vpreds = torch.tensor([[1.2, 1.8, 1.8, 0.9, 50.0]], requires_grad=True)
    values = torch.tensor([[1.0, 1.0, 1.0, 1.0, -7.0]])
    returns = torch.tensor([[2.0, 2.0, 0.0, 1.2, 30.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 1.0, 0.0]])
    vf_losses, stats = compute_value_loss(vpreds, values, returns, mask, 0.5)
    vf_loss = agg_loss(
        vf_losses, mask, "token-mean", num_tokens=4, num_seqs=1, max_response_length=5
    )
    close(vf_loss, 0.5275)
    assert stats["vf_clipfrac"].item() == 1  # token 1 only
    # gradient 0.5 * 2 * (vpred - R) / 4 on the unclipped branch, 0 where the clipped branch won
    # token 0: (1.2 - 2) / 4 = -0.2; token 1: 0; token 2: 1.8 / 4 = 0.45; token 3: (0.9 - 1.2) / 4
    # = -0.075
    vf_loss.backward()
    close(vpreds.grad, [[-0.2, 0.0, 0.45, -0.075, 0.0]])


def test_value_loss_is_global_over_micro_batches():
    # token-mean with the global count: two halves add up to the whole
    g = torch.Generator().manual_seed(2)
    vpreds, values, returns = (torch.randn(4, 3, generator=g) for _ in range(3))
    mask = torch.tensor([[1.0, 1, 1], [1, 0, 0], [1, 1, 0], [1, 1, 1]])
    agg = "token-mean", 9, 4, 3  # mode, num_tokens, num_seqs, max_response_length: the whole's

    def vf_loss(s):
        vf_losses, stats = compute_value_loss(vpreds[s], values[s], returns[s], mask[s], 0.2)
        return agg_loss(vf_losses, mask[s], *agg), stats

    whole, whole_stats = vf_loss(slice(0, 4))
    halves = [vf_loss(s) for s in (slice(0, 2), slice(2, 4))]
    close(sum(h[0] for h in halves), whole)
    assert sum(h[1]["vf_clipfrac"] for h in halves) == whole_stats["vf_clipfrac"]


def test_explained_variance_by_hand():
    # returns [1, 2, 3] (var 1), values [1, 2, 2]: residual [0, 0, 1], var = 1/3 -> 1 - (1/3) / (1
    # + 1e-5)
    returns, values = torch.tensor([[1.0, 2.0, 3.0, 50.0]]), torch.tensor([[1.0, 2.0, 2.0, -50.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0]])
    assert explained_variance(returns, values, mask) == pytest.approx(
        1 - (1 / 3) / (1 + 1e-5), rel=1e-6
    )
    assert explained_variance(returns, returns, mask) == pytest.approx(1.0)


# --- KL in the reward ----------------------------------------------------------------------------


def test_adaptive_kl_coef_by_hand():
    # kl 12, target 6: error = 12 / 6 - 1 = 1 -> clipped to 0.2; mult = 1 + 0.2 * 256 / 10000
    # = 1.00512
    beta = adaptive_kl_coef(0.001, 12.0, n_steps=256, target=6.0, horizon=10000)
    assert beta == pytest.approx(0.001 * 1.00512, rel=1e-12)
    # kl 6.6: error 0.1 (inside the clip) -> mult = 1 + 0.1 * 256 / 10000 = 1.00256
    beta = adaptive_kl_coef(0.001, 6.6, n_steps=256, target=6.0, horizon=10000)
    assert beta == pytest.approx(0.001 * 1.00256, rel=1e-9)
    # kl 0: error -1 -> -0.2; mult = 1 - 0.2 * 256 / 10000 = 0.99488; twice: 0.99488^2
    beta = adaptive_kl_coef(0.001, 0.0, n_steps=256, target=6.0, horizon=10000)
    beta = adaptive_kl_coef(beta, 0.0, n_steps=256, target=6.0, horizon=10000)
    assert beta == pytest.approx(0.001 * 0.99488**2, rel=1e-12)


def test_apply_kl_penalty_by_hand():
    # row 0: 3 tokens, score 1 on the last; row 1: 2 tokens, score 0.5 on t=1, t=2 is padding
    # (garbage) k1 = old - ref: row 0 [-1+1.5, -2+1, -0.5+0.5] = [0.5, -1, 0]; row 1 [-1+0.8,
    # -1+1.4] = [-0.2, 0.4] beta 0.1: rewards row 0 = [0 - 0.05, 0 + 0.1, 1 - 0] = [-0.05, 0.1, 1]
    #                   row 1 = [0 + 0.02, 0.5 - 0.04, 0] = [0.02, 0.46, 0]
    # current_kl: per-sequence means (0.5 - 1 + 0) / 3 = -1/6 and (-0.2 + 0.4) / 2 = 0.1, averaged:
    # -1/30
    scores = torch.tensor([[0.0, 0.0, 1.0], [0.0, 0.5, 0.0]])
    old = torch.tensor([[-1.0, -2.0, -0.5], [-1.0, -1.0, 7.0]])
    ref = torch.tensor([[-1.5, -1.0, -0.5], [-0.8, -1.4, -3.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    rewards, current_kl = apply_kl_penalty(scores, old, ref, mask, beta=0.1, kl_type="kl")
    close(rewards, [[-0.05, 0.1, 1.0], [0.02, 0.46, 0.0]])
    assert current_kl == pytest.approx(-1 / 30, rel=1e-6)
    # k3 is never negative: the reward only goes down
    rewards, current_kl = apply_kl_penalty(scores, old, ref, mask, beta=0.1, kl_type="low_var_kl")
    assert (rewards <= scores).all() and current_kl > 0


# --- config --------------------------------------------------------------------------------------


def test_defaults_reproduce_the_reference_run():
    args = Args()
    check_args(args, world_size=8)
    assert (args.actor_lr, args.critic_lr, args.kl_coef) == (1e-6, 1e-5, 0.001)
    assert args.use_kl_in_reward and not args.use_kl_loss and args.kl_ctrl_type == "fixed"
    assert (
        args.rollout_n,
        args.train_batch_size,
        args.max_prompt_length,
        args.max_response_length,
    ) == (1, 256, 512, 512)
    assert (
        args.ppo_mini_batch_size,
        args.ppo_micro_batch_size_per_gpu,
        args.critic_ppo_micro_batch_size_per_gpu,
        args.log_prob_micro_batch_size_per_gpu,
    ) == (64, 4, 4, 8)
    assert (args.save_freq, args.test_freq, args.total_epochs) == (10, 10, 15)
    # the engine's share (verl's quickstart: 0.4) is the memory planner's on a GPU (memory.py)
    assert args.gpu_memory_utilization is None
    assert not args.val_before_train
    assert (args.gamma, args.lam, args.cliprange_value) == (1.0, 1.0, 0.5)
    assert args.critic_model == args.model


def good_args(**kw):
    return Args(
        **{
            **dict(
                train_batch_size=8,
                rollout_n=1,
                ppo_mini_batch_size=4,
                ppo_micro_batch_size_per_gpu=2,
                critic_ppo_micro_batch_size_per_gpu=2,
                default_local_dir="/tmp/unused",
            ),
            **kw,
        }
    )


@pytest.mark.parametrize(
    "kw, flag",
    [
        (
            dict(ppo_mini_batch_size=16),
            "--ppo_mini_batch_size 16 must not exceed --train_batch_size 8",
        ),
        (dict(kl_ctrl_type="pid"), "--kl_ctrl_type"),
        (dict(kl_penalty="k4"), "--kl_penalty"),
        (
            dict(engines_per_gpu=2, rollout_engine="hf"),
            "--engines_per_gpu above 1 needs --rollout_engine vllm",
        ),
        (dict(rollout_is="seq"), "--rollout_is 'seq' must be token or sequence"),
        (
            dict(rollout_is="sequence", rollout_is_threshold=0.9),
            "--rollout_is_threshold 0.9 must be at least 1",
        ),
        (
            dict(use_kl_in_reward=False, kl_coef=0.01),
            "--kl_coef is set but --use_kl_in_reward is false",
        ),
        (dict(lr_scheduler_type="wsd"), "--lr_scheduler_type must be constant or cosine"),
        (
            dict(lr_decay_steps_ratio=0.5),
            "shape the cosine schedule: add --lr_scheduler_type cosine",
        ),
    ],
)
def test_check_args_names_the_flag(kw, flag):
    with pytest.raises(SystemExit, match=flag):
        check_args(good_args(**kw), world_size=2)


def test_check_args_allows_one_sample_per_prompt_and_fills_the_critic():
    args = good_args(rollout_n=1, model="some/model")
    check_args(args, world_size=2)
    assert args.critic_model == "some/model"
    args = good_args(rollout_n=4, critic_model="other/model")
    check_args(args, world_size=2)
    assert args.critic_model == "other/model"


# --- the value model on a tiny body --------------------------------------------------------------


@pytest.fixture(scope="module")
def critic():
    return tiny_critic()


def test_update_critic_gradient_does_not_depend_on_micro_batch_size(critic, monkeypatch):
    monkeypatch.setattr(train_ppo.dist, "get_world_size", lambda: 1)
    samples = make_samples(LENGTHS, seed=3)
    mask = passes.response_targets(samples, 6, "cpu")[1]
    g = torch.Generator().manual_seed(4)
    with torch.no_grad():
        values = forward_values(critic, samples, True) + 0.3 * torch.randn(4, 6, generator=g) * mask
    returns = torch.randn(4, 6, generator=g) * mask
    results = {}
    for micro in (1, 2):
        args = Args(
            rollout_n=1,
            train_batch_size=4,
            ppo_mini_batch_size=2,
            critic_ppo_micro_batch_size_per_gpu=micro,
            critic_grad_clip=1e9,
            cliprange_value=0.2,
            loss_agg_mode="token-mean",
        )
        recorder = GradRecorder(critic)
        critic.zero_grad(set_to_none=True)
        metrics = train_ppo.update_critic(
            critic,
            recorder,
            samples,
            values,
            returns,
            mask,
            args,
            step=1,
            device=torch.device("cpu"),
        )
        results[micro] = recorder.steps, metrics
    (steps1, metrics1), (steps2, metrics2) = results[1], results[2]
    assert len(steps1) == len(steps2) == 2  # one optimizer step per mini-batch of 2 sequences
    for a, b in zip(steps1, steps2):
        for name in a:
            torch.testing.assert_close(a[name], b[name], atol=1e-5, rtol=1e-5, msg=name)
    for k in metrics1:
        assert metrics1[k] == pytest.approx(metrics2[k], rel=1e-5, abs=1e-6), k
    assert metrics1["critic/grad_norm"] > 0 and metrics1["critic/vf_clipfrac"] > 0


def test_update_actor_with_fused_kernels_takes_the_same_steps(monkeypatch):
    """--use_fused_kernels reaches the actor's update: every micro-batch's forward runs through
    ops.fused_log_probs, and the optimizer steps and metrics equal those without it."""
    from transformers import AutoModelForCausalLM

    monkeypatch.setattr(train_ppo.dist, "get_world_size", lambda: 1)
    torch.manual_seed(0)
    actor = AutoModelForCausalLM.from_config(
        tiny_config(tie=False), dtype=torch.float32, attn_implementation=ops.PACKED_ATTENTION
    )
    samples = make_samples(LENGTHS, seed=3)
    with torch.no_grad():
        log_probs, _ = passes.forward_log_probs(actor, samples, 1.0, True, with_entropy=False)
    mask = passes.response_targets(samples, 6, "cpu")[1]
    g = torch.Generator().manual_seed(4)
    old_log_probs = (log_probs + 0.4 * (torch.rand(4, 6, generator=g) - 0.5)) * mask
    advantages = torch.randn(4, 6, generator=g) * mask
    calls = []
    real = ops.fused_log_probs
    monkeypatch.setattr(ops, "fused_log_probs", lambda *a, **k: calls.append(1) or real(*a, **k))
    results = {}
    for fused in (False, True):
        args = Args(
            rollout_n=1,
            train_batch_size=4,
            ppo_mini_batch_size=2,
            ppo_micro_batch_size_per_gpu=1,
            entropy_coeff=0.01,
            grad_clip=1e9,
            use_fused_kernels=fused,
        )
        recorder = GradRecorder(actor)
        actor.zero_grad(set_to_none=True)
        metrics = train_ppo.update_actor(
            actor,
            recorder,
            samples,
            old_log_probs,
            None,
            advantages,
            mask,
            args,
            step=1,
            device=torch.device("cpu"),
        )
        results[fused] = recorder.steps, metrics
    # 4 micro-batches of one sequence, all with the fused head; none without the flag
    assert len(calls) == 4
    (steps, metrics), (fused_steps, fused_metrics) = results[False], results[True]
    assert len(steps) == len(fused_steps) == 2
    for a, b in zip(steps, fused_steps):
        for name in a:
            torch.testing.assert_close(b[name], a[name], atol=1e-5, rtol=1e-5, msg=name)
    for k in metrics:
        assert fused_metrics[k] == pytest.approx(metrics[k], rel=1e-5, abs=1e-6), k


def test_rollout_is_weights_and_the_weighted_policy_loss_by_hand():
    # pi_old / pi_rollout = 0.5 / 0.25 = 2 (truncated at 1.5) and 0.2 / 0.4 = 0.5; the third token
    # is padding. Policy loss at ratio 1 (log_probs = old): -A per token; weighted: -1.5 * 1 and
    # -0.5 * -2 = 1
    old = torch.log(torch.tensor([[0.5, 0.2, 0.9]]))
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    weights, _ = batches.rollout_is_weights(
        old, torch.log(torch.tensor([[0.25, 0.4, 0.01]])), mask, "token", 1.5
    )
    close(weights, [[1.5, 0.5, 0.0]])
    pg_losses, _ = train_ppo.compute_policy_loss(
        old, old, torch.tensor([[1.0, -2.0, 0.0]]), mask, 0.2, 0.2, 3.0, weights
    )
    close(pg_losses, [[-1.5, 1.0, 0.0]])
