"""PPO: Proximal Policy Optimization with a learned critic (Schulman et al. 2017), as in verl.

Sample one response per prompt (or n), score it with a rule reward, and subtract beta * KL(pi_old ||
pi_ref) from every token's reward (Ziegler et al. 2019, eq. 2; beta fixed or adapted toward a target
KL, sec. 2.2). A critic, a value head on the same body, predicts each token's return; advantages are
GAE (Schulman et al. 2016, eq. 16) over the shaped rewards, whitened over the batch. The policy is
updated with the clipped surrogate (PPO eq. 7), the critic by clipped value regression (verl
/ PPO2's `cliprange_value`). Actor and critic keep separate optimizers and losses, so `--vf_coef`
only scales the critic's loss. Variants behind flags: an adaptive KL controller, the KL as a loss
term instead (`--use_kl_loss`), dual-clip (Ye et al. 2020), critic warm-up, and truncated importance
sampling from the engine's distribution to the trainer's (`--rollout_is`). Left out: reward models
(rule and user functions only), multi-turn rollouts, sequence parallelism, a shared actor-critic
body.

Run: torchrun --nproc_per_node=8 train_ppo.py --model Qwen/Qwen2.5-0.5B-Instruct
Shapes: B prompts, n samples per prompt, N = B*n sequences, T response tokens, V vocabulary.
"""

from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

import batches
import flags
import passes
import run
import sharding
from flags import flag
from metrics import Timer
from models import Model


@dataclass
class Args(flags.RunArgs):
    """PPO's flags, verl's names; the model, data, engine, memory, speed and trainer flags are
    flags.RunArgs'."""

    # the samples
    rollout_n: int = flag(1, "responses per prompt", ge=1)
    # the actor's update: PPO's clipped surrogate, the loss aggregation, the KL to the reference
    actor_lr: float = flag(1e-6, "AdamW learning rate", gt=0)
    weight_decay: float = flag(0.01, "AdamW weight decay", ge=0)
    grad_clip: float = flag(1.0, "max global gradient norm", gt=0)
    clip_ratio_low: float = flag(0.2, "ratio clipped below at 1 - this", ge=0, lt=1)
    clip_ratio_high: float = flag(0.2, "ratio clipped above at 1 + this (DAPO: 0.28)", ge=0)
    clip_ratio_c: float = flag(3.0, "dual-clip bound for negative advantages", gt=1)
    loss_agg_mode: str = flag(
        "token-mean",
        "token-mean | seq-mean-token-mean | seq-mean-token-sum | seq-mean-token-sum-norm",
    )
    entropy_coeff: float = flag(0.0, "entropy bonus")
    use_kl_loss: bool = flag(False, "KL to the reference model in the loss")
    kl_loss_coef: float | None = flag(None, "default 0.001 when use_kl_loss", ge=0)
    kl_loss_type: str = flag("low_var_kl", "k1 | k2 | k3 | low_var_kl | abs | mse")
    use_kl_in_reward: bool = flag(True, "subtract kl_coef * KL from the reward")
    kl_coef: float | None = flag(None, "default 0.001 when use_kl_in_reward", ge=0)
    kl_penalty: str = flag("kl", "KL-in-reward estimator: kl (= k1) | k2 | k3 | abs | mse")
    kl_ctrl_type: str = flag("fixed", "fixed | adaptive (Ziegler et al. 2019)")
    kl_target: float = flag(6.0, "adaptive: the KL the coefficient steers toward", gt=0)
    kl_horizon: int = flag(10000, "adaptive: sequences over which to correct", ge=1)
    # advantages (GAE)
    gamma: float = flag(1.0, "discount", ge=0, le=1)
    lam: float = flag(1.0, "GAE lambda", ge=0, le=1)
    # the critic: a value model on the policy's body, its own optimizer and memory flags
    critic_model: str | None = flag(None, "value model's body; default: --model")
    critic_lr: float = flag(1e-5, "critic AdamW learning rate (constant)", gt=0)
    critic_weight_decay: float = flag(0.01, "critic AdamW weight decay", ge=0)
    critic_warmup: int = flag(0, "first N steps train only the critic (verl's N+1)", ge=0)
    critic_ppo_micro_batch_size_per_gpu: int = flag(4, "sequences per critic forward", ge=1)
    critic_ppo_max_token_len_per_gpu: int | None = flag(None, "critic's token budget", ge=1)
    critic_grad_clip: float = flag(1.0, "critic's max global gradient norm", gt=0)
    cliprange_value: float = flag(0.5, "new values kept within old +- this", gt=0)
    vf_coef: float = flag(1.0, "scales the critic's loss (acts via --critic_grad_clip)", gt=0)
    critic_enable_gradient_checkpointing: bool = flag(False, "recompute activations")
    critic_param_offload: bool = flag(False, "critic params, grads and optimizer on CPU")
    critic_optimizer_offload: bool = flag(False, "critic optimizer state on CPU")
    # the quickstart's shape and cadence (flags.RunArgs' defaults are GRPO's)
    max_response_length: int = flags.default("max_response_length", 512)
    save_freq: int = flags.default("save_freq", 10)
    project_name: str = flags.default("project_name", "ppo")
    warm_compile_caches: bool = flag(
        False, "compile in a helper while step 1 runs eager; off: PPO's step 1 ends first"
    )

    # what verl's keys with no flag here mean to this script (cli.py; the flags' own keys are in
    # cli.VERL): the values that ask for what it does (None: any), and why
    VERL_SETTLED = {
        "algorithm.adv_estimator": (
            ("gae",),
            "this script is PPO, GAE (train_grpo.py: grpo)",
        ),
        "critic.strategy": (("fsdp", "fsdp2"), "training is FSDP2 here"),
    }


