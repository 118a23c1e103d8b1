"""GRPO: Group Relative Policy Optimization (Shao et al. 2024, DeepSeekMath, eq. 3), as verl runs it.

For each prompt, sample a group of n responses, score them with a rule reward, and use each
response's score standardised within its group as the advantage of all of its tokens (eq. 3's
outcome supervision). The policy is updated with PPO's clipped surrogate (Schulman et al. 2017,
eq. 7) plus a KL penalty to a frozen reference model added to the loss (verl's `use_kl_loss`,
k3 = `low_var_kl` by default). No critic. Variants behind flags: Dr.GRPO (Liu et al. 2025,
`--norm_adv_by_std_in_grpo false`, `--loss_agg_mode seq-mean-token-sum-norm`), DAPO's
clip-higher and dynamic sampling (Yu et al. 2025, `--clip_ratio_high`, `--filter_groups`,
`--gen_batch_size`), GRESO's selective rollout (Zheng et al. 2025, `--skip_all_equal`), dual-clip
(Ye et al. 2020, `--clip_ratio_c`) and truncated importance sampling from the engine's distribution to the
trainer's (`--rollout_is`). Left out: reward models
(rule and user functions only), multi-turn rollouts, sequence parallelism.

Run: torchrun --nproc_per_node=8 train_grpo.py --model Qwen/Qwen2.5-0.5B-Instruct
Shapes: B prompts, n samples per prompt, N = B*n sequences, T response tokens, V vocabulary.
"""

from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

import batches
import run
import sharding
from run import flag


@dataclass
class Args(run.RunArgs):
    """GRPO's flags, verl's names; the model, data, engine, memory, speed and trainer flags are run.RunArgs'."""

    # the group
    rollout_n: int = flag(5, "responses per prompt (the group size)")
    # the update: PPO's clipped surrogate, the loss aggregation, the KL to the reference
    ppo_mini_batch_size: int = flag(64, "prompts per optimizer step (x rollout_n inside)")
    ppo_epochs: int = flag(1, "passes over each batch")
    actor_lr: float = flag(1e-6, "AdamW learning rate")
    weight_decay: float = flag(0.01, "AdamW weight decay")
    grad_clip: float = flag(1.0, "max global gradient norm")
    clip_ratio_low: float = flag(0.2, "ratio clipped below at 1 - this")
    clip_ratio_high: float = flag(0.2, "ratio clipped above at 1 + this (DAPO: 0.28)")
    clip_ratio_c: float = flag(3.0, "dual-clip bound for negative advantages")
    loss_agg_mode: str = flag("token-mean", "token-mean | seq-mean-token-mean | seq-mean-token-sum | seq-mean-token-sum-norm")
    norm_adv_by_std_in_grpo: bool = flag(True, "false = Dr.GRPO")
    entropy_coeff: float = flag(0.0, "entropy bonus")
    use_kl_loss: bool = flag(True, "KL to the reference model in the loss")
    kl_loss_coef: float | None = flag(None, "default 0.001 when use_kl_loss")
    kl_loss_type: str = flag("low_var_kl", "k1 | k2 | k3 | low_var_kl | abs | mse")
    use_kl_in_reward: bool = flag(False, "subtract kl_coef * KL from the reward")
    kl_coef: float | None = flag(None, "default 0.001 when use_kl_in_reward")
    # a step's batch: DAPO's dynamic sampling, GRESO's skip, one-step off-policy generation (batches.py)
    filter_groups: bool = flag(False, "DAPO dynamic sampling: drop all-equal groups")
    max_num_gen_batches: int = flag(10, "filter_groups: generation rounds per step at most; 0: no limit (verl's meaning)")
    gen_batch_size: int = flag(
        0,
        "filter_groups: prompts a generation round takes at most (DAPO: 3 x train_batch_size); "
        "0: train_batch_size",
    )
    filter_groups_from_step: int = flag(
        1,
        "filter_groups: the first step that filters; the steps before it train on one batch as generated "
        "(while the reward is still 0 almost everywhere, too few groups vary to fill a batch)",
    )
    skip_all_equal: bool = flag(
        False,
        "filter_groups: GRESO's selective rollout: on filtering steps, skip before generating a prompt "
        "whose latest group scored all-equal (the filter would likely drop its group again)",
    )
    skip_explore_prob: float = flag(
        0.5,
        "skip_all_equal: a prompt whose last z groups in a row scored all-equal is generated anyway "
        "with probability P**z",
    )
    one_step_off_policy: bool = flag(
        False,
        "generate the next step's batch in a second thread while this step trains, with the weights from "
        "before this step's update (one-step off-policy, as verl's recipe of that name). The engine stays "
        "awake: give it less memory (--gpu_memory_utilization 0.3 on an H200). Measured on one H200 with a "
        "0.5B model: steps 7-13% shorter (the two share the GPU and the Python interpreter, so each ran "
        "slower), and in one learning run lower accuracy by step and by minute (docs/benchmarks.md)",
    )


