"""The math both train scripts copy on purpose, against examples worked out by hand, run over each
script that has the function: a fix made in one copy and not the other fails here (and
tests/test_fork.py names any drift between the copies).

- `place_scores`: each response's score on its last token;
- `compute_policy_loss`: PPO's clipped surrogate with DAPO's clip-higher and dual-clip, with ratios
  where each clip binds and where it does not;
- `kl_penalty`: the k1, k2 (mse), k3 (low_var_kl) and abs estimators;
- `agg_loss`: the four loss aggregations with global denominators.

Shapes as in the scripts: N sequences, T response tokens.
"""

import math

import pytest
import torch

import train_grpo
import train_ppo

MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm")
SCRIPTS = {"grpo": train_grpo, "ppo": train_ppo}


def having(function):
    """The scripts that define `function`, for pytest's parametrize (ids: grpo, ppo)."""
    return [
        pytest.param(getattr(s, function), id=name)
        for name, s in SCRIPTS.items()
        if hasattr(s, function)
    ]


def close(actual, expected, atol=1e-4):
    torch.testing.assert_close(
        torch.as_tensor(actual, dtype=torch.float32),
        torch.as_tensor(expected, dtype=torch.float32),
        atol=atol,
        rtol=0.0,
    )


# --- where the score sits -------------------------------------------------------------------------


@pytest.mark.parametrize("place_scores", having("place_scores"))
def test_each_score_sits_on_its_responses_last_token(place_scores):
    # responses of 3, 1 and 2 tokens score 0.5, 1 and -2 at tokens 2, 0 and 1
    mask = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0], [1, 1, 0, 0]], dtype=torch.float)
    placed = place_scores(torch.tensor([0.5, 1.0, -2.0]), mask)
    close(placed, [[0, 0, 0.5, 0], [1, 0, 0, 0], [0, -2, 0, 0]], atol=0)
    assert placed.dtype == mask.dtype and placed.shape == mask.shape


def test_with_gamma_and_lambda_1_and_no_kl_every_token_returns_the_score():
    # PPO's returns_t = sum of the rewards from t on (gamma = lam = 1: A_t + V_t, whatever V is);
    # with the score on the last token that is the score at every response token, 0 on padding
    mask = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0], [1, 1, 0, 0]], dtype=torch.float)
    scores = torch.tensor([0.5, 1.0, -2.0])
    values = torch.randn(3, 4, generator=torch.Generator().manual_seed(0))
    rewards = train_ppo.place_scores(scores, mask)
    _, returns = train_ppo.compute_gae_advantage_return(rewards, values, mask, 1.0, 1.0)
    close(returns, scores[:, None] * mask, atol=1e-6)


# --- the policy loss ------------------------------------------------------------------------------


def policy_loss(compute_policy_loss, log_ratio, adv, mask=None, low=0.2, high=0.2, c=3.0):
    log_ratio = torch.tensor([log_ratio], dtype=torch.float)  # (1, T)
    adv = torch.tensor([adv], dtype=torch.float)
    mask = torch.ones_like(adv) if mask is None else torch.tensor([mask], dtype=torch.float)
    old = torch.full_like(adv, -2.0)
    return compute_policy_loss(old, old + log_ratio, adv, mask, low, high, c)