# --- math: pure tensor functions, no globals, no I/O ---------------------------------------------


def place_scores(scores, response_mask):
    """Each response's score on its last token, 0 elsewhere: scores (N,), response_mask (N, T) ->
    token-level scores (N, T), verl's token_level_scores. An outcome reward arrives with the token
    that ends the response."""
    last = (response_mask.sum(-1).long() - 1).clamp(min=0)
    placed = torch.zeros_like(response_mask)
    placed[torch.arange(len(scores)), last] = scores
    return placed


def compute_gae_advantage_return(
    token_level_rewards, values, response_mask, gamma, lam, whiten=True
):
    """Generalised advantage estimation (Schulman et al. 2016, eq. 16), backwards over response
    tokens:

      delta_t = r_t + gamma * V_{t+1} - V_t,   A_t = delta_t + gamma * lam * A_{t+1},
      returns_t = A_t + V_t

    with V and A zero after the last token. Then A is whitened over all response tokens of the
    batch: (A - mean) / sqrt(var + 1e-8), unbiased var (verl's masked_whiten); returns stay raw, the
    critic's target. Padding never leaks in: a masked position passes V_{t+1} and A_{t+1} through
    unchanged (verl's multi-turn form), so the last token sees V = 0 past the end whatever the
    padding holds. All tensors (N, T); returns advantages (N, T) and returns (N, T), zero on
    padding.
    """
    next_values = torch.zeros_like(values[:, 0])  # (N,)
    next_adv = torch.zeros_like(values[:, 0])
    advantages = torch.zeros_like(values)
    for t in reversed(range(values.shape[1])):
        m = response_mask[:, t]
        delta = token_level_rewards[:, t] + gamma * next_values - values[:, t]
        next_adv = m * (delta + gamma * lam * next_adv) + (1 - m) * next_adv
        next_values = m * values[:, t] + (1 - m) * next_values
        advantages[:, t] = next_adv
    returns = (advantages + values) * response_mask
    if whiten:
        valid = advantages[response_mask.bool()]
        advantages = (advantages - valid.mean()) * torch.rsqrt(valid.var() + 1e-8)
    return advantages * response_mask, returns


