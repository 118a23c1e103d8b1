"""train_grpo.py's math against small examples worked out by hand, and its properties: masked positions
never change a result, micro-batching leaves the gradient unchanged, packed equals padded.

Shapes as in train_grpo.py: N sequences (B prompts x n samples), T response tokens, V vocabulary.
"""

import dataclasses
import math
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch
from transformers import AutoModelForCausalLM

import sharding
import train_grpo
import train_ppo
from train_grpo import (
    Args,
    PromptOrder,
    agg_loss,
    batch_order,
    check_args,
    compute_grpo_outcome_advantage,
    compute_policy_loss,
    entropy_from_logits,
    epoch_order,
    flops_per_token,
    forward_log_probs,
    kl_penalty,
    lr_lambda,
    rollout_is_metrics,
    rollout_is_weights,
    token_log_probs,
)
from tests.tiny_model import LENGTHS, GradRecorder, free_port, make_samples, tiny_config

MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm")


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def close(actual, expected, atol=1e-4, rtol=0.0):
    torch.testing.assert_close(torch.as_tensor(actual, dtype=torch.float32),
                               torch.as_tensor(expected, dtype=torch.float32), atol=atol, rtol=rtol)


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
    close(adv[:, 0], [(2 / 3) / (std + 1e-6), (-1 / 3) / (std + 1e-6), (-1 / 3) / (std + 1e-6)], atol=1e-6)
    assert adv[0, 0] < (2 / 3) / std  # eps pulls the magnitude down, never up


def test_dr_grpo_advantage_is_not_divided_by_std():
    # Dr.GRPO: A = r - mean = [1 - 1/3, 0 - 1/3, 0 - 1/3] = [0.6667, -0.3333, -0.3333]
    adv = compute_grpo_outcome_advantage(torch.tensor([1.0, 0.0, 0.0]), torch.ones(3, 1), n=3,
                                         norm_adv_by_std=False)
    close(adv[:, 0], [2 / 3, -1 / 3, -1 / 3], atol=1e-6)


def test_groups_are_consecutive_rows_and_equal_scores_give_zero():
    # two groups of n = 2: [3, 1] -> mean 2, std = sqrt(((1)^2 + (-1)^2) / 1) = 1.4142, A = [0.7071, -0.7071]
    #                      [5, 5] -> all equal: mean 5, std 0, A = 0 / (0 + eps) = 0 (no signal, no nan)
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


# --- policy loss ---------------------------------------------------------------------------------


def policy_loss(log_ratio, adv, mask=None, low=0.2, high=0.2, c=3.0):
    log_ratio = torch.tensor([log_ratio], dtype=torch.float)  # (1, T)
    adv = torch.tensor([adv], dtype=torch.float)
    mask = torch.ones_like(adv) if mask is None else torch.tensor([mask], dtype=torch.float)
    old = torch.full_like(adv, -2.0)
    return compute_policy_loss(old, old + log_ratio, adv, mask, low, high, c)


def test_policy_loss_clip_and_dual_clip_by_hand():
    # token 0: A = +1, ratio = e^0.2 = 1.2214 -> clipped to 1.2; min(1.2214, 1.2) = 1.2    -> loss -1.2, clipped
    # token 1: A = +1, ratio = e^-0.5 = 0.6065 -> clipped to 0.8; min(0.6065, 0.8) = 0.6065 -> loss -0.6065
    #          (clipping only binds when it lowers the objective)
    # token 2: A = -1, ratio = 5 -> clipped 1.2; min(-5, -1.2) = -5; dual-clip max(-5, c*A = -3) = -3 -> loss 3
    #          (not counted in pg_clipfrac: the clipped term -1.2 is not the smaller one; in pg_clipfrac_lower)
    # token 3: A = -1, ratio = 0.5 -> clipped 0.8; min(-0.5, -0.8) = -0.8; max(-0.8, -3) = -0.8 -> loss 0.8, clipped
    # token 4: A = -2, ratio = 2 -> clipped 1.2; min(-4, -2.4) = -4; max(-4, 3 * -2 = -6) = -4  -> loss 4
    #          (ratio 2 < c = 3: the dual clip does not bind)
    log_ratio = [0.2, -0.5, math.log(5), math.log(0.5), math.log(2)]
    pg_losses, stats = policy_loss(log_ratio, [1, 1, -1, -1, -2])
    close(pg_losses, [[-1.2, -0.60653, 3.0, 0.8, 4.0]])
    assert stats["pg_clipfrac"].item() == 2  # tokens 0 and 3
    assert stats["pg_clipfrac_lower"].item() == 1  # token 2
    # ppo_kl sums -log_ratio = -(0.2 - 0.5 + 1.6094 - 0.6931 + 0.6931) = -1.3094
    close(stats["ppo_kl"], -1.30944)


def test_dual_clip_caps_huge_ratio_at_c_times_advantage():
    # A = -0.5, ratio = e^20 (log ratio 30 clamped to 20): the loss is capped at -c * A = 3 * 0.5 = 1.5
    pg_losses, stats = policy_loss([30.0], [-0.5])
    close(pg_losses, [[1.5]])
    assert stats["pg_clipfrac_lower"].item() == 1
    # the same with c = 10: cap 10 * 0.5 = 5
    close(policy_loss([30.0], [-0.5], c=10.0)[0], [[5.0]])


def test_clip_higher_uses_asymmetric_bounds():
    # DAPO: eps_low 0.2, eps_high 0.28
    # A = +1, ratio = e^0.25 = 1.2840 -> clipped at 1 + 0.28 = 1.28 -> loss -1.28 (with eps_high 0.2: -1.2)
    # A = -1, ratio = e^-0.3 = 0.7408 -> clipped at 1 - 0.2 = 0.8, min(-0.7408, -0.8) = -0.8 -> loss 0.8
    pg_losses, stats = policy_loss([0.25, -0.3], [1, -1], high=0.28)
    close(pg_losses, [[-1.28, 0.8]])
    assert stats["pg_clipfrac"].item() == 2
    close(policy_loss([0.25, -0.3], [1, -1], high=0.2)[0], [[-1.2, 0.8]])
    # a ratio inside the wider band is not clipped: e^0.23 = 1.2586 < 1.28 -> loss -1.2586
    pg_losses, stats = policy_loss([0.23], [1], high=0.28)
    close(pg_losses, [[-1.25860]])
    assert stats["pg_clipfrac"].item() == 0


def test_policy_loss_stats_ignore_masked_tokens():
    # token 1 is padding with garbage that would count as clipped, dual-clipped and in ppo_kl
    clean, clean_stats = policy_loss([0.2, 0.0], [1, 0], mask=[1, 0])
    dirty, dirty_stats = policy_loss([0.2, 15.0], [1, -7], mask=[1, 0])
    assert {k: v.item() for k, v in clean_stats.items()} == {k: v.item() for k, v in dirty_stats.items()}
    assert clean_stats["pg_clipfrac"].item() == 1 and clean_stats["pg_clipfrac_lower"].item() == 0
    close(clean_stats["ppo_kl"], -0.2)
    mask = torch.tensor([[1.0, 0.0]])
    for mode in MODES:
        assert agg_loss(clean, mask, mode, 1, 1, 2) == agg_loss(dirty, mask, mode, 1, 1, 2)


# --- truncated importance sampling (--rollout_is) -------------------------------------------------


def test_rollout_is_weights_by_hand():
    # row 0: pi_old / pi_rollout = 0.5 / 0.25 = 2 and 0.2 / 0.4 = 0.5; its third token is padding (garbage)
    # row 1: 0.6 / 0.3 = 2 and 0.6 / 0.4 = 1.5; no padding
    log = torch.log
    old = log(torch.tensor([[0.5, 0.2, 0.9], [0.6, 0.6, 0.1]]))
    rollout = log(torch.tensor([[0.25, 0.4, 0.01], [0.3, 0.4, 0.1]]))
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
    # token level, truncated at 1.5: min(2, 1.5) = 1.5, 0.5, padding 0; 1.5, 1.5, 1
    weights, rho = rollout_is_weights(old, rollout, mask, "token", 1.5)
    close(weights, [[1.5, 0.5, 0.0], [1.5, 1.5, 1.0]])
    close(rho, [[2.0, 0.5, 0.0], [2.0, 1.5, 1.0]])
    # sequence level: row 0's product 2 * 0.5 = 1 (the padding's ratio 90 left out); row 1's 2 * 1.5 * 1 = 3,
    # truncated at 2; the same weight on every token of a response
    weights, rho = rollout_is_weights(old, rollout, mask, "sequence", 2.0)
    close(weights, [[1.0, 1.0, 0.0], [2.0, 2.0, 2.0]])
    close(rho, [[1.0, 1.0, 0.0], [3.0, 3.0, 3.0]])
    assert not weights.requires_grad