@pytest.mark.parametrize("compute_policy_loss", having("compute_policy_loss"))
def test_policy_loss_clip_and_dual_clip_by_hand(compute_policy_loss):
    # token 0: A = +1, ratio = e^0.2 = 1.2214 -> clipped to 1.2; min(1.2214, 1.2) = 1.2
    #          -> loss -1.2, clipped
    # token 1: A = +1, ratio = e^-0.5 = 0.6065 -> clipped to 0.8; min(0.6065, 0.8) = 0.6065
    #          -> loss -0.6065 (clipping only binds when it lowers the objective)
    # token 2: A = -1, ratio = 5 -> clipped 1.2; min(-5, -1.2) = -5; dual-clip max(-5, c*A = -3)
    #          = -3 -> loss 3 (not in pg_clipfrac: the clipped term -1.2 is not the smaller one;
    #          in pg_clipfrac_lower)
    # token 3: A = -1, ratio = 0.5 -> clipped 0.8; min(-0.5, -0.8) = -0.8; max(-0.8, -3) = -0.8
    #          -> loss 0.8, clipped
    # token 4: A = -2, ratio = 2 -> clipped 1.2; min(-4, -2.4) = -4; max(-4, 3 * -2 = -6) = -4
    #          -> loss 4 (ratio 2 < c = 3: the dual clip does not bind)
    log_ratio = [0.2, -0.5, math.log(5), math.log(0.5), math.log(2)]
    pg_losses, stats = policy_loss(compute_policy_loss, log_ratio, [1, 1, -1, -1, -2])
    close(pg_losses, [[-1.2, -0.60653, 3.0, 0.8, 4.0]])
    assert stats["pg_clipfrac"].item() == 2  # tokens 0 and 3
    assert stats["pg_clipfrac_lower"].item() == 1  # token 2
    # ppo_kl sums -log_ratio = -(0.2 - 0.5 + 1.6094 - 0.6931 + 0.6931) = -1.3094
    close(stats["ppo_kl"], -1.30944)


@pytest.mark.parametrize("compute_policy_loss", having("compute_policy_loss"))
def test_dual_clip_caps_huge_ratio_at_c_times_advantage(compute_policy_loss):
    # A = -0.5, ratio = e^20 (log ratio 30 clamped to 20): the loss is capped at -c * A = 3 * 0.5
    pg_losses, stats = policy_loss(compute_policy_loss, [30.0], [-0.5])
    close(pg_losses, [[1.5]])
    assert stats["pg_clipfrac_lower"].item() == 1
    # the same with c = 10: cap 10 * 0.5 = 5
    close(policy_loss(compute_policy_loss, [30.0], [-0.5], c=10.0)[0], [[5.0]])


@pytest.mark.parametrize("compute_policy_loss", having("compute_policy_loss"))
def test_clip_higher_uses_asymmetric_bounds(compute_policy_loss):
    # DAPO: eps_low 0.2, eps_high 0.28
    # A = +1, ratio = e^0.25 = 1.2840 -> clipped at 1 + 0.28 = 1.28 -> loss -1.28 (eps_high 0.2:
    # -1.2)
    # A = -1, ratio = e^-0.3 = 0.7408 -> clipped at 1 - 0.2 = 0.8, min(-0.7408, -0.8) = -0.8
    # -> loss 0.8
    pg_losses, stats = policy_loss(compute_policy_loss, [0.25, -0.3], [1, -1], high=0.28)
    close(pg_losses, [[-1.28, 0.8]])
    assert stats["pg_clipfrac"].item() == 2
    close(policy_loss(compute_policy_loss, [0.25, -0.3], [1, -1], high=0.2)[0], [[-1.2, 0.8]])
    # a ratio inside the wider band is not clipped: e^0.23 = 1.2586 < 1.28 -> loss -1.2586
    pg_losses, stats = policy_loss(compute_policy_loss, [0.23], [1], high=0.28)
    close(pg_losses, [[-1.25860]])
    assert stats["pg_clipfrac"].item() == 0
    # eps_low 0.1, eps_high 0.3 on A = -1: ratio e^-0.3 = 0.7408 clips at 0.9 -> loss 0.9, and
    # ratio e^0.2 = 1.2214 is inside [0.9, 1.3] -> loss 1.2214 (bounds swapped, [0.7, 1.1]: 0.7408
    # and 1.2214)
    close(policy_loss(compute_policy_loss, [-0.3, 0.2], [-1, -1], low=0.1, high=0.3)[0],
          [[0.9, 1.22140]])  # fmt: skip