def agg_loss(loss_mat, response_mask, mode, num_tokens, num_seqs, max_response_length):
    """Aggregate a per-token loss (N, T) into a scalar, with *global* denominators.

    num_tokens / num_seqs count the whole mini-batch over all micro-batches and ranks, so splitting
    it differently leaves the gradient unchanged (torchtune / verl 0.5 use the same rule).
      token-mean:              sum_it l_it / num_tokens
      seq-mean-token-sum:      sum_i (sum_t l_it) / num_seqs
      seq-mean-token-mean:     sum_i (sum_t l_it / |y_i|) / num_seqs
      seq-mean-token-sum-norm: sum_it l_it / (num_seqs * max_response_length)   (Dr.GRPO)
    """
    masked = loss_mat * response_mask
    if mode == "token-mean":
        return masked.sum() / num_tokens
    if mode == "seq-mean-token-sum":
        return masked.sum() / num_seqs
    if mode == "seq-mean-token-mean":
        return (masked.sum(-1) / response_mask.sum(-1).clamp(min=1)).sum() / num_seqs
    if mode == "seq-mean-token-sum-norm":
        return masked.sum() / (num_seqs * max_response_length)
    raise ValueError(
        f"--loss_agg_mode {mode!r} is not one of token-mean, seq-mean-token-mean, "
        "seq-mean-token-sum, seq-mean-token-sum-norm"
    )


def compute_policy_loss(
    old_log_probs,
    log_probs,
    advantages,
    response_mask,
    clip_ratio_low,
    clip_ratio_high,
    clip_ratio_c,
    is_weights=None,
):
    """Per-token clipped surrogate loss (N, T), negated once, plus its statistics (sums over
    tokens).

    PPO eq. 7: L = -min(ratio * A, clip(ratio, 1 - eps_low, 1 + eps_high) * A), ratio = pi/pi_old;
    clip-higher uses eps_high > eps_low (DAPO eq. 10); for A < 0 the loss is further capped at
    -c * A (dual-clip, Ye et al. 2020 eq. 5), so a huge ratio on a bad token cannot blow up.
    Returns pg_losses (N, T) and sums over response tokens of: clipped (pg_clipfrac), dual-clipped
    (pg_clipfrac_lower) and -log_ratio (ppo_kl); the caller divides by the global token count.
    is_weights (N, T), if given (`rollout_is_weights`), multiply each token's loss.
    """
    log_ratio = (log_probs - old_log_probs).clamp(-20.0, 20.0)  # exp() overflows beyond this
    ratio = torch.exp(log_ratio)
    clipped_ratio = ratio.clamp(1 - clip_ratio_low, 1 + clip_ratio_high)
    surrogate = torch.min(ratio * advantages, clipped_ratio * advantages)
    dual = torch.max(surrogate, clip_ratio_c * advantages)  # only binds for A < 0
    objective = torch.where(advantages < 0, dual, surrogate)
    pg_losses = -objective if is_weights is None else -objective * is_weights
    mask = response_mask.bool()
    stats = {
        "pg_clipfrac": ((clipped_ratio * advantages < ratio * advantages) & mask).sum(),
        "pg_clipfrac_lower": (
            (surrogate < clip_ratio_c * advantages) & (advantages < 0) & mask
        ).sum(),
        "ppo_kl": (-log_ratio * response_mask).sum(),
    }
    return pg_losses, stats