def test_rollout_is_weights_stay_finite_and_name_the_flag():
    # log rho = 50 would overflow in fp32 after exp(); clamped to 20 first, then truncated
    weights, rho = rollout_is_weights(torch.tensor([[0.0, -60.0]]), torch.tensor([[-50.0, 0.0]]),
                                      torch.ones(1, 2), "token", 2.0)
    close(weights, [[2.0, math.exp(-20)]])
    assert torch.isfinite(rho).all() and rho[0, 0].item() == pytest.approx(math.exp(20), rel=1e-5)
    with pytest.raises(ValueError, match="--rollout_is 'geometric' is not one of token, sequence"):
        rollout_is_weights(torch.zeros(1, 1), torch.zeros(1, 1), torch.ones(1, 1), "geometric", 2.0)


def test_rollout_is_metrics_by_hand():
    # weights (after truncation at 1.5) on the 5 unmasked tokens: 1.5, 0.5, 1.5, 1.5, 1.0 -> mean 6 / 5 = 1.2;
    # 3 of the 5 had rho above 1.5 (2, 2, 1.6: the 1.5 on row 1 was truncated from 1.6)
    weights = torch.tensor([[1.5, 0.5, 0.0], [1.5, 1.5, 1.0]])
    rho = torch.tensor([[2.0, 0.5, 7.0], [2.0, 1.6, 1.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
    m = rollout_is_metrics(weights, rho, mask, 1.5, "cpu")
    assert m == pytest.approx({"rollout_corr/rollout_is_mean": 1.2, "rollout_corr/rollout_is_min": 0.5,
                               "rollout_corr/rollout_is_max": 1.5,
                               "rollout_corr/rollout_is_ratio_fraction_high": 0.6})


def test_policy_loss_with_is_weights_scales_each_tokens_loss():
    # the tokens of test_policy_loss_clip_and_dual_clip_by_hand, weighted 2, 0.5, 1, 0, 1.5: each loss times
    # its weight; the clipping and its statistics are those of the ratio alone
    log_ratio = [0.2, -0.5, math.log(5), math.log(0.5), math.log(2)]
    adv = torch.tensor([[1.0, 1, -1, -1, -2]])
    old = torch.full_like(adv, -2.0)
    mask = torch.ones_like(adv)
    weights = torch.tensor([[2.0, 0.5, 1.0, 0.0, 1.5]])
    pg_losses, stats = compute_policy_loss(old, old + torch.tensor([log_ratio]), adv, mask, 0.2, 0.2, 3.0, weights)
    close(pg_losses, [[-2.4, -0.303265, 3.0, 0.0, 6.0]])
    plain_stats = compute_policy_loss(old, old + torch.tensor([log_ratio]), adv, mask, 0.2, 0.2, 3.0)[1]
    assert {k: v.item() for k, v in stats.items()} == {k: v.item() for k, v in plain_stats.items()}


# --- KL ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kl_type, expected", [
    # log r = log pi - log pi_ref = [0.5, -0.5, 0]
    ("k1", [0.5, -0.5, 0.0]),  # log r
    ("abs", [0.5, 0.5, 0.0]),  # |log r|
    ("k2", [0.125, 0.125, 0.0]),  # (log r)^2 / 2 = 0.25 / 2
    ("mse", [0.125, 0.125, 0.0]),
    # k3: r' = pi_ref / pi = e^-log r; r' - 1 - log r'
    #   log r = 0.5:  e^-0.5 - 1 + 0.5 = 0.60653 - 0.5 = 0.10653
    #   log r = -0.5: e^0.5 - 1 - 0.5 = 1.64872 - 1.5 = 0.14872
    ("k3", [0.10653, 0.14872, 0.0]),
    ("low_var_kl", [0.10653, 0.14872, 0.0]),
])
def test_kl_estimators_by_hand(kl_type, expected):
    log_probs = torch.tensor([-1.0, -2.0, -0.3])
    ref_log_probs = torch.tensor([-1.5, -1.5, -0.3])
    close(kl_penalty(log_probs, ref_log_probs, kl_type), expected, atol=1e-5)


def test_k3_is_clamped_and_never_negative():
    # log r = -20: r' = e^20, r' - 1 - 20 = 4.85e8 -> clamped to 10
    # log r = +30: -log r clamped to -20 first: e^-20 - 1 + 20 = 19.0 -> clamped to 10
    close(kl_penalty(torch.tensor([-20.0, 30.0]), torch.zeros(2), "low_var_kl"), [10.0, 10.0])
    log_ratio = torch.linspace(-8, 8, 101)
    assert (kl_penalty(log_ratio, torch.zeros(101), "k3") >= 0).all()
    with pytest.raises(ValueError, match="--kl_loss_type"):
        kl_penalty(torch.zeros(1), torch.zeros(1), "k4")


# --- aggregation ---------------------------------------------------------------------------------


# loss_mat (N=2, T=3) = [[1, 2, 3], [4, 5, 6]], response_mask = [[1, 1, 0], [1, 0, 0]]
# masked = [[1, 2, 0], [4, 0, 0]], total 7, 3 tokens, per-sequence sums [3, 4], lengths [2, 1]
LOSS_MAT = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
MASK = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])


@pytest.mark.parametrize("mode, local, global_", [
    # token-mean: 7 / 3 tokens = 2.3333; global: another micro-batch holds 3 more tokens -> 7 / 6 = 1.1667
    ("token-mean", 7 / 3, 7 / 6),
    # seq-mean-token-sum: (3 + 4) / 2 seqs = 3.5; with 4 seqs in the mini-batch 7 / 4 = 1.75
    ("seq-mean-token-sum", 3.5, 1.75),
    # seq-mean-token-mean: (3/2 + 4/1) / 2 = 5.5 / 2 = 2.75; global 5.5 / 4 = 1.375
    ("seq-mean-token-mean", 2.75, 1.375),
    # seq-mean-token-sum-norm (Dr.GRPO): 7 / (2 seqs * max_response_length 4) = 0.875; global 7 / 16 = 0.4375
    ("seq-mean-token-sum-norm", 0.875, 0.4375),
])
def test_agg_loss_by_hand(mode, local, global_):
    close(agg_loss(LOSS_MAT, MASK, mode, num_tokens=3, num_seqs=2, max_response_length=4), local, atol=1e-6)
    close(agg_loss(LOSS_MAT, MASK, mode, num_tokens=6, num_seqs=4, max_response_length=4), global_, atol=1e-6)
    garbage = torch.where(MASK.bool(), LOSS_MAT, torch.tensor(1e6))
    assert agg_loss(garbage, MASK, mode, 3, 2, 4) == agg_loss(LOSS_MAT, MASK, mode, 3, 2, 4)


@pytest.mark.parametrize("mode", MODES)
def test_agg_loss_with_global_denominators_adds_up_over_micro_batches(mode):
    # a mini-batch of 5 rows split 2 + 3: the two partial losses sum to the whole mini-batch's loss
    g = torch.Generator().manual_seed(0)
    loss_mat = torch.randn(5, 4, generator=g)
    mask = (torch.arange(4) < torch.tensor([[4], [1], [3], [0], [2]])).float()  # lengths 4, 1, 3, 0, 2
    kw = dict(mode=mode, num_tokens=mask.sum(), num_seqs=5, max_response_length=4)
    whole = agg_loss(loss_mat, mask, **kw)
    parts = agg_loss(loss_mat[:2], mask[:2], **kw) + agg_loss(loss_mat[2:], mask[2:], **kw)
    close(parts, whole, atol=1e-6)


def test_agg_loss_names_the_flag_on_a_bad_mode():
    with pytest.raises(ValueError, match="--loss_agg_mode 'token-sum'"):
        agg_loss(LOSS_MAT, MASK, "token-sum", 3, 2, 4)


# --- entropy, flops, data order, schedule ---------------------------------------------------------