@pytest.mark.parametrize("compute_policy_loss", having("compute_policy_loss"))
def test_policy_loss_stats_ignore_masked_tokens(compute_policy_loss):
    # token 1 is padding with garbage that would count as clipped, dual-clipped and in ppo_kl
    clean, clean_stats = policy_loss(compute_policy_loss, [0.2, 0.0], [1, 0], mask=[1, 0])
    dirty, dirty_stats = policy_loss(compute_policy_loss, [0.2, 15.0], [1, -7], mask=[1, 0])
    assert {k: v.item() for k, v in clean_stats.items()} == {
        k: v.item() for k, v in dirty_stats.items()
    }
    assert clean_stats["pg_clipfrac"].item() == 1 and clean_stats["pg_clipfrac_lower"].item() == 0
    close(clean_stats["ppo_kl"], -0.2)


@pytest.mark.parametrize("compute_policy_loss", having("compute_policy_loss"))
def test_policy_loss_with_is_weights_scales_each_tokens_loss(compute_policy_loss):
    # the tokens of test_policy_loss_clip_and_dual_clip_by_hand, weighted 2, 0.5, 1, 0, 1.5: each
    # loss times its weight; the clipping and its statistics are those of the ratio alone
    log_ratio = torch.tensor([[0.2, -0.5, math.log(5), math.log(0.5), math.log(2)]])
    adv = torch.tensor([[1.0, 1, -1, -1, -2]])
    old = torch.full_like(adv, -2.0)
    mask = torch.ones_like(adv)
    weights = torch.tensor([[2.0, 0.5, 1.0, 0.0, 1.5]])
    args = old, old + log_ratio, adv, mask, 0.2, 0.2, 3.0
    pg_losses, stats = compute_policy_loss(*args, weights)
    close(pg_losses, [[-2.4, -0.303265, 3.0, 0.0, 6.0]])
    plain_stats = compute_policy_loss(*args)[1]
    assert {k: v.item() for k, v in stats.items()} == {k: v.item() for k, v in plain_stats.items()}


# --- KL -------------------------------------------------------------------------------------------


# log r = log pi - log pi_ref = [0.5, -0.5, 0] for log pi = [-1, -2, -0.3], log pi_ref = [-1.5,
# -1.5, -0.3]
KL_BY_HAND = {
    "k1": [0.5, -0.5, 0.0],  # log r
    "kl": [0.5, -0.5, 0.0],  # verl's name for k1
    "abs": [0.5, 0.5, 0.0],  # |log r|
    "k2": [0.125, 0.125, 0.0],  # (log r)^2 / 2 = 0.25 / 2
    "mse": [0.125, 0.125, 0.0],
    # k3: r' = pi_ref / pi = e^-log r; r' - 1 - log r'
    #   log r = 0.5:  e^-0.5 - 1 + 0.5 = 0.60653 - 0.5 = 0.10653
    #   log r = -0.5: e^0.5 - 1 - 0.5 = 1.64872 - 1.5 = 0.14872
    "k3": [0.10653, 0.14872, 0.0],
    "low_var_kl": [0.10653, 0.14872, 0.0],
}


@pytest.mark.parametrize("kl_type", KL_BY_HAND)
@pytest.mark.parametrize("kl_penalty", having("kl_penalty"))
def test_kl_estimators_by_hand(kl_penalty, kl_type):
    expected = KL_BY_HAND[kl_type]
    log_probs = torch.tensor([-1.0, -2.0, -0.3])
    ref_log_probs = torch.tensor([-1.5, -1.5, -0.3])
    close(kl_penalty(log_probs, ref_log_probs, kl_type), expected, atol=1e-5)