# --- math: pure tensor functions, no globals, no I/O ---------------------------------------------


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
    raise ValueError(f"--loss_agg_mode {mode!r} is not one of token-mean, seq-mean-token-mean, "
                     "seq-mean-token-sum, seq-mean-token-sum-norm")


def compute_policy_loss(old_log_probs, log_probs, advantages, response_mask, clip_ratio_low, clip_ratio_high,
                        clip_ratio_c, is_weights=None):
    """Per-token clipped surrogate loss (N, T), negated once, plus its statistics (sums over tokens).

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
        "pg_clipfrac_lower": ((surrogate < clip_ratio_c * advantages) & (advantages < 0) & mask).sum(),
        "ppo_kl": (-log_ratio * response_mask).sum(),
    }
    return pg_losses, stats


def kl_penalty(log_probs, ref_log_probs, kl_type):
    """Per-token estimate of KL(pi || pi_ref) from samples of pi (Schulman 2020, "Approximating KL").

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


def update_actor(actor, optimizer, samples, old_log_probs, ref_log_probs, advantages, response_mask, args, step,
                 device, is_weights=None):
    """PPO-style update of the policy on a rank's share of the batch; returns actor/* metrics."""
    # train mode for the update only, as verl: Hugging Face's gradient checkpointing (and dropout, where a
    # model has any) act only in it; the log-prob passes and validation run in eval mode
    actor.train()
    world = dist.get_world_size()
    mini = args.ppo_mini_batch_size * args.rollout_n // world  # sequences per rank per optimizer step
    micro = args.ppo_micro_batch_size_per_gpu
    max_tokens = args.ppo_max_token_len_per_gpu if args.use_dynamic_bsz else None
    # running sums stay on the device: an .item() per micro-batch would stall the GPU each time
    names = ["pg_loss", "pg_clipfrac", "pg_clipfrac_lower", "ppo_kl"]
    if ref_log_probs is not None:  # as verl: no actor/kl_loss without the term (a 0 would read as no drift)
        names.append("kl_loss")
    sums = {k: torch.zeros((), device=device) for k in names}
    grad_norms, n_updates = [], 0
    for _ in range(args.ppo_epochs):
        for start in range(0, len(samples), mini):
            stop = min(start + mini, len(samples))  # the last mini-batch may be smaller, as in verl
            tokens = sharding.all_sum(response_mask[start:stop].sum().item(), device=device)[0]
            seqs = (stop - start) * world
            mini_loss = torch.zeros((), device=device)
            for idx in sharding.micro_batches(samples[start:stop], micro, max_tokens):
                mb = [start + i for i in idx]
                log_probs, entropy = sharding.forward_log_probs(actor, [samples[i] for i in mb], args.temperature,
                                                       args.use_remove_padding, with_entropy=args.entropy_coeff != 0,
                                                       fused=args.use_fused_kernels)
                Tm = log_probs.shape[1]
                mask, adv, old = response_mask[mb, :Tm], advantages[mb, :Tm], old_log_probs[mb, :Tm]
                agg = dict(response_mask=mask, mode=args.loss_agg_mode, num_tokens=tokens, num_seqs=seqs,
                           max_response_length=args.max_response_length)
                pg_losses, stats = compute_policy_loss(old, log_probs, adv, mask, args.clip_ratio_low,
                                                       args.clip_ratio_high, args.clip_ratio_c,
                                                       None if is_weights is None else is_weights[mb, :Tm])
                pg_loss = agg_loss(pg_losses, **agg)
                loss = pg_loss - args.entropy_coeff * agg_loss(entropy, **agg) if args.entropy_coeff else pg_loss
                if ref_log_probs is not None:
                    kl_loss = agg_loss(kl_penalty(log_probs, ref_log_probs[mb, :Tm], args.kl_loss_type), **agg)
                    loss = loss + args.kl_loss_coef * kl_loss
                    sums["kl_loss"] += kl_loss.detach()
                # FSDP2 averages gradients over ranks; the loss is already a global mean, so undo that.
                (loss * world).backward()
                mini_loss += loss.detach()
                sums["pg_loss"] += pg_loss.detach()
                for k, v in stats.items():
                    sums[k] += v / tokens
            if not torch.isfinite(mini_loss):
                raise FloatingPointError(f"step {step}: non-finite loss {mini_loss.item()}; stopping before the update "
                                         "(the last checkpoint is untouched). Lower --actor_lr or check the data.")
            grad_norms.append(sharding.clip_and_step(actor, optimizer, args.grad_clip, step, "--actor_lr"))
            n_updates += 1
    totals = sharding.all_sum(*(v.item() for v in sums.values()), device=device)
    metrics = {f"actor/{k}": v / n_updates for k, v in zip(sums, totals)}
    metrics["actor/grad_norm"] = float(np.mean(grad_norms))
    actor.eval()
    return metrics