def compute_value_loss(vpreds, values, returns, response_mask, cliprange_value):
    """Per-token clipped value loss (N, T) (PPO2's `cliprange_value`, as verl's compute_value_loss):

      vpredclipped = values + clip(vpreds - values, -c, c)
      vf_losses = 0.5 * max((vpreds - returns)^2, (vpredclipped - returns)^2)

    The max makes the loss pessimistic: a prediction may not move more than c from the old value to
    lower it. vpreds (new), values (old, from the same rollout), returns: (N, T). Returns vf_losses
    (N, T), which the caller aggregates with agg_loss as the policy's, and the sum over response
    tokens of vf_clipfrac (the clipped term was the larger one).
    """
    vpredclipped = values + (vpreds - values).clamp(-cliprange_value, cliprange_value)
    vf_losses1 = (vpreds - returns).square()
    vf_losses2 = (vpredclipped - returns).square()
    clipped = (vf_losses2 > vf_losses1) & response_mask.bool()
    return 0.5 * torch.max(vf_losses1, vf_losses2), {"vf_clipfrac": clipped.sum()}


def explained_variance(returns, values, response_mask):
    """1 - Var[returns - values] / Var[returns] over response tokens: 1 = the critic predicts the
    returns, 0 = no better than their mean (verl's critic/vf_explained_var, with its 1e-5)."""
    mask = response_mask.bool()
    return (1 - (returns - values)[mask].var() / (returns[mask].var() + 1e-5)).item()


def kl_penalty(log_probs, ref_log_probs, kl_type):
    """Per-token estimate of KL(pi || pi_ref) from samples of pi (Schulman 2020, "Approximating
    KL").

    k1 = log r, k2 (mse) = (log r)^2 / 2, k3 (low_var_kl) = r' - 1 - log r' with r' = pi_ref / pi
    (unbiased and always >= 0), abs = |log r|, where log r = log pi - log pi_ref. k3 is clamped
    to [-10, 10] as in verl, against rare huge ratios.
    """
    log_ratio = log_probs - ref_log_probs
    if kl_type in ("k1", "kl"):  # "kl" is verl's name for k1 in its kl_penalty
        return log_ratio
    if kl_type == "abs":
        return log_ratio.abs()
    if kl_type in ("k2", "mse"):
        return 0.5 * log_ratio.square()
    if kl_type in ("k3", "low_var_kl"):
        neg = (-log_ratio).clamp(-20.0, 20.0)
        return (neg.exp() - neg - 1).clamp(-10.0, 10.0)
    raise ValueError(f"--kl_loss_type {kl_type!r} is not one of k1, k2, k3, low_var_kl, abs, mse")


def adaptive_kl_coef(beta, current_kl, n_steps, target, horizon):
    """The adaptive KL controller (Ziegler et al. 2019, sec. 2.2; verl's AdaptiveKLController)
    steers beta toward a target KL; with --kl_ctrl_type fixed, beta stays as it is:

      e = clip(KL / target - 1, -0.2, 0.2),   beta <- beta * (1 + e * n_steps / horizon)

    n_steps: sequences in the batch that measured KL (verl passes the batch size).
    """
    proportional_error = min(max(current_kl / target - 1, -0.2), 0.2)
    return beta * (1 + proportional_error * n_steps / horizon)


def apply_kl_penalty(
    token_level_scores, old_log_probs, ref_log_probs, response_mask, beta, kl_type
):
    """r_t = score_t - beta * KL_t (Ziegler et al. 2019, eq. 2), KL_t an estimate of KL(pi_old
    || pi_ref).

    token_level_scores (N, T) holds each score on its last response token. Returns
    token_level_rewards (N, T) and the batch's KL as verl feeds its controller: the per-sequence
    mean over response tokens, averaged over sequences (adaptive_kl_coef's input).
    """
    kl = kl_penalty(old_log_probs, ref_log_probs, kl_type) * response_mask  # (N, T)
    current_kl = (kl.sum(-1) / response_mask.sum(-1).clamp(min=1)).mean().item()
    return token_level_scores - beta * kl, current_kl


# --- the updates ---------------------------------------------------------------------------------