def test_entropy_from_logits():
    # uniform over V = 8: H = log 8 = 2.0794
    close(entropy_from_logits(torch.zeros(8)), math.log(8), atol=1e-6)
    # p = [1/4, 3/4] from logits [0, log 3]: H = 0.25 * 1.3863 + 0.75 * 0.28768 = 0.34657 + 0.21576 = 0.56233
    close(entropy_from_logits(torch.tensor([0.0, math.log(3)])), 0.56233, atol=1e-5)
    # one-hot-ish: [100, 0, 0, 0] -> p_other = e^-100: H ~ 0
    close(entropy_from_logits(torch.tensor([100.0, 0, 0, 0])), 0.0, atol=1e-6)
    # per position over a batch: (2, 3, V) -> (2, 3); adding a constant to the logits changes nothing
    logits = torch.randn(2, 3, 11, generator=torch.Generator().manual_seed(0))
    h = entropy_from_logits(logits)
    assert h.shape == (2, 3)
    close(entropy_from_logits(logits + 50.0), h, atol=1e-4)


def test_flops_per_token_by_hand():
    # tiny config: h = 128, L = 2, V = 320, 4 heads and 2 kv heads of head_dim 32, intermediate 256
    # q = 4 * 32 = 128, kv = 2 * 32 = 64
    # per layer: q,k,v proj h*(q + 2kv) = 128 * 256 = 32768; o proj q*h = 16384; mlp 3*h*I = 98304 -> 147456
    # 2 * (L * 147456 + V * h) = 2 * (294912 + 40960) = 671744
    # attention at seq_len 100: 2 * L * seq_len * q = 2 * 2 * 100 * 128 = 51200 -> 722944
    assert flops_per_token(tiny_config(tie=True), 0) == 671744
    assert flops_per_token(tiny_config(tie=True), 100) == 722944
    # tied and untied count the lm_head once and the embedding lookup never
    assert flops_per_token(tiny_config(tie=False), 100) == 722944
    # = 2 x the matrix parameters a token passes through (the tied model holds the V x h matrix once)
    model = AutoModelForCausalLM.from_config(tiny_config(tie=True))
    assert flops_per_token(model.config, 0) == 2 * sum(p.numel() for p in model.parameters() if p.dim() == 2)


def test_phase_perf_by_hand():
    # tiny config at seq_len 100: 722944 FLOPs per token forward, of which the lm_head is 2 * V * h = 81920
    # 1000 tokens, 400 of them response tokens: 1000 * (722944 - 81920) + 400 * 81920 = 673792000
    t = {"timing_s/old_log_prob": 2.0, "timing_s/update_actor": 3.0, "timing_s/update_weights": 0.5}
    perf = train_grpo.phase_perf(t, tiny_config(tie=True), 100, 1000, 400, 1e9, 2, 4e9)
    assert perf["perf/tflops/old_log_prob"] == pytest.approx(673792000 / 2.0 / 1e12)
    assert perf["perf/mfu/old_log_prob"] == pytest.approx(673792000 / 2.0 / 1e9)
    assert perf["perf/mfu/actor"] == pytest.approx(3 * 2 * 673792000 / 3.0 / 1e9)  # 3 passes x 2 epochs
    assert "perf/mfu/ref" not in perf  # no reference phase ran
    assert perf["perf/weight_sync_gb_s"] == pytest.approx(8.0) and perf["perf/peak_tflops"] == 1e-3


def test_batch_order_is_seeded_and_drops_the_last_partial_batch():
    order = batch_order(10, 4, epoch=0, seed=1)  # 10 prompts in batches of 4: 2 batches, 2 prompts dropped
    assert [len(b) for b in order] == [4, 4]
    flat = [i for b in order for i in b]
    assert len(set(flat)) == 8 and all(0 <= i < 10 for i in flat)
    assert batch_order(10, 4, epoch=0, seed=1) == order  # a resumed run replays the same order
    assert batch_order(10, 4, epoch=1, seed=1) != order  # a new shuffle per epoch
    assert batch_order(10, 4, epoch=0, seed=2) != order
    assert batch_order(8, 4, 0, 1) and len(batch_order(8, 4, 0, 1)) == 2  # exact fit keeps every batch
    assert batch_order(3, 4, 0, 1) == []


def test_prompt_order_moves_past_what_rounds_use_and_drops_an_epochs_short_rest():
    perm0, perm1 = epoch_order(10, 0, seed=1), epoch_order(10, 1, seed=1)
    assert sorted(perm0) == list(range(10)) and perm1 != perm0 and epoch_order(10, 0, seed=1) == perm0
    order = PromptOrder(10, seed=1)
    assert order.peek(4) == perm0[:4]
    order.advance(4)
    assert order.peek(4) == perm0[4:8]
    order.advance(3)  # a round that generated 3 of the 4 prompts it looked at: the 4th comes next
    assert order.peek(4) == perm1[:4] and (order.epoch, order.offset) == (1, 0)  # 3 left < 4: dropped
    order.advance(2)
    assert PromptOrder(10, seed=1, epoch=1, offset=2).peek(3) == order.peek(3) == perm1[2:5]  # a resume
    # rounds that each use a whole batch take batch_order's batches
    whole, taken = PromptOrder(10, seed=1), []
    for _ in range(4):
        taken.append(whole.peek(4))
        whole.advance(4)
    assert taken == batch_order(10, 4, 0, 1) + batch_order(10, 4, 1, 1)


def test_lr_lambda_warmup_then_cosine():
    # warmup 2 of 6 steps: (step + 1) / 2 -> 0.5, 1.0
    # cosine after: 0.5 * (1 + cos(pi * (step - 2) / 4)) -> step 2: 1.0, 3: 0.85355, 4: 0.5, 5: 0.14645
    f = lr_lambda(Args(lr_warmup_steps=2, lr_scheduler_type="cosine"), total_steps=6)
    close([f(s) for s in range(6)], [0.5, 1.0, 1.0, 0.85355, 0.5, 0.14645], atol=1e-5)
    f = lr_lambda(Args(lr_warmup_steps=2, lr_scheduler_type="constant"), total_steps=6)
    assert [f(s) for s in range(6)] == [0.5, 1.0, 1.0, 1.0, 1.0, 1.0]
    # ratio 0.5 of 4 steps -> 2 warmup steps; -1 means "use the ratio"
    f = lr_lambda(Args(lr_warmup_steps=-1, lr_warmup_steps_ratio=0.5), total_steps=4)
    assert [f(s) for s in range(4)] == [0.5, 1.0, 1.0, 1.0]
    assert lr_lambda(Args(), total_steps=4)(0) == 1.0  # default: no warmup, constant


def test_lr_lambda_warmup_stable_decay():
    # 10 steps, the last 0.3 decay: held at 1 for steps 0-6, then over steps 7-9 a cosine from 1 towards 0.1:
    # 0.1 + 0.9 * 0.5 * (1 + cos(pi * k / 3)) for k = 0, 1, 2 -> 1.0, 0.775, 0.325
    f = lr_lambda(Args(lr_scheduler_type="cosine", min_lr_ratio=0.1, lr_decay_steps_ratio=0.3), total_steps=10)
    close([f(s) for s in range(10)], [1.0] * 7 + [1.0, 0.775, 0.325], atol=1e-6)
    # with warmup 2 of 6 and the whole rest decaying to 0.5: 0.5 + 0.5 * 0.5 * (1 + cos(pi * k / 4)), k = 0..3
    f = lr_lambda(Args(lr_warmup_steps=2, lr_scheduler_type="cosine", min_lr_ratio=0.5), total_steps=6)
    close([f(s) for s in range(6)], [0.5, 1.0, 1.0, 0.92678, 0.75, 0.57322], atol=1e-5)
    # a decay longer than what follows the warmup starts at the warmup's end: 0.9 of 6 steps -> from step 2
    f = lr_lambda(Args(lr_warmup_steps=2, lr_scheduler_type="cosine", lr_decay_steps_ratio=0.9), total_steps=6)
    close([f(s) for s in range(6)], [0.5, 1.0, 1.0, 0.85355, 0.5, 0.14645], atol=1e-5)
    # the PPO script's copy agrees
    kw = dict(lr_warmup_steps=1, lr_scheduler_type="cosine", min_lr_ratio=0.2, lr_decay_steps_ratio=0.5)
    grpo, ppo = lr_lambda(Args(**kw), total_steps=9), train_ppo.lr_lambda(train_ppo.Args(**kw), total_steps=9)
    assert [grpo(s) for s in range(9)] == [ppo(s) for s in range(9)]


# --- start-up checks -----------------------------------------------------------------------------