# --- the run ------------------------------------------------------------------------------------


def check_args(args, world_size):
    """Fail at start-up, naming the flags, before anything heavy loads (run.check_args: the shared flags)."""
    run.check_args(args, world_size)
    need = run.need
    need(args.rollout_n > 1, "--rollout_n must be > 1: GRPO compares responses within a group")
    need(args.ppo_mini_batch_size <= args.train_batch_size,
         f"--ppo_mini_batch_size {args.ppo_mini_batch_size} must not exceed --train_batch_size {args.train_batch_size}")
    need(args.ppo_mini_batch_size * args.rollout_n % world_size == 0,
         f"--ppo_mini_batch_size x --rollout_n ({args.ppo_mini_batch_size * args.rollout_n}) must be divisible by "
         f"the number of GPUs {world_size}")
    need(args.kl_loss_coef is None or args.use_kl_loss, "--kl_loss_coef is set but --use_kl_loss is false")
    need(args.kl_coef is None or args.use_kl_in_reward, "--kl_coef is set but --use_kl_in_reward is false")
    need(args.gen_batch_size in (0, args.train_batch_size) or args.filter_groups,
         "--gen_batch_size only applies with --filter_groups: without it a step trains on every prompt it generates")
    need(args.filter_groups_from_step == 1 or args.filter_groups,
         "--filter_groups_from_step only applies with --filter_groups")
    need(args.filter_groups_from_step >= 1, f"--filter_groups_from_step {args.filter_groups_from_step} must be >= 1")
    need(not args.skip_all_equal or args.filter_groups,
         "--skip_all_equal only applies with --filter_groups: it skips the prompts the filter would drop")
    need(0 < args.skip_explore_prob <= 1, f"--skip_explore_prob {args.skip_explore_prob} must be in (0, 1]: at 0 "
         "a prompt once all-equal would never be generated again")
    need(args.gen_batch_size >= 0 and args.gen_batch_size % world_size == 0,
         f"--gen_batch_size {args.gen_batch_size} must be 0 or a multiple of the number of GPUs {world_size}")
    need(not args.one_step_off_policy or args.tensor_model_parallel_size == 1,
         "--one_step_off_policy needs --tensor_model_parallel_size 1: the engine's tensor-parallel collectives would "
         "run beside the trainer's in another thread, in no fixed order between ranks")
    agg_loss(torch.zeros(1, 1), torch.ones(1, 1), args.loss_agg_mode, 1, 1, 1)  # raises on a bad mode
    kl_penalty(torch.zeros(1), torch.zeros(1), args.kl_loss_type)
    args.kl_loss_coef = 0.001 if args.kl_loss_coef is None else args.kl_loss_coef
    args.kl_coef = 0.001 if args.kl_coef is None else args.kl_coef