def update_actor(
    actor,
    optimizer,
    samples,
    old_log_probs,
    ref_log_probs,
    advantages,
    response_mask,
    args,
    step,
    device,
    is_weights=None,
):
    """PPO-style update of the policy on a rank's share of the batch; returns actor/* metrics."""
    # train mode for the update only, as verl: Hugging Face's gradient checkpointing (and dropout,
    # where a model has any) act only in it; the log-prob passes and validation run in eval mode
    actor.train()
    if args.optimizer_offload:  # AdamW's state on the GPU for the update only
        sharding.move_optimizer_state(optimizer, device)
    world = dist.get_world_size()
    mini = args.ppo_mini_batch_size * args.rollout_n // world  # sequences a rank, an optimizer step
    micro = args.ppo_micro_batch_size_per_gpu
    budget = args.ppo_max_token_len_per_gpu if args.use_dynamic_bsz else None
    clip = args.clip_ratio_low, args.clip_ratio_high, args.clip_ratio_c
    # running sums stay on the device: an .item() per micro-batch would stall the GPU each time
    names = ["pg_loss", "pg_clipfrac", "pg_clipfrac_lower", "ppo_kl"]
    # as verl: no actor/kl_loss without the term (a 0 would read as no drift)
    names += ["kl_loss"] if ref_log_probs is not None else []
    sums = {k: torch.zeros((), device=device) for k in names}
    grad_norms = []
    for _ in range(args.ppo_epochs):
        for start in range(0, len(samples), mini):
            stop = min(start + mini, len(samples))  # the last mini-batch may be smaller, as in verl
            tokens = sharding.all_sum(response_mask[start:stop].sum().item(), device=device)[0]
            # agg_loss's mode and global denominators: all micro-batches and ranks of the mini-batch
            agg = args.loss_agg_mode, tokens, (stop - start) * world, args.max_response_length
            mini_loss = torch.zeros((), device=device)
            for idx in passes.micro_batches(samples[start:stop], micro, budget):
                mb = [start + i for i in idx]
                log_probs, entropy = passes.policy_forward(
                    actor, [samples[i] for i in mb], args, with_entropy=args.entropy_coeff != 0
                )
                Tm = log_probs.shape[1]
                mask, adv, old = response_mask[mb, :Tm], advantages[mb, :Tm], old_log_probs[mb, :Tm]
                w = None if is_weights is None else is_weights[mb, :Tm]
                pg_losses, stats = compute_policy_loss(old, log_probs, adv, mask, *clip, w)
                pg_loss = agg_loss(pg_losses, mask, *agg)
                loss = pg_loss
                if args.entropy_coeff:
                    loss = loss - args.entropy_coeff * agg_loss(entropy, mask, *agg)
                if ref_log_probs is not None:
                    kl = kl_penalty(log_probs, ref_log_probs[mb, :Tm], args.kl_loss_type)
                    kl_loss = agg_loss(kl, mask, *agg)
                    loss = loss + args.kl_loss_coef * kl_loss
                    sums["kl_loss"] += kl_loss.detach()
                # FSDP2 averages gradients over ranks; the loss is already a global mean: undo that
                (loss * world).backward()
                mini_loss += loss.detach()
                sums["pg_loss"] += pg_loss.detach()
                for k, v in stats.items():
                    sums[k] += v / tokens
            norm = passes.clip_and_step(
                actor, optimizer, mini_loss, args.grad_clip, step, "--actor_lr"
            )
            grad_norms.append(norm)
    totals = sharding.all_sum(*(v.item() for v in sums.values()), device=device)
    metrics = {f"actor/{k}": v / len(grad_norms) for k, v in zip(sums, totals)}
    metrics["actor/grad_norm"] = float(np.mean(grad_norms))
    if args.optimizer_offload:
        sharding.move_optimizer_state(optimizer, "cpu")
    actor.eval()
    return metrics