def good_args(**kw):
    return Args(**{**dict(train_batch_size=8, rollout_n=2, ppo_mini_batch_size=4, ppo_micro_batch_size_per_gpu=2,
                          default_local_dir="/tmp/unused"), **kw})


def test_check_args_accepts_the_qwen3_tutorial_shape():
    # 1024 prompts in mini-batches of 80 (the last one 64), micro-batches of 20: verl runs it as is
    check_args(good_args(train_batch_size=1024, rollout_n=3, ppo_mini_batch_size=80, ppo_micro_batch_size_per_gpu=20),
               world_size=1)


def test_check_args_accepts_a_good_config_and_fills_defaults():
    args = good_args()
    check_args(args, world_size=2)
    assert args.kl_loss_coef == 0.001 and args.kl_coef == 0.001


@pytest.mark.parametrize("kw, world, flag", [
    (dict(rollout_n=1), 2, "--rollout_n"),
    (dict(train_batch_size=6), 4, "--train_batch_size 6 must be divisible by the number of GPUs 4"),
    (dict(ppo_mini_batch_size=16), 2, "--ppo_mini_batch_size 16 must not exceed --train_batch_size 8"),
    (dict(ppo_mini_batch_size=3, rollout_n=3), 2, "--ppo_mini_batch_size x --rollout_n"),
    (dict(use_kl_loss=False, kl_loss_coef=0.01), 2, "--kl_loss_coef is set but --use_kl_loss is false"),
    (dict(kl_coef=0.01), 2, "--kl_coef is set but --use_kl_in_reward is false"),
    (dict(rollout_engine="sglang"), 2, "--rollout_engine"),
    (dict(engines_per_gpu=0), 2, "--engines_per_gpu 0 must be at least 1"),
    (dict(engines_per_gpu=2, rollout_engine="hf"), 2, "--engines_per_gpu above 1 needs --rollout_engine vllm"),
    (dict(engines_per_gpu=2, tensor_model_parallel_size=2), 2, "and --tensor_model_parallel_size 1"),
    (dict(resume_mode="/no/such/global_step_3"), 2, "--resume_mode"),
    (dict(rollout_is="geometric"), 2, "--rollout_is 'geometric' must be token or sequence"),
    (dict(rollout_is="token", rollout_is_threshold=0.5), 2, "--rollout_is_threshold 0.5 must be at least 1"),
    (dict(gen_batch_size=16), 2, "--gen_batch_size only applies with --filter_groups"),
    (dict(gen_batch_size=6, filter_groups=True), 4, "--gen_batch_size 6 must be 0 or a multiple of the number of GPUs"),
    (dict(gen_batch_size=-8, filter_groups=True), 2, "--gen_batch_size -8 must be 0 or a multiple"),
    (dict(filter_groups_from_step=8), 2, "--filter_groups_from_step only applies with --filter_groups"),
    (dict(filter_groups_from_step=0, filter_groups=True), 2, "--filter_groups_from_step 0 must be >= 1"),
    (dict(skip_all_equal=True), 2, "--skip_all_equal only applies with --filter_groups"),
    (dict(lr_scheduler_type="linear"), 2, "--lr_scheduler_type must be constant or cosine"),
    (dict(lr_scheduler_type="cosine", min_lr_ratio=1.5), 2, r"--min_lr_ratio 1.5 must be in \[0, 1\]"),
    (dict(lr_scheduler_type="cosine", lr_decay_steps_ratio=0.0), 2, r"--lr_decay_steps_ratio 0.0 must be in \(0, 1\]"),
    (dict(min_lr_ratio=0.1), 2, "shape the cosine schedule: add --lr_scheduler_type cosine"),
    (dict(lr_decay_steps_ratio=0.3), 2, "shape the cosine schedule: add --lr_scheduler_type cosine"),
    (dict(skip_all_equal=True, filter_groups=True, skip_explore_prob=0.0), 2,
     r"--skip_explore_prob 0.0 must be in \(0, 1\]"),
])
def test_check_args_names_the_flag(kw, world, flag):
    with pytest.raises(SystemExit, match=flag):
        check_args(good_args(**kw), world_size=world)


@pytest.mark.parametrize("kw, flag", [
    (dict(loss_agg_mode="token-sum"), "--loss_agg_mode"),
    (dict(kl_loss_type="k4"), "--kl_loss_type"),
])
def test_check_args_rejects_unknown_variants(kw, flag):
    with pytest.raises(ValueError, match=flag):
        check_args(good_args(**kw), world_size=2)


# --- properties on a tiny model --------------------------------------------------------------------


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config(), dtype=torch.float32,
                                             attn_implementation=sharding.PACKED_ATTENTION)  # as the scripts load it
    with torch.no_grad():  # larger weights than the default init, so log-probs are far from uniform
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.1)
    return model


@torch.no_grad()
def test_packed_log_probs_equal_padded_and_a_loop(model):
    samples = make_samples(LENGTHS)
    packed, packed_entropy = forward_log_probs(model, samples, 0.7, packed=True, with_entropy=True)  # (N, T)
    padded, padded_entropy = forward_log_probs(model, samples, 0.7, packed=False, with_entropy=True)
    assert packed.shape == padded.shape == (4, 6)
    close(packed, padded, atol=1e-5)
    close(packed_entropy, padded_entropy, atol=1e-5)
    mask = train_grpo.response_targets(samples, 6, "cpu")[1]
    for out in (packed, padded, packed_entropy, padded_entropy):
        assert torch.equal(out * (1 - mask), torch.zeros_like(out))  # zero beyond each response
    # a loop over sequences, each alone and unpadded: log_softmax(logits / 0.7) at the response tokens
    for i, (p, r) in enumerate(samples):
        logits = model(input_ids=torch.tensor([p + r])).logits[0, len(p) - 1:-1] / 0.7  # (|r|, V)
        expected = torch.log_softmax(logits, -1).gather(-1, torch.tensor(r)[:, None]).squeeze(-1)
        close(packed[i, :len(r)], expected, atol=1e-5)
        close(packed_entropy[i, :len(r)], entropy_from_logits(logits), atol=1e-5)


def log_prob_entropy_grads(m, samples):
    """The parameter gradients of sum(log-probs) + sum(entropy) over packed `samples` (then zeroed
    again), and the log-probs."""
    log_probs, entropy = forward_log_probs(m, samples, 0.7, packed=True, with_entropy=True)
    (log_probs.sum() + entropy.sum()).backward()
    grads = [p.grad.clone() for p in m.parameters()]
    m.zero_grad()
    return grads, log_probs


def test_compiled_layers_and_logits_math_equal_eager(model, monkeypatch):
    """--compile_layers and --use_torch_compile change kernels, not results: without gradients
    (where they compile) log-probs and entropy of packed batches of two shapes equal the eager ones;
    with gradients the layers run eagerly and the log-probs and entropy through their compiled
    forward and hand-written backward (sharding.CompiledLogProbs): the gradient equals the eager one."""
    import copy

    from torch._dynamo.utils import counters
    compiled = sharding.compile_layers(copy.deepcopy(model))
    batches = [make_samples(LENGTHS), make_samples([(4, 2), (6, 5), (2, 7)], seed=1)]

    def run(m):
        with torch.no_grad():
            out = [t for s in batches for t in forward_log_probs(m, s, 0.7, packed=True, with_entropy=True)]
        return out, log_prob_entropy_grads(m, batches[0])[0]

    expected, expected_grads = run(model)
    monkeypatch.setattr(train_grpo, "LOGITS_MATH", dict(train_grpo.LOGITS_MATH))
    train_grpo.compile_logits_math()
    counters.clear()
    actual, actual_grads = run(compiled)
    assert counters["stats"]["unique_graphs"] >= 3  # the layer (around attention) and the logits math
    for a, e in zip(actual, expected):
        close(a, e, atol=1e-5)
    for a, e in zip(actual_grads, expected_grads):
        close(a, e, atol=1e-5, rtol=1e-4)