def main(args):
    r = run.start(args, check_args, args.gen_batch_size)  # process group, flags, reward, tokenizer, data, steps
    device, world, n = r.device, r.world, args.rollout_n

    # models: the actor (trained) and the reference (frozen, only when a KL term is on)
    use_ref = (args.use_kl_loss or args.use_kl_in_reward) and not args.val_only
    actor = sharding.load_policy(args.model, device, not args.val_only, args.param_offload, args)
    ref = sharding.load_policy(args.model, device, False, args.ref_param_offload, args) if use_ref else None
    optimizer = torch.optim.AdamW(actor.parameters(), lr=args.actor_lr, weight_decay=args.weight_decay,
                                  betas=(0.9, 0.999))
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, run.lr_lambda(args, r.total_steps))
    state = r.resume({"actor": actor}, {"actor": optimizer}, {"actor": scheduler})  # None: already finished
    if state is None:
        return
    # the engine, which generates with the actor's weights (a pool of engines starts in other processes
    # while the step's passes compile)
    engine = r.make_engine()
    if r.compile_ahead:
        sharding.compile_ahead(actor, ref, args, device, update_actor)
    r.engine_ready(engine, actor)
    if args.val_only:
        return r.validate_only()
    source = batches.Batches(  # each step's batch, with DAPO's dynamic sampling and the other extras
        engine, r.train, args, r.tokenizer, r.reward_fn, actor, device, state, n,
        filter_groups=args.filter_groups, gen_batch_size=args.gen_batch_size,
        filter_groups_from_step=args.filter_groups_from_step, max_num_gen_batches=args.max_num_gen_batches,
        skip_all_equal=args.skip_all_equal, skip_explore_prob=args.skip_explore_prob,
        one_step_off_policy=args.one_step_off_policy)
    log_prob_tokens = args.log_prob_max_token_len_per_gpu if args.use_dynamic_bsz else None

    for step in range(r.step + 1, r.total_steps + 1):
        metrics, timer = {}, run.Timer({}, device, engine)
        with timer("step"):
            # 1 generate: the engine (awake, holding the latest weights) samples n responses per prompt
            # 2 score: rule or user reward per response; this rank's share of the batch as tensors
            batch = source.next(step, r.total_steps, timer)
            samples, response_mask = batch.samples, batch.response_mask  # N/world sequences, (N/world, T)
            T = response_mask.shape[1]

            # 3 old and reference log-probs, recomputed by the FSDP2 actor (the engine's are a check); the
            # policy's entropy as verl reports it, from the old pass (the update computes it only for a bonus)
            with timer("old_log_prob"):
                old_log_probs, entropy = sharding.batched_log_probs(
                    actor, samples, args.log_prob_micro_batch_size_per_gpu, args.temperature,
                    args.use_remove_padding, T, log_prob_tokens, with_entropy=True)
                n_tokens = sharding.all_sum(response_mask.sum().item(), device=device)[0]  # all ranks
                mean_entropy = agg_loss(entropy, response_mask, args.loss_agg_mode, n_tokens, len(samples) * world,
                                        args.max_response_length)
                metrics["actor/entropy"] = sharding.all_sum(mean_entropy.item(), device=device)[0]
            # --rollout_is: weights from the engine's sampling distribution to the trainer's
            is_weights, is_metrics = batches.importance_weights(old_log_probs, batch, args, device)
            metrics |= is_metrics
            if ref is not None:
                with timer("ref"):
                    ref_log_probs, _ = sharding.batched_log_probs(
                        ref, samples, args.log_prob_micro_batch_size_per_gpu, args.temperature,
                        args.use_remove_padding, T, log_prob_tokens)

            # 4 advantages: the score sits on the last response token; KL-in-reward spreads -kl_coef * KL
            with timer("adv"):
                last = (response_mask.sum(-1).long() - 1).clamp(min=0)
                token_level_rewards = torch.zeros_like(response_mask)
                token_level_rewards[torch.arange(len(samples)), last] = batch.scores
                if args.use_kl_in_reward:
                    kl = kl_penalty(old_log_probs, ref_log_probs, "k1") * response_mask
                    token_level_rewards = token_level_rewards - args.kl_coef * kl
                    metrics["actor/reward_kl_penalty"] = sharding.all_sum(kl.sum().item(), device=device)[0] / max(
                        1, n_tokens)
                advantages = compute_grpo_outcome_advantage(token_level_rewards.sum(-1), response_mask, n,
                                                            args.norm_adv_by_std_in_grpo)

            # 5 update: mini-batches x epochs, micro-batch gradient accumulation, global normalisation
            with timer("update_actor"):
                metrics["actor/lr"] = scheduler.get_last_lr()[0]  # this update's rate (after step(): the next's)
                if args.optimizer_offload:
                    sharding.move_optimizer_state(optimizer, device)
                metrics |= update_actor(actor, optimizer, samples, old_log_probs,
                                        ref_log_probs if args.use_kl_loss else None, advantages, response_mask, args,
                                        step, device, is_weights)
                scheduler.step()
                if args.optimizer_offload:
                    sharding.move_optimizer_state(optimizer, "cpu")

            # 6 push the new weights into the engine: FSDP2 shards -> full tensors -> vLLM's loaders
            optimizer.zero_grad(set_to_none=True)
            source.push_weights(timer)

        # 7 log, validate, save
        metrics |= batches.round_metrics(batch) | {
            "critic/rewards/mean": sharding.all_sum(token_level_rewards.sum().item(), device=device)[0] / (
                len(batch.groups) * n),
            "critic/advantages/mean": sharding.all_sum((advantages * response_mask).sum().item(), device=device)[0]
            / max(n_tokens, 1)}
        if r.end_step(step, metrics, timer, batch, old_log_probs, source):
            break
    return r.finish(step, metrics, actor, source)


if __name__ == "__main__":
    run.launch(main, Args)