def update_critic(critic, optimizer, samples, values, returns, response_mask, args, step, device):
    """Clipped value regression on a rank's share of the batch, over the actor's mini-batches;
    returns critic/* metrics."""
    # train mode for the update only, as the actor's: gradient checkpointing acts only in it
    critic.train()
    if args.critic_optimizer_offload:  # AdamW's state on the GPU for the update only
        sharding.move_optimizer_state(optimizer, device)
    world = dist.get_world_size()
    mini = args.ppo_mini_batch_size * args.rollout_n // world  # sequences a rank, an optimizer step
    micro = args.critic_ppo_micro_batch_size_per_gpu
    budget = args.critic_ppo_max_token_len_per_gpu if args.use_dynamic_bsz else None
    sums = {k: torch.zeros((), device=device) for k in ("vf_loss", "vf_clipfrac", "vpred_mean")}
    grad_norms = []
    for _ in range(args.ppo_epochs):
        for start in range(0, len(samples), mini):
            stop = min(start + mini, len(samples))  # the last mini-batch may be smaller, as in verl
            tokens = sharding.all_sum(response_mask[start:stop].sum().item(), device=device)[0]
            # agg_loss's mode and global denominators: all micro-batches and ranks of the mini-batch
            agg = args.loss_agg_mode, tokens, (stop - start) * world, args.max_response_length
            mini_loss = torch.zeros((), device=device)
            for idx in passes.micro_batches(samples[start:stop], micro, budget):
                mb = [start + i for i in idx]
                packed = args.use_remove_padding
                vpreds = passes.forward_values(critic, [samples[i] for i in mb], packed)
                Tm = vpreds.shape[1]
                mask, old, ret = response_mask[mb, :Tm], values[mb, :Tm], returns[mb, :Tm]
                vf_losses, stats = compute_value_loss(vpreds, old, ret, mask, args.cliprange_value)
                vf_loss = agg_loss(vf_losses, mask, *agg)
                loss = args.vf_coef * vf_loss
                (loss * world).backward()  # FSDP2 averages over ranks; the loss is a global mean
                mini_loss += loss.detach()
                sums["vf_loss"] += vf_loss.detach()
                sums["vf_clipfrac"] += stats["vf_clipfrac"] / tokens
                sums["vpred_mean"] += (vpreds.detach() * mask).sum() / tokens
            norm = passes.clip_and_step(
                critic, optimizer, mini_loss, args.critic_grad_clip, step, "--critic_lr"
            )
            grad_norms.append(norm)
    totals = sharding.all_sum(*(v.item() for v in sums.values()), device=device)
    metrics = {f"critic/{k}": v / len(grad_norms) for k, v in zip(sums, totals)}
    metrics["critic/grad_norm"] = float(np.mean(grad_norms))
    if args.critic_optimizer_offload:
        sharding.move_optimizer_state(optimizer, "cpu")
    critic.eval()
    return metrics


# --- the run ------------------------------------------------------------------------------------


def check_args(args, world_size):
    """Fail at start-up, naming the flag, before anything heavy loads (the shared flags:
    flags.check_args); fill in the defaults that depend on other flags."""
    flags.check_args(args, world_size)
    need = flags.need
    need(
        args.kl_loss_coef is None or args.use_kl_loss,
        "--kl_loss_coef is set but --use_kl_loss is false",
    )
    need(
        args.kl_coef is None or args.use_kl_in_reward,
        "--kl_coef is set but --use_kl_in_reward is false",
    )
    need(args.kl_ctrl_type in ("fixed", "adaptive"), "--kl_ctrl_type must be fixed or adaptive")
    need(
        args.kl_penalty in ("kl", "k1", "k2", "k3", "low_var_kl", "abs", "mse"),
        "--kl_penalty must be kl (= k1), k2, k3, low_var_kl, abs or mse",
    )
    agg_loss(
        torch.zeros(1, 1), torch.ones(1, 1), args.loss_agg_mode, 1, 1, 1
    )  # raises on a bad mode
    kl_penalty(torch.zeros(1), torch.zeros(1), args.kl_loss_type)  # likewise
    args.critic_optimizer_offload &= not args.critic_param_offload
    args.kl_loss_coef = 0.001 if args.kl_loss_coef is None else args.kl_loss_coef
    args.kl_coef = 0.001 if args.kl_coef is None else args.kl_coef
    args.critic_model = args.critic_model or args.model