def test_compile_update_compiles_the_backward_and_keeps_the_gradient(model, monkeypatch):
    """--compile_update: the training forward runs through compiled graphs (a compiled backward node in
    its autograd graph) and its gradients equal eager ones up to fp32 reordering."""
    import copy

    samples = make_samples(LENGTHS)
    expected, _ = log_prob_entropy_grads(model, samples)
    monkeypatch.setattr(train_grpo, "LOGITS_MATH", dict(train_grpo.LOGITS_MATH))
    train_grpo.compile_logits_math()
    actual, log_probs = log_prob_entropy_grads(sharding.compile_layers(copy.deepcopy(model), with_grad=True), samples)
    nodes, seen = [log_probs.grad_fn], set()
    while nodes:  # walk the autograd graph
        node = nodes.pop()
        if node is not None and node not in seen:
            seen.add(node)
            nodes += [n for n, _ in node.next_functions]
    names = [type(n).__name__ for n in seen]
    assert "CompiledFunctionBackward" in names  # the layers
    assert "CompiledLogProbsBackward" in names  # the log-probs' and entropy's hand-written backward
    for a, e in zip(actual, expected):
        close(a, e, atol=5e-5, rtol=1e-4)  # fp32: eager's entropy, lse - sum p z, cancels digits


def test_compiled_log_probs_by_hand():
    """Two rows of logits [ln 3, 0] at T = 2: z = [ln 3 / 2, 0], p = [0.633975, 0.366025] (sqrt 3 / (sqrt 3 + 1)).
    Target 0: log p_0 = -0.455746; target 1: log p_1 = -1.005052. The loss log p_0 + 2 log p_1 has
    d/dlogits = g (onehot - p) / T: row 0 [0.366025, -0.366025] / 2, row 1 2 [-0.633975, 0.633975] / 2."""
    logits = torch.tensor([[math.log(3), 0.0]] * 2, requires_grad=True)
    log_probs, entropy = sharding.compiled_log_probs(logits, torch.tensor([0, 1]), 2.0)
    assert entropy is None
    close(log_probs, [-0.455746, -1.005052], atol=1e-6)
    (log_probs * torch.tensor([1.0, 2.0])).sum().backward()
    close(logits.grad, [[0.183013, -0.183013], [-0.633975, 0.633975]], atol=1e-6)


def test_compiled_entropy_by_hand():
    """One row of logits [ln 3, 0] at T = 1 (ChunkedLogProbs' example): p = [3/4, 1/4], log p_0 = -0.287682,
    H = 0.562335, dH/dz = -p (log p + H) = [-0.205990, 0.205990]. The loss log p_0 + 3 H has
    d/dlogits = (onehot - p) + 3 dH/dz = [0.25 - 0.617970, -0.25 + 0.617970] = [-0.367970, 0.367970];
    with the entropy unused (a metric), only the first term: [0.25, -0.25]."""
    for weight, grad in ((3.0, [[-0.367970, 0.367970]]), (0.0, [[0.25, -0.25]])):
        logits = torch.tensor([[math.log(3), 0.0]], requires_grad=True)
        log_probs, entropy = sharding.compiled_log_probs(logits, torch.tensor([0]), 1.0, with_entropy=True)
        close(log_probs, [-0.287682], atol=1e-6)
        close(entropy, [0.562335], atol=1e-6)
        (log_probs.sum() + weight * entropy.sum() if weight else log_probs.sum()).backward()
        close(logits.grad, grad, atol=1e-6)