@pytest.mark.parametrize("kl_penalty", having("kl_penalty"))
def test_k3_is_clamped_and_never_negative(kl_penalty):
    # log r = -20: r' = e^20, r' - 1 - 20 = 4.85e8 -> clamped to 10
    # log r = +30: -log r clamped to -20 first: e^-20 - 1 + 20 = 19.0 -> clamped to 10
    close(kl_penalty(torch.tensor([-20.0, 30.0]), torch.zeros(2), "low_var_kl"), [10.0, 10.0])
    log_ratio = torch.linspace(-8, 8, 101)
    assert (kl_penalty(log_ratio, torch.zeros(101), "k3") >= 0).all()
    with pytest.raises(ValueError, match="--kl_loss_type"):
        kl_penalty(torch.zeros(1), torch.zeros(1), "k4")


# --- aggregation ----------------------------------------------------------------------------------

# loss_mat (N=2, T=3) = [[1, 2, 3], [4, 5, 6]], response_mask = [[1, 1, 0], [1, 0, 0]]
# masked = [[1, 2, 0], [4, 0, 0]], total 7, 3 tokens, per-sequence sums [3, 4], lengths [2, 1]
LOSS_MAT = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
MASK = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])


# each mode's loss with this micro-batch's own counts (3 tokens, 2 sequences) and with the
# mini-batch's, of which another micro-batch holds 3 more tokens and 2 more sequences
AGG_BY_HAND = {
    # token-mean: 7 / 3 tokens = 2.3333; global 7 / 6 = 1.1667
    "token-mean": (7 / 3, 7 / 6),
    # seq-mean-token-sum: (3 + 4) / 2 seqs = 3.5; with 4 seqs in the mini-batch 7 / 4 = 1.75
    "seq-mean-token-sum": (3.5, 1.75),
    # seq-mean-token-mean: (3/2 + 4/1) / 2 = 5.5 / 2 = 2.75; global 5.5 / 4 = 1.375
    "seq-mean-token-mean": (2.75, 1.375),
    # seq-mean-token-sum-norm (Dr.GRPO): 7 / (2 seqs * max_response_length 4) = 0.875, not the
    # padded length 3 of this micro-batch (7 / 6); global 7 / 16 = 0.4375
    "seq-mean-token-sum-norm": (0.875, 0.4375),
}


@pytest.mark.parametrize("mode", AGG_BY_HAND)
@pytest.mark.parametrize("agg_loss", having("agg_loss"))
def test_agg_loss_by_hand(agg_loss, mode):
    local, global_ = AGG_BY_HAND[mode]
    close(agg_loss(LOSS_MAT, MASK, mode, 3, 2, 4), local, atol=1e-6)
    close(agg_loss(LOSS_MAT, MASK, mode, 6, 4, 4), global_, atol=1e-6)
    garbage = torch.where(MASK.bool(), LOSS_MAT, torch.tensor(1e6))
    assert agg_loss(garbage, MASK, mode, 3, 2, 4) == agg_loss(LOSS_MAT, MASK, mode, 3, 2, 4)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("agg_loss", having("agg_loss"))
def test_agg_loss_with_global_denominators_adds_up_over_micro_batches(agg_loss, mode):
    # a mini-batch of 5 rows split 2 + 3: the two partial losses sum to the whole mini-batch's loss
    g = torch.Generator().manual_seed(0)
    loss_mat = torch.randn(5, 4, generator=g)
    # lengths 4, 1, 3, 0, 2
    mask = (torch.arange(4) < torch.tensor([[4], [1], [3], [0], [2]])).float()
    kw = dict(mode=mode, num_tokens=mask.sum(), num_seqs=5, max_response_length=4)
    whole = agg_loss(loss_mat, mask, **kw)
    parts = agg_loss(loss_mat[:2], mask[:2], **kw) + agg_loss(loss_mat[2:], mask[2:], **kw)
    close(parts, whole, atol=1e-6)


@pytest.mark.parametrize("agg_loss", having("agg_loss"))
def test_agg_loss_names_the_flag_on_a_bad_mode(agg_loss):
    with pytest.raises(ValueError, match="--loss_agg_mode 'token-sum'"):
        agg_loss(LOSS_MAT, MASK, "token-sum", 3, 2, 4)