def models(args):
    """The models this run holds, for the support code to load, plan memory for and compile ahead:
    the actor (trained), the reference (frozen, where a KL term needs it) and the critic (a value
    model, trained, with its own memory flags and micro-batches)."""
    kl = args.use_kl_loss or args.use_kl_in_reward
    critic = ("critic_ppo_micro_batch_size_per_gpu", "critic_ppo_max_token_len_per_gpu")
    return [
        Model(
            "actor",
            args.model,
            "old_log_prob",
            param_offload="param_offload",
            optimizer_offload="optimizer_offload",
            gradient_checkpointing="enable_gradient_checkpointing",
            entropy=args.entropy_coeff != 0,
        ),
        Model("ref", args.model, "ref", trained=False, param_offload="ref_param_offload")
        if kl
        else None,
        Model(
            "critic",
            args.critic_model,
            "values",
            value=True,
            param_offload="critic_param_offload",
            optimizer_offload="critic_optimizer_offload",
            gradient_checkpointing="critic_enable_gradient_checkpointing",
            passes=critic,
            update=critic,
        ),
    ]


def main(args):
    r = run.start(args, check_args, models)  # process group, flags, reward, data, memory plan
    device, world, n = r.device, r.world, args.rollout_n
    actor, ref = r.load("actor"), r.load("ref")  # FSDP2-sharded; ref None without a KL term
    optimizer = torch.optim.AdamW(actor.parameters(), args.actor_lr, weight_decay=args.weight_decay)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, run.lr_lambda(args, r.total_steps))
    optimizers, schedulers = {"actor": optimizer}, {"actor": scheduler}
    critic = r.load("critic")  # with an optimizer of its own (None with --val_only)
    if critic is not None:
        wd = args.critic_weight_decay
        critic_optimizer = torch.optim.AdamW(critic.parameters(), args.critic_lr, weight_decay=wd)
        critic_scheduler = torch.optim.lr_scheduler.LambdaLR(critic_optimizer, lambda _: 1.0)
        optimizers["critic"], schedulers["critic"] = critic_optimizer, critic_scheduler
    state = r.resume(optimizers, schedulers)
    if state is None:  # that run has finished its steps
        return
    beta = state.get("kl_coef", args.kl_coef)  # the KL-in-reward coefficient, adapted or not
    engine = r.make_engine()  # the engine, which generates with the actor's weights
    r.engine_ready(engine, actor)
    if args.val_only:
        return r.validate_only()
    source = batches.Batches(r, engine, actor, state)

    for step in range(r.step + 1, r.total_steps + 1):
        metrics, timer = {}, Timer({}, device, engine)
        with timer("step"):
            # 1 generate: the engine (awake, with the latest weights) samples n responses a prompt
            # 2 score: a rule or your reward per response; this rank's share of them as tensors
            batch = source.next(step, timer)
            samples, response_mask = batch.samples, batch.response_mask  # N/world; (N/world, T)
            T = response_mask.shape[1]

            # 3 old and reference log-probs, recomputed by the FSDP2 actor (the engine's are a
            # check); the policy's entropy as verl reports it, from the old pass
            with timer("old_log_prob"):
                old_log_probs, entropy = passes.log_prob_pass(
                    actor, samples, T, args, with_entropy=True
                )
                n_tokens = sharding.all_sum(response_mask.sum().item(), device=device)[0]
                agg = args.loss_agg_mode, n_tokens, len(samples) * world, args.max_response_length
                entropy = agg_loss(entropy, response_mask, *agg).item()
                metrics["actor/entropy"] = sharding.all_sum(entropy, device=device)[0]
            # --rollout_is: weights from the engine's sampling distribution to the trainer's
            is_weights, is_metrics = batches.importance_weights(old_log_probs, batch, args, device)
            metrics |= is_metrics
            if ref is not None:
                with timer("ref"):
                    ref_log_probs, _ = passes.log_prob_pass(ref, samples, T, args)

            # 3b values: the critic's estimate of each token's return, before its update
            with timer("values"):
                micro = args.critic_ppo_micro_batch_size_per_gpu
                budget = args.critic_ppo_max_token_len_per_gpu
                values = passes.value_pass(critic, samples, T, args, micro, budget)

            # 4 advantages: the score sits on the last response token; KL-in-reward subtracts
            # beta * KL on every token, then GAE. Over the whole batch, gathered on every rank: the
            # controller's KL and the whitening are batch statistics (as in verl).
            with timer("adv"):
                scores = place_scores(batch.scores, response_mask)  # (N/world, T)
                kl_terms = (old_log_probs, ref_log_probs) if args.use_kl_in_reward else ()
                gathered = sharding.gather_rows(scores, values, response_mask, *kl_terms)
                all_scores, all_values, all_mask, *all_log_probs = gathered  # (N, T_max)
                all_rewards = all_scores
                if args.use_kl_in_reward:
                    metrics["actor/reward_kl_penalty_coeff"] = beta  # this step's
                    all_rewards, kl = apply_kl_penalty(
                        all_scores, *all_log_probs, all_mask, beta, args.kl_penalty
                    )
                    metrics["actor/reward_kl_penalty"] = kl
                    if args.kl_ctrl_type == "adaptive":
                        beta = adaptive_kl_coef(
                            beta, kl, len(all_mask), args.kl_target, args.kl_horizon
                        )
                gae = compute_gae_advantage_return(
                    all_rewards, all_values, all_mask, args.gamma, args.lam
                )
                metrics["critic/vf_explained_var"] = explained_variance(
                    gae[1], all_values, all_mask
                )
                mine = slice(r.rank * len(samples), (r.rank + 1) * len(samples))  # this rank's rows
                token_level_rewards, advantages, returns = (
                    x[mine, :T] for x in (all_rewards, *gae)
                )

            # 5a update the critic: clipped regression of the values toward the returns
            with timer("update_critic"):
                metrics["critic/lr"] = critic_scheduler.get_last_lr()[0]
                metrics |= update_critic(
                    critic=critic,
                    optimizer=critic_optimizer,
                    samples=samples,
                    values=values,
                    returns=returns,
                    response_mask=response_mask,
                    args=args,
                    step=step,
                    device=device,
                )
                critic_scheduler.step()

            # 5b update the actor once the critic has warmed up (no actor MFU before: no update):
            # mini-batches x epochs, micro-batch gradients accumulated, a global mean
            if step > args.critic_warmup:
                with timer("update_actor"):
                    metrics["actor/lr"] = scheduler.get_last_lr()[0]  # this update's rate
                    metrics |= update_actor(
                        actor=actor,
                        optimizer=optimizer,
                        samples=samples,
                        old_log_probs=old_log_probs,
                        ref_log_probs=ref_log_probs if args.use_kl_loss else None,  # the KL loss's
                        advantages=advantages,
                        response_mask=response_mask,
                        args=args,
                        step=step,
                        device=device,
                        is_weights=is_weights,
                    )
                    scheduler.step()

            # 6 push the new weights into the engine: FSDP2 shards -> full tensors -> vLLM's loaders
            optimizer.zero_grad(set_to_none=True)
            source.push_weights(timer)

        # 7 log, validate, save
        rewards = sharding.all_sum(token_level_rewards.sum().item(), device=device)[0]
        metrics["critic/rewards/mean"] = rewards / (len(batch.groups) * n)  # per sequence
        for name, x in (("advantages", advantages), ("values", values), ("returns", returns)):
            metrics[f"critic/{name}/mean"] = sharding.masked_mean(x, response_mask, n_tokens)
        if r.end_step(step, metrics, timer, batch, old_log_probs, source, {"kl_coef": beta}):
            break
    return r.finish(step, metrics, actor, source)


if __name__ == "__main__":
    run.launch(main, Args)