@pytest.mark.parametrize("with_entropy", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_compiled_log_probs_equal_autograd(dtype, with_entropy):
    """The log-probs (and entropy) and the gradient of a loss that weighs them unevenly equal autograd
    through the eager `token_log_probs`, for fp32 and bf16 logits (the gradient in the logits' dtype)
    and two shapes."""
    g = torch.Generator().manual_seed(0)
    for K, V in ((7, 11), (13, 5)):
        logits = (3 * torch.randn(K, V, generator=g)).to(dtype)
        targets = torch.randint(0, V, (K,), generator=g)
        coef, coef_entropy = torch.randn(K, generator=g), torch.randn(K, generator=g)
        runs = []
        for fn in (token_log_probs, sharding.compiled_log_probs):
            x = logits.clone().requires_grad_()
            log_probs, entropy = fn(x, targets, 0.7, with_entropy)
            assert log_probs.dtype == torch.float32 and (entropy is None) != with_entropy
            loss = (log_probs * coef).sum() + ((entropy * coef_entropy).sum() if with_entropy else 0)
            loss.backward()
            runs.append([log_probs.detach(), x.grad] + ([entropy.detach()] if with_entropy else []))
        (expected, expected_grad, *expected_entropy), (actual, actual_grad, *actual_entropy) = runs
        close(actual, expected, atol=1e-5)
        for a, e in zip(actual_entropy, expected_entropy):
            close(a, e, atol=1e-5)
        assert actual_grad.dtype == dtype
        # eager's entropy, lse - sum_v p_v z_v, cancels digits the compiled -sum_v p_v log p_v keeps
        close(actual_grad, expected_grad, atol=(1e-5 if with_entropy else 1e-6) if dtype == torch.float32 else 1e-2)


def test_compiled_log_probs_compile_one_forward_for_every_pass(monkeypatch):
    """The update reuses the forward graph the passes without gradients compiled (logits that require
    a gradient must not compile it again). A step's passes, twice: old log-probs with the entropy,
    reference log-probs, then a training pass, forward and backward, compile three graphs in all: the
    forward with the entropy, the forward without, the backward."""
    from torch._dynamo.utils import counters
    torch._dynamo.reset()
    monkeypatch.setattr(sharding, "_COMPILED_LOG_PROBS", {})
    counters.clear()
    for K in (6, 9):  # another micro-batch size: dynamic shapes, no new graph
        logits, targets = torch.randn(K, 11), torch.arange(K)
        with torch.no_grad():
            sharding.compiled_log_probs(logits, targets, 0.7, with_entropy=True)
            sharding.compiled_log_probs(logits, targets, 0.7)
        assert counters["stats"]["unique_graphs"] == (2 if K == 6 else 3)  # the two forwards
        sharding.compiled_log_probs(logits.clone().requires_grad_(), targets, 0.7)[0].sum().backward()
        assert counters["stats"]["unique_graphs"] == 3  # and the backward


def test_gpu_check_of_compiled_log_probs_runs_on_cpu():
    """`make test-gpu`'s check of CompiledLogProbs at the real vocabulary, run here at a small shape: the
    check itself works, and finds the two ways equal within its bounds."""
    from tests.gpu.gpu_checks import compiled_log_probs_check
    res = compiled_log_probs_check("cpu", tokens=64, vocab=1000)
    assert res["compiled_log_probs_max_diff"] < 1e-3 and res["compiled_log_probs_grad_rel_diff"] < 1e-2
    assert res["compiled_entropy_max_diff"] < 1e-3


def test_chunked_log_probs_by_hand():
    """One token, V = 2, H = 1: W = [[1], [0]], h = ln 3, T = 1, so z = [ln 3, 0], p = [3/4, 1/4].
    log p_0 = ln(3/4) = -0.287682; H = -(3/4 ln 3/4 + 1/4 ln 1/4) = 0.562335.
    d log p_0 / dz = onehot - p = [1/4, -1/4]: d/dh = z-gradient . W[:, 0] = 1/4; d/dW = [[ln3 / 4], [-ln3 / 4]].
    dH / dz = -p (log p + H) = [-0.75 (-0.287682 + 0.562335), -0.25 (-1.386294 + 0.562335)]
            = [-0.205990, 0.205990]: d/dh = -0.205990; d/dW = [[-0.205990 ln 3], [0.205990 ln 3]]."""
    h = torch.tensor([[math.log(3)]], dtype=torch.float64, requires_grad=True)
    w = torch.tensor([[1.0], [0.0]], dtype=torch.float64, requires_grad=True)
    log_probs, entropy = sharding.ChunkedLogProbs.apply(h, w, torch.tensor([0]), 1.0, 1)
    close(log_probs, [-0.287682], atol=1e-6)
    close(entropy, [0.562335], atol=1e-6)
    log_probs.sum().backward()
    close(h.grad, [[0.25]], atol=1e-6)
    close(w.grad, [[math.log(3) / 4], [-math.log(3) / 4]], atol=1e-6)
    h.grad, w.grad = None, None
    _, entropy = sharding.ChunkedLogProbs.apply(h, w, torch.tensor([0]), 1.0, 1)
    entropy.sum().backward()
    close(h.grad, [[-0.205990]], atol=1e-6)
    close(w.grad, [[-0.205990 * math.log(3)], [0.205990 * math.log(3)]], atol=1e-6)


@pytest.mark.parametrize("chunk", [1, 3, 7, 100])
def test_chunked_log_probs_equal_autograd_through_whole_logits(chunk):
    """Any chunking: the log-probs, entropy and both gradients of a loss that weighs them (the update's
    log-probs with a KL-like nonlinearity, an entropy bonus) equal autograd through the whole logits."""
    g = torch.Generator().manual_seed(0)
    K, H, V, temperature = 7, 5, 11, 0.7
    hidden = torch.randn(K, H, generator=g, dtype=torch.float64)
    weight = torch.randn(V, H, generator=g, dtype=torch.float64)
    targets = torch.randint(0, V, (K,), generator=g)
    coef = torch.randn(K, generator=g, dtype=torch.float64)

    def run(fn):
        h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        log_probs, entropy = fn(h, w)
        ((coef * log_probs.exp()).sum() + 0.3 * (coef * entropy).sum()).backward()
        return log_probs, entropy, h.grad, w.grad

    expected = run(lambda h, w: (torch.log_softmax(h @ w.T / temperature, -1).gather(-1, targets[:, None])[:, 0],
                                 entropy_from_logits(h @ w.T / temperature)))  # in float64 throughout
    actual = run(lambda h, w: sharding.ChunkedLogProbs.apply(h, w, targets, temperature, chunk))
    for a, e in zip(actual, expected):
        torch.testing.assert_close(a, e, rtol=1e-10, atol=1e-12)


def test_chunked_log_probs_keep_no_logits_for_the_backward():
    """What the backward keeps: through the whole logits, at least their (K, V) fp32 copy; chunked,
    the inputs and three floats per token, however large V."""
    K, H, V = 64, 16, 4096
    hidden, weight = torch.randn(K, H, requires_grad=True), torch.randn(V, H, requires_grad=True)
    targets = torch.randint(0, V, (K,))

    def saved_bytes(fn):
        seen = {}

        def pack(t):
            seen[t.data_ptr()] = t.numel() * t.element_size()
            return t
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            fn()
        return sum(seen.values())
    whole = saved_bytes(lambda: token_log_probs(hidden @ weight.T, targets, 1.0))
    chunked = saved_bytes(lambda: sharding.ChunkedLogProbs.apply(hidden, weight, targets, 1.0, 8))
    inputs = (K * H + V * H) * 4 + K * 8
    assert whole >= K * V * 4
    assert chunked <= inputs + 2 * K * 4


@pytest.mark.parametrize("packed", [True, False])
def test_fused_log_probs_equal_the_logits_path(model, packed):
    """forward_log_probs(fused=True), as the update runs it (--use_fused_kernels): the same log-probs,
    entropy and parameter gradients as through the model's logits; without a gradient it is the
    logits path; the output layer is the model's own again afterwards."""
    samples = make_samples(LENGTHS)

    def grads(fused, with_entropy):
        log_probs, entropy = forward_log_probs(model, samples, 0.7, packed, with_entropy, fused=fused)
        assert (entropy is None) != with_entropy
        (log_probs.sum() + (entropy.sum() if with_entropy else 0)).backward()
        out = [log_probs.detach()] + ([entropy.detach()] if with_entropy else [])
        out += [p.grad.clone() for p in model.parameters()]
        model.zero_grad()
        return out
    for with_entropy in (True, False):
        for a, e in zip(grads(True, with_entropy), grads(False, with_entropy)):
            close(a, e, atol=1e-5)
    with torch.no_grad():
        a = forward_log_probs(model, samples, 0.7, packed, True, fused=True)
        e = forward_log_probs(model, samples, 0.7, packed, True)
    assert all(torch.equal(x, y) for x, y in zip(a, e))
    assert "forward" not in model.get_output_embeddings().__dict__
    logits = model(input_ids=torch.tensor([[1, 2, 3]])).logits
    assert logits.shape[-1] == model.config.vocab_size


def test_fused_log_probs_refuse_an_output_layer_they_would_get_wrong(model):
    """A bias or soft-capped logits would be silently dropped: refused, naming the flag."""
    import copy

    m = copy.deepcopy(model)
    m.config.final_logit_softcapping = 30.0
    with pytest.raises(ValueError, match="--use_fused_kernels"):
        forward_log_probs(m, make_samples(LENGTHS), 1.0, True, True, fused=True)


REFERENCE_SHARES_GRAPHS = """
import os, sys, torch, torch.distributed as dist
sys.path.insert(0, os.getcwd())
import train_grpo
import train_ppo
from torch._dynamo.utils import counters
from tests.tiny_model import make_tiny_model
dist.init_process_group("gloo", rank=0, world_size=1)
path = make_tiny_model(sys.argv[1])
args = train_grpo.Args(model=path, compile_layers=True)
device = torch.device("cpu")
actor = train_grpo.load_policy(path, device, True, False, args)
ref = train_grpo.load_policy(path, device, False, False, args)
samples = [([5, 6, 7], [8, 9]), ([1, 2], [3, 4, 5, 6])]
train_grpo.batched_log_probs(actor, samples, 8, 1.0, True, 4)
graphs = counters["stats"]["unique_graphs"]
train_grpo.batched_log_probs(ref, samples, 8, 1.0, True, 4)
assert graphs > 0 and counters["stats"]["unique_graphs"] == graphs, (graphs, counters["stats"]["unique_graphs"])
assert not ref.training and all(p.grad is None for p in ref.parameters())
print("OK")
"""


def test_the_reference_reuses_the_actors_compiled_layers(tmp_path):
    """load_policy leaves the frozen reference's parameters as the actor's (requires_grad): its
    no-grad pass runs the graphs the actor's compiled, none of its own."""
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29741"}
    proc = subprocess.run([sys.executable, "-c", REFERENCE_SHARES_GRAPHS, str(tmp_path / "model")], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and "OK" in proc.stdout, proc.stdout[-2000:] + proc.stderr[-3000:]


FUSED_UNDER_FSDP2 = """
import os, sys, torch, torch.distributed as dist
sys.path.insert(0, os.getcwd())
import train_grpo
import train_ppo
from tests.tiny_model import make_samples, make_tiny_model
dist.init_process_group("gloo")
rank = dist.get_rank()
for tie in (True, False):
    path = os.path.join(sys.argv[1], f"tie_{tie}")
    if rank == 0:
        make_tiny_model(path, tie=tie)
    dist.barrier()
    actor = train_grpo.load_policy(path, torch.device("cpu"), True, False, train_grpo.Args(model=path))
    samples = make_samples([(5, 3), (9, 6)] if rank == 0 else [(3, 1), (7, 4), (2, 5)], seed=rank)
    grads = []
    for fused in (False, True):
        log_probs, entropy = train_grpo.forward_log_probs(actor, samples, 0.7, True, True, fused=fused)
        (log_probs.sum() + 0.1 * entropy.sum()).backward()
        grads.append({n: p.grad.full_tensor() for n, p in actor.named_parameters()})
        actor.zero_grad(set_to_none=True)
    assert grads[0].keys() == grads[1].keys() and any("embed" in n for n in grads[0])
    for n in grads[0]:
        torch.testing.assert_close(grads[1][n], grads[0][n], atol=1e-5, rtol=1e-5, msg=n)
        assert grads[0][n].abs().sum() > 0, n
open(os.path.join(sys.argv[1], f"ok{rank}"), "w").close()  # a file each: two ranks' prints can interleave
"""


def test_fused_log_probs_under_fsdp2_on_two_ranks(tmp_path):
    """--use_fused_kernels under FSDP2 with two gloo ranks, tied and untied output layers: the output
    layer runs inside the root unit's forward, so its gathered weight is the one used and its gradient
    is reduced as the logits path's is. The full gradients of every parameter agree."""
    port = str(free_port())
    script = tmp_path / "fused_fsdp2.py"
    script.write_text(FUSED_UNDER_FSDP2)
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--master_port", port,
                           str(script), str(tmp_path)], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and (tmp_path / "ok0").exists() and (tmp_path / "ok1").exists(), \
        proc.stdout[-2000:] + proc.stderr[-3000:]


def test_micro_batches_by_count_and_by_token_budget():
    seqs = lambda lengths: [([0] * (n - 1), [0]) for n in lengths]  # noqa: E731  (prompt, response) of n tokens
    assert train_grpo.micro_batches(seqs([5] * 5), 2) == [[0, 1], [2, 3], [4]]
    # 30 tokens, budget 15: two groups; longest first into the lighter group:
    # 10 -> A, 8 -> B, 7 -> B (15), 3 -> A (13), 2 -> A (15)
    assert train_grpo.micro_batches(seqs([10, 3, 7, 2, 8]), 2, max_tokens=15) == [[0, 1, 3], [2, 4]]
    # 18 tokens would fit 2 x 10, but two 6-token sequences do not: the count grows until each group fits
    assert train_grpo.micro_batches(seqs([6, 6, 6]), 2, max_tokens=10) == [[0], [1], [2]]
    assert train_grpo.micro_batches(seqs([4, 4, 4, 4]), 1, max_tokens=100) == [[0, 1, 2, 3]]


def test_packed_attention_equals_a_block_diagonal_mask():
    """sharding.packed_attention on 3 segments (grouped-query heads, 4 query / 2 kv) equals sdpa with
    the block-diagonal causal mask written out by hand, in value and in gradient."""
    torch.manual_seed(0)
    lens, L, D = [3, 5, 2], 10, 8
    q = torch.randn(1, 4, L, D, requires_grad=True)
    k, v = (torch.randn(1, 2, L, D, requires_grad=True) for _ in range(2))
    seg = torch.tensor([i for i, n in enumerate(lens) for _ in range(n)])
    allowed = (seg[:, None] == seg[None, :]) & torch.ones(L, L, dtype=torch.bool).tril()
    expected = torch.nn.functional.scaled_dot_product_attention(
        q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1), attn_mask=allowed).transpose(1, 2)  # (1, L, 4, D)
    cu = torch.tensor([0, 3, 8, 10], dtype=torch.int32)
    out, _ = sharding.packed_attention(None, q, k, v, None, scaling=D ** -0.5, cu_seq_lens=cu, max_seq_len=max(lens))
    close(out, expected, atol=1e-6)
    grads = torch.autograd.grad((out * torch.arange(L * 4 * D).reshape(out.shape).sin()).sum(), (q, k, v))
    expected_grads = torch.autograd.grad((expected * torch.arange(L * 4 * D).reshape(out.shape).sin()).sum(),
                                         (q, k, v))
    for g, e in zip(grads, expected_grads):
        close(g, e, atol=1e-5)
    # a packed row without segment bounds would attend across sequences: refused
    with pytest.raises(ValueError, match="cu_seq_lens"):
        sharding.packed_attention(SimpleNamespace(is_causal=True), q, k, v, None,
                                  position_ids=torch.tensor([[0, 1, 2, 0, 1, 2, 3, 4, 0, 1]]))


