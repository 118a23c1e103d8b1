"""GRPO: Group Relative Policy Optimization (Shao et al. 2024, DeepSeekMath, eq. 3), as in verl.

For each prompt, sample a group of n responses, score them with a rule reward, and use each
response's score standardised within its group as the advantage of all of its tokens (eq. 3's
outcome supervision). The policy is updated with PPO's clipped surrogate (Schulman et al. 2017,
eq. 7) plus a KL penalty to a frozen reference model added to the loss (verl's `use_kl_loss`,
k3 = `low_var_kl` by default). No critic. Variants behind flags: Dr.GRPO (Liu et al. 2025,
`--norm_adv_by_std_in_grpo false`, `--loss_agg_mode seq-mean-token-sum-norm`), DAPO's
clip-higher and dynamic sampling (Yu et al. 2025, `--clip_ratio_high`, `--filter_groups`,
`--gen_batch_size`), GRESO's selective rollout (Zheng et al. 2025, `--skip_all_equal`), dual-clip
(Ye et al. 2020, `--clip_ratio_c`) and truncated importance sampling from the engine's distribution
to the trainer's (`--rollout_is`). Left out: reward models (rule and user functions only),
multi-turn rollouts, sequence parallelism.

Run: torchrun --nproc_per_node=8 train_grpo.py --model Qwen/Qwen2.5-0.5B-Instruct
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
    """GRPO's flags, verl's names; the model, data, engine, memory, speed and trainer flags are
    flags.RunArgs'."""

    # the update: PPO's clipped surrogate, the loss aggregation, the KL to the reference
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
    norm_adv_by_std_in_grpo: bool = flag(True, "false = Dr.GRPO")
    entropy_coeff: float = flag(0.0, "entropy bonus")
    use_kl_loss: bool = flag(True, "KL to the reference model in the loss")
    kl_loss_coef: float | None = flag(None, "default 0.001 when use_kl_loss", ge=0)
    kl_loss_type: str = flag("low_var_kl", "k1 | k2 | k3 | low_var_kl | abs | mse")
    use_kl_in_reward: bool = flag(False, "subtract kl_coef * KL from the reward")
    kl_coef: float | None = flag(None, "default 0.001 when use_kl_in_reward", ge=0)

    # what verl's keys with no flag here mean to this script (cli.py; the flags' own keys are in
    # cli.VERL): the values that ask for what it does (None: any), and why
    VERL_SETTLED = {
        "algorithm.adv_estimator": (("grpo",), "this script is GRPO (train_ppo.py: gae)"),
        "critic.": (None, "this script has no critic"),
        "trainer.critic_warmup": (None, "this script has no critic"),
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


def compute_grpo_outcome_advantage(scores, response_mask, n, norm_adv_by_std=True, eps=1e-6):
    """A_i = (r_i - mean(r_group)) / (std(r_group) + eps) for every token of response i.

    DeepSeekMath eq. 3 (outcome supervision); without the std division it is Dr.GRPO (Liu et al.
    2025, sec. 3.1). Consecutive rows form a group: scores (N,) with N = B*n, response_mask (N, T).
    std is the unbiased sample std, as in verl. Returns advantages (N, T), zero on padding.
    """
    grouped = scores.view(-1, n)  # (B, n)
    adv = grouped - grouped.mean(-1, keepdim=True)
    if norm_adv_by_std:
        adv = adv / (grouped.std(-1, keepdim=True) + eps)
    return adv.reshape(-1, 1) * response_mask


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


# --- the update ----------------------------------------------------------------------------------


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


# --- the run ------------------------------------------------------------------------------------


def check_args(args, world_size):
    """Fail at start-up, naming the flag, before anything heavy loads (the shared flags:
    flags.check_args); fill in the defaults that depend on other flags."""
    flags.check_args(args, world_size)
    need = flags.need
    need(args.rollout_n > 1, "--rollout_n must be > 1: GRPO compares responses within a group")
    need(
        args.kl_loss_coef is None or args.use_kl_loss,
        "--kl_loss_coef is set but --use_kl_loss is false",
    )
    need(
        args.kl_coef is None or args.use_kl_in_reward,
        "--kl_coef is set but --use_kl_in_reward is false",
    )
    agg_loss(
        torch.zeros(1, 1), torch.ones(1, 1), args.loss_agg_mode, 1, 1, 1
    )  # raises on a bad mode
    kl_penalty(torch.zeros(1), torch.zeros(1), args.kl_loss_type)  # likewise
    args.kl_loss_coef = 0.001 if args.kl_loss_coef is None else args.kl_loss_coef
    args.kl_coef = 0.001 if args.kl_coef is None else args.kl_coef


def models(args):
    """The models this run holds, for the support code to load, plan memory for and compile ahead:
    the actor (trained) and, where a KL term needs it, the reference (frozen)."""
    kl = args.use_kl_loss or args.use_kl_in_reward
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
    ]


def main(args):
    r = run.start(args, check_args, models)  # process group, flags, reward, data, memory plan
    device, world, n = r.device, r.world, args.rollout_n
    actor, ref = r.load("actor"), r.load("ref")  # FSDP2-sharded; ref None without a KL term
    optimizer = torch.optim.AdamW(actor.parameters(), args.actor_lr, weight_decay=args.weight_decay)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, run.lr_lambda(args, r.total_steps))
    state = r.resume({"actor": optimizer}, {"actor": scheduler})
    if state is None:  # that run has finished its steps
        return
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

            # 4 advantages: the score sits on the last response token; KL-in-reward spreads
            # -kl_coef * KL over the tokens
            with timer("adv"):
                token_level_rewards = place_scores(batch.scores, response_mask)  # (N/world, T)
                if args.use_kl_in_reward:
                    kl = kl_penalty(old_log_probs, ref_log_probs, "k1") * response_mask
                    token_level_rewards = token_level_rewards - args.kl_coef * kl
                    metrics["actor/reward_kl_penalty"] = sharding.masked_mean(
                        kl, response_mask, n_tokens
                    )
                scores = token_level_rewards.sum(-1)  # (N/world,)
                norm = args.norm_adv_by_std_in_grpo
                advantages = compute_grpo_outcome_advantage(scores, response_mask, n, norm)

            # 5 update: mini-batches x epochs, micro-batch gradients accumulated, a global mean
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
        metrics["critic/advantages/mean"] = sharding.masked_mean(
            advantages, response_mask, n_tokens
        )
        if r.end_step(step, metrics, timer, batch, old_log_probs, source):
            break
    return r.finish(step, metrics, actor, source)


if __name__ == "__main__":
    run.launch(main, Args)