def accumulated_grads(model, samples, micro, packed, mode, old_log_probs, ref_log_probs, advantages, mask):
    """The loss of update_actor's inner loop (pg + kl - entropy bonus) with global denominators,
    accumulated over micro-batches of `micro` sequences; returns the gradient of every parameter."""
    model.zero_grad(set_to_none=True)
    agg_kw = dict(mode=mode, num_tokens=mask.sum().item(), num_seqs=len(samples), max_response_length=8)
    for i in range(0, len(samples), micro):
        mb = slice(i, i + micro)
        log_probs, entropy = forward_log_probs(model, samples[mb], 1.0, packed, with_entropy=True)
        Tm = log_probs.shape[1]
        m = mask[mb, :Tm]
        pg_losses, _ = compute_policy_loss(old_log_probs[mb, :Tm], log_probs, advantages[mb, :Tm], m, 0.2, 0.28, 3.0)
        kl = kl_penalty(log_probs, ref_log_probs[mb, :Tm], "low_var_kl")
        loss = (agg_loss(pg_losses, m, **agg_kw) + 0.1 * agg_loss(kl, m, **agg_kw)
                - 0.01 * agg_loss(entropy, m, **agg_kw))
        loss.backward()
    return {name: p.grad.clone() for name, p in model.named_parameters()}


@pytest.mark.parametrize("packed", [True, False], ids=["packed", "padded"])
@pytest.mark.parametrize("mode", MODES)
def test_micro_batching_leaves_the_gradient_unchanged(model, mode, packed):
    samples = make_samples(LENGTHS, seed=1)
    with torch.no_grad():
        log_probs, _ = forward_log_probs(model, samples, 1.0, packed, with_entropy=False)  # (N, T)
    mask = train_grpo.response_targets(samples, 6, "cpu")[1]
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
    """--rollout_is: weights of 1 take the same steps as none; weights of 0.5 halve the first step's gradient
    (no KL or entropy term, no clipping of the norm: the loss is the policy loss alone)."""
    monkeypatch.setattr(train_grpo.dist, "get_world_size", lambda: 1)
    args = Args(rollout_n=2, train_batch_size=2, ppo_mini_batch_size=1, grad_clip=1e9, use_kl_loss=False)
    plain = update_actor_steps(model, args, ref=False)
    ones = update_actor_steps(model, args, ref=False, is_weights=torch.ones(4, 6))
    halves = update_actor_steps(model, args, ref=False, is_weights=torch.full((4, 6), 0.5))
    for name in plain[0][0]:
        torch.testing.assert_close(ones[0][0][name], plain[0][0][name], msg=name)
        torch.testing.assert_close(halves[0][0][name], 0.5 * plain[0][0][name], msg=name)
    assert ones[1]["actor/pg_loss"] == pytest.approx(plain[1]["actor/pg_loss"])


def update_actor_steps(model, args, ref=True, is_weights=None):
    """update_actor at a world size of one (the caller patches dist.get_world_size) on 2 prompts x n = 2
    of fixed samples, old and reference log-probs (none if not `ref`: no KL loss) and advantages: the
    gradient at each optimizer step (GradRecorder) and the metrics."""
    samples = make_samples(LENGTHS, seed=3)
    with torch.no_grad():
        log_probs, _ = forward_log_probs(model, samples, 1.0, True, with_entropy=False)
    mask = train_grpo.response_targets(samples, 6, "cpu")[1]
    g = torch.Generator().manual_seed(4)
    old_log_probs = (log_probs + 0.4 * (torch.rand(4, 6, generator=g) - 0.5)) * mask
    ref_log_probs = (log_probs + 0.3 * torch.randn(4, 6, generator=g)) * mask
    advantages = compute_grpo_outcome_advantage(torch.tensor([1.0, 0.0, 0.2, 0.7]), mask, n=2)
    recorder = GradRecorder(model)
    model.zero_grad(set_to_none=True)  # the trainer enters each update with no gradients
    metrics = train_grpo.update_actor(model, recorder, samples, old_log_probs, ref_log_probs if ref else None,
                                      advantages, mask, args, step=1, device=torch.device("cpu"),
                                      is_weights=is_weights)
    return recorder.steps, metrics


def test_update_actor_logs_kl_loss_only_with_the_kl_term(model, monkeypatch):
    """Without --use_kl_loss the update gets no reference log-probs and logs no actor/kl_loss (as verl):
    a logged 0 would read as a policy that never left the reference."""
    monkeypatch.setattr(train_grpo.dist, "get_world_size", lambda: 1)
    args = Args(rollout_n=2, train_batch_size=2, ppo_mini_batch_size=1, grad_clip=1e9, kl_loss_coef=0.1)
    with_kl = update_actor_steps(model, args)[1]
    without = update_actor_steps(model, dataclasses.replace(args, use_kl_loss=False), ref=False)[1]
    assert with_kl["actor/kl_loss"] > 0
    assert set(with_kl) - set(without) == {"actor/kl_loss"} and set(without) <= set(with_kl)


def test_update_actor_gradient_does_not_depend_on_micro_batch_size(model, monkeypatch):
    # update_actor itself, at a world size of one: 2 prompts x n = 2 in mini-batches of 1 prompt (2 sequences)
    monkeypatch.setattr(train_grpo.dist, "get_world_size", lambda: 1)
    results = {}
    for micro in (1, 2):
        args = Args(rollout_n=2, train_batch_size=2, ppo_mini_batch_size=1, ppo_micro_batch_size_per_gpu=micro,
                    kl_loss_coef=0.1, entropy_coeff=0.01, grad_clip=1e9, loss_agg_mode="seq-mean-token-mean")
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
    """--enable_gradient_checkpointing acts in the update: Hugging Face checkpoints only in train mode,
    and from_pretrained leaves a model in eval mode, so update_actor switches to train mode (and back).
    Each decoder layer then runs its forward again in the backward; the steps are the same."""
    monkeypatch.setattr(train_grpo.dist, "get_world_size", lambda: 1)
    args = Args(rollout_n=2, train_batch_size=2, ppo_mini_batch_size=1, ppo_micro_batch_size_per_gpu=1,
                kl_loss_coef=0.1, entropy_coeff=0.01, grad_clip=1e9)
    calls = []
    hook = sharding.decoder_layers(model)[0].register_forward_pre_hook(lambda *_: calls.append(1))
    results = {}
    try:
        for checkpointing in (False, True):
            if checkpointing:
                model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
            model.eval()  # as from_pretrained returns it
            calls.clear()
            results[checkpointing] = update_actor_steps(model, args)[0], len(calls)
            assert not model.training  # eval again for the log-prob passes
    finally:
        hook.remove()
        model.gradient_checkpointing_disable()
    (plain, plain_calls), (recomputed, recomputed_calls) = results[False], results[True]
    # the helper's no-grad pass, then 2 mini-batches of 2 micro-batches, each forward once more in the backward
    assert plain_calls == 1 + 4 and recomputed_calls == 1 + 4 + 4
    for a, b in zip(plain, recomputed):
        for name in a:
            torch.testing.assert_close(a[name], b[name], atol=1e-6, rtol=1e-6, msg=name)


def test_update_actor_with_fused_kernels_takes_the_same_steps(model, monkeypatch):
    """--use_fused_kernels reaches the update: every micro-batch's forward runs through
    sharding.fused_log_probs, and the optimizer steps and metrics equal those without it (with an
    entropy bonus, so the entropy's gradient is taken through the chunks too)."""
    monkeypatch.setattr(train_grpo.dist, "get_world_size", lambda: 1)
    calls = []
    real = sharding.fused_log_probs
    monkeypatch.setattr(sharding, "fused_log_probs", lambda *a, **k: calls.append(1) or real(*a, **k))
    results = {}
    for fused in (False, True):
        args = Args(rollout_n=2, train_batch_size=2, ppo_mini_batch_size=1, ppo_micro_batch_size_per_gpu=1,
                    kl_loss_coef=0.1, entropy_coeff=0.01, grad_clip=1e9, use_fused_kernels=fused)
        results[fused] = update_actor_steps(model, args)
    assert len(calls) == 4  # 4 micro-batches of one sequence, all with the fused head; none without the flag
    (steps, metrics), (fused_steps, fused_metrics) = results[False], results[True]
    for a, b in zip(steps, fused_steps):
        for name in a:
            torch.testing.assert_close(b[name], a[name], atol=1e-5, rtol=1e-5, msg=name)
    for k in metrics:
        assert fused_metrics[k] == pytest.approx(metrics[k], rel=1e-5, abs=1e-6), k


def test_a_non_finite_gradient_stops_before_the_update():
    model = torch.nn.Linear(3, 1)
    before = [p.detach().clone() for p in model.parameters()]
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    (model(torch.ones(1, 3)) * float("nan")).sum().backward()
    with pytest.raises(FloatingPointError, match="step 7: non-finite gradient norm.*--actor_lr"):
        train_grpo.clip_and_step(model, optimizer, 1.0, 7, "--actor_lr")
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))  # no update happened


def test_clip_and_step_clips_and_steps():
    model = torch.nn.Linear(2, 1, bias=False)
    with torch.no_grad():
        model.weight.copy_(torch.tensor([[1.0, 1.0]]))
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    model(torch.tensor([[3.0, 4.0]])).sum().backward()  # grad (3, 4): norm 5 -> clipped to (0.6, 0.8)
    assert train_grpo.clip_and_step(model, optimizer, 1.0, 1, "--actor_lr") == pytest.approx(5.0)
    assert torch.allclose(model.weight, torch.tensor([[0.4, 0.2]]))  # 1 - 0.6, 1 - 0.8
    assert model.weight.grad is None  # zeroed for the next mini-batch


def test_a_last_partial_mini_batch_is_its_own_global_mean(model, monkeypatch):
    # 3 prompts x n = 2 = 6 sequences in mini-batches of 2 prompts: 4 + 2 sequences, micro-batches of 3
    # (3 + 1, then 2). Each optimizer step must see the gradient of its own mini-batch alone.
    monkeypatch.setattr(train_grpo.dist, "get_world_size", lambda: 1)
    samples = make_samples(LENGTHS + [(4, 5), (6, 2)], seed=5)
    with torch.no_grad():
        log_probs, _ = forward_log_probs(model, samples, 1.0, True, with_entropy=False)
    mask = train_grpo.response_targets(samples, 6, "cpu")[1]
    old_log_probs = log_probs + 0.1 * mask
    advantages = compute_grpo_outcome_advantage(torch.tensor([1.0, 0.0, 0.2, 0.7, 0.0, 1.0]), mask, n=2)

    def grads(rows, prompts, mini, micro):
        args = Args(rollout_n=2, train_batch_size=prompts, ppo_mini_batch_size=mini, ppo_micro_batch_size_per_gpu=micro,
                    grad_clip=1e9, loss_agg_mode="seq-mean-token-mean")
        recorder = GradRecorder(model)
        model.zero_grad(set_to_none=True)
        train_grpo.update_actor(model, recorder, [samples[i] for i in rows], old_log_probs[rows], None,
                                advantages[rows], mask[rows], args, step=1, device=torch.device("cpu"))
        return recorder.steps

    partial = grads(list(range(6)), 3, 2, 3)
    assert len(partial) == 2
    first, last = grads([0, 1, 2, 3], 2, 2, 4), grads([4, 5], 1, 1, 2)
    for got, want in ((partial[0], first[0]), (partial[1], last[0])):
        for name in want:
            torch.testing.assert_close(got[name], want[name], atol=1e-6, rtol=1e-5, msg=name)


class FakeCudaMemory:
    """torch.cuda's peak counter, driven by the test: `peak` is what the next phase reaches."""

    def __init__(self, monkeypatch):
        self.peak = 0
        monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
        monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda *a: None)
        monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda *a: self.peak)


class SleepyEngine:
    """The engine's side of the memory accounting: a 80 GiB sleep-mode pool torch keeps counting."""

    def __init__(self):
        self.sleeping = False

    def unbacked_bytes(self):
        return 80 * 2**30 if self.sleeping else 0


@pytest.mark.parametrize("script", ["train_grpo", "train_ppo"])
def test_phase_peaks_leave_out_the_sleeping_engines_pool(script, monkeypatch):
    """By hand, in GiB: torch counts the engine's 80 GiB pool all along. gen peaks at 90 with the engine
    awake (it sleeps at the end: kept, 90); the update peaks at 130 with it asleep throughout: 130 - 80
    = 50; the sync peaks at 95 and wakes it: kept, 95. The outer step records no peak of its own (its
    inner phases reset the counter), and without an engine nothing is subtracted."""
    import train_ppo

    Timer = (train_grpo if script == "train_grpo" else train_ppo).Timer
    memory, engine, metrics = FakeCudaMemory(monkeypatch), SleepyEngine(), {}
    timer = Timer(metrics, torch.device("cuda"), engine)
    with timer("step"):
        with timer("gen"):
            memory.peak = 90 * 2**30
            engine.sleeping = True
        with timer("update_actor"):
            memory.peak = 130 * 2**30
        with timer("update_weights"):
            memory.peak = 95 * 2**30
            engine.sleeping = False
    peaks = {k.split("/")[-1]: v for k, v in metrics.items() if k.startswith("perf/max_memory_allocated_gb/")}
    assert peaks == {"gen": 90.0, "update_actor": 50.0, "update_weights": 95.0}
    assert set(metrics) - {f"perf/max_memory_allocated_gb/{k}" for k in peaks} == {
        "timing_s/step", "timing_s/gen", "timing_s/update_actor", "timing_s/update_weights"}
    engine.sleeping, plain = True, {}
    with Timer(plain, torch.device("cuda"))("save_checkpoint"):
        memory.peak = 130 * 2**30
    assert plain["perf/max_memory_allocated_gb/save_checkpoint"] == 130.0


@pytest.mark.parametrize("script", ["train_grpo", "train_ppo"])
def test_logger_close_finishes_the_background_loggers(script, tmp_path):
    """A finished run ends with os._exit, which runs no exit hooks: the run itself finishes the wandb run and
    writes tensorboard's pending events (stand-ins here: neither package is installed for the tests)."""
    import train_ppo

    module = train_grpo if script == "train_grpo" else train_ppo
    calls = []
    logger = module.Logger(module.Args(logger="jsonl"), str(tmp_path))
    logger.close()  # none of them on: nothing to close
    logger.wandb = SimpleNamespace(finish=lambda: calls.append("wandb"))
    logger.tb = SimpleNamespace(close=lambda: calls.append("tensorboard"))
    logger.close()
    assert calls == ["wandb", "tensorboard"]
