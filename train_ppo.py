"""PPO: Proximal Policy Optimization with a learned critic (Schulman et al. 2017), as verl runs it for RLHF.

Sample one response per prompt (or n), score it with a rule reward, and subtract beta * KL(pi_old ||
pi_ref) from every token's reward (Ziegler et al. 2019, eq. 2; beta fixed or adapted toward a target KL,
sec. 2.2). A critic, a value head on the same body, predicts each token's return; advantages are GAE
(Schulman et al. 2016, eq. 16) over the shaped rewards, whitened over the batch. The policy is updated
with the clipped surrogate (PPO eq. 7), the critic by clipped value regression (verl / PPO2's
`cliprange_value`). Actor and critic keep separate optimizers and losses, so `--vf_coef` only scales the
critic's loss. Variants behind flags: an adaptive KL controller, the KL as a loss term instead
(`--use_kl_loss`), dual-clip (Ye et al. 2020), critic warm-up, and truncated importance sampling from the
engine's distribution to the trainer's (`--rollout_is`). Left out: reward models (rule and user
functions only), multi-turn rollouts, sequence parallelism, a shared actor-critic body.

Run: torchrun --nproc_per_node=8 train_ppo.py --model Qwen/Qwen2.5-0.5B-Instruct
Shapes: B prompts, n samples per prompt, N = B*n sequences, T response tokens, V vocabulary.
"""

import contextlib
import importlib.util
import json
import math
import os
import random
import sys
import time
from dataclasses import asdict, dataclass, field

import numpy as np
import torch
import torch.distributed as dist
from tqdm import tqdm
from transformers import (AutoConfig, AutoModelForCausalLM, AutoModelForTokenClassification, AutoTokenizer,
                          HfArgumentParser)

import reward
import sharding
from data.dataset import load_rl_dataset
from rollout import group_share, logprob_gap, make_engine

IMPORTED = time.time()


@dataclass
class Args:
    # model and data
    model: str = field(default="Qwen/Qwen2.5-0.5B-Instruct", metadata={"help": "hub id or local folder"})
    train_files: str = field(default="~/data/gsm8k/train.parquet", metadata={"help": "parquet, comma-separated"})
    val_files: str = field(default="~/data/gsm8k/test.parquet", metadata={"help": "parquet, comma-separated"})
    train_batch_size: int = field(default=256, metadata={"help": "prompts per step (all ranks)"})
    max_prompt_length: int = field(default=512, metadata={"help": "tokens, after the chat template"})
    max_response_length: int = field(default=512, metadata={"help": "tokens generated at most"})
    filter_overlong_prompts: bool = field(default=False, metadata={"help": "drop prompts over max_prompt_length"})
    truncation: str = field(default="error", metadata={"help": "overlong prompts when not filtered: error|left|right"})
    # rollout
    rollout_engine: str = field(default="vllm", metadata={"help": "vllm | hf (transformers generate)"})
    rollout_n: int = field(default=1, metadata={"help": "responses per prompt"})
    temperature: float = field(default=1.0, metadata={"help": "sampling temperature"})
    top_p: float = field(default=1.0, metadata={"help": "nucleus sampling"})
    top_k: int = field(default=-1, metadata={"help": "-1 = off"})
    tensor_model_parallel_size: int = field(default=1, metadata={"help": "GPUs per vLLM replica"})
    logprob_check_prompts: int = field(default=8, metadata={
        "help": "prompts per GPU per step whose engine log-probs are checked (rollout/logprob_gap_mean); -1: all"})
    gpu_memory_utilization: float = field(default=0.4, metadata={"help": "vLLM's share of GPU memory while awake"})
    max_num_seqs: int = field(default=1024, metadata={
        "help": "sequences vLLM decodes at once; the rest of a step's batch waits for free slots"})
    engines_per_gpu: int = field(default=1, metadata={
        "help": "vLLM engines per GPU, each in a process of its own decoding a share of the sequences: a small "
        "model's generation is bound by vLLM's host work, which K processes share (docs/benchmarks.md)"})
    rollout_compile: bool = field(default=False, metadata={
        "help": "run vLLM's model through torch.compile (vLLM's default); off: CUDA graphs of vLLM's uncompiled "
        "forward for every decoding batch, which on an H200 was ready 31 s sooner and generated faster "
        "(docs/benchmarks.md)"})
    # actor update
    ppo_mini_batch_size: int = field(default=64, metadata={"help": "prompts per optimizer step (x rollout_n inside)"})
    ppo_micro_batch_size_per_gpu: int = field(default=4, metadata={"help": "sequences per forward/backward"})
    log_prob_micro_batch_size_per_gpu: int = field(default=8, metadata={"help": "sequences per log-prob forward"})
    use_dynamic_bsz: bool = field(default=False, metadata={
        "help": "micro-batches by token budget (the *_max_token_len_per_gpu flags) instead of sequence count"})
    ppo_max_token_len_per_gpu: int = field(default=16384, metadata={"help": "tokens per forward/backward"})
    log_prob_max_token_len_per_gpu: int = field(default=16384, metadata={"help": "tokens per log-prob forward"})
    ppo_epochs: int = field(default=1, metadata={"help": "passes over each batch"})
    actor_lr: float = field(default=1e-6, metadata={"help": "AdamW learning rate"})
    weight_decay: float = field(default=0.01, metadata={"help": "AdamW weight decay"})
    lr_warmup_steps: int = field(default=-1, metadata={"help": "-1: use lr_warmup_steps_ratio"})
    lr_warmup_steps_ratio: float = field(default=0.0, metadata={"help": "warmup as a fraction of all steps"})
    lr_scheduler_type: str = field(default="constant", metadata={"help": "constant | cosine (after warmup)"})
    min_lr_ratio: float = field(default=0.0, metadata={
        "help": "cosine: the rate it decays to, as a fraction of --actor_lr"})
    lr_decay_steps_ratio: float = field(default=1.0, metadata={
        "help": "cosine: decay over this last fraction of all steps and hold the rate before it (warmup-stable-"
                "decay); 1: decay from the end of warmup (verl's cosine)"})
    grad_clip: float = field(default=1.0, metadata={"help": "max global gradient norm"})
    clip_ratio_low: float = field(default=0.2, metadata={"help": "ratio clipped below at 1 - this"})
    clip_ratio_high: float = field(default=0.2, metadata={"help": "ratio clipped above at 1 + this (DAPO: 0.28)"})
    clip_ratio_c: float = field(default=3.0, metadata={"help": "dual-clip bound for negative advantages"})
    loss_agg_mode: str = field(default="token-mean", metadata={
        "help": "token-mean | seq-mean-token-mean | seq-mean-token-sum | seq-mean-token-sum-norm"})
    entropy_coeff: float = field(default=0.0, metadata={"help": "entropy bonus"})
    rollout_is: str | None = field(default=None, metadata={
        "help": "token | sequence: weight each token's policy loss by pi_old / pi_rollout, the trainer's over the "
                "engine's probability of the sampled tokens, truncated at --rollout_is_threshold (truncated "
                "importance sampling, verl's algorithm.rollout_correction.rollout_is): corrects for the engine's "
                "numerics. Asks the engine for the log-probs of every response. With --top_p or --top_k on, the "
                "engine's are of the truncated distribution, so the weights sit below 1"})
    rollout_is_threshold: float = field(default=2.0, metadata={"help": "rollout_is: the weights' upper bound"})
    use_kl_loss: bool = field(default=False, metadata={"help": "KL to the reference model in the loss"})
    kl_loss_coef: float | None = field(default=None, metadata={"help": "default 0.001 when use_kl_loss"})
    kl_loss_type: str = field(default="low_var_kl", metadata={"help": "k1 | k2 | k3 | low_var_kl | abs | mse"})
    use_kl_in_reward: bool = field(default=True, metadata={"help": "subtract kl_coef * KL from the reward"})
    kl_coef: float | None = field(default=None, metadata={"help": "default 0.001 when use_kl_in_reward"})
    kl_penalty: str = field(default="kl", metadata={"help": "KL-in-reward estimator: kl (= k1) | k2 | k3 | abs | mse"})
    kl_ctrl_type: str = field(default="fixed", metadata={"help": "fixed | adaptive (Ziegler et al. 2019)"})
    kl_target: float = field(default=6.0, metadata={"help": "adaptive: the KL the coefficient steers toward"})
    kl_horizon: int = field(default=10000, metadata={"help": "adaptive: sequences over which to correct"})
    # advantages (GAE)
    gamma: float = field(default=1.0, metadata={"help": "discount"})
    lam: float = field(default=1.0, metadata={"help": "GAE lambda"})
    # critic
    critic_model: str | None = field(default=None, metadata={"help": "value model's body; default: --model"})
    critic_lr: float = field(default=1e-5, metadata={"help": "critic AdamW learning rate (constant)"})
    critic_weight_decay: float = field(default=0.01, metadata={"help": "critic AdamW weight decay"})
    critic_warmup: int = field(default=0, metadata={
        "help": "update only the critic for the first N steps (verl's `critic_warmup <= step` check: N - 1)"})
    critic_ppo_micro_batch_size_per_gpu: int = field(default=4, metadata={"help": "sequences per critic forward"})
    critic_ppo_max_token_len_per_gpu: int = field(default=32768, metadata={
        "help": "tokens per critic forward (with --use_dynamic_bsz)"})
    critic_grad_clip: float = field(default=1.0, metadata={"help": "critic's max global gradient norm"})
    cliprange_value: float = field(default=0.5, metadata={"help": "new values kept within old +- this"})
    vf_coef: float = field(default=1.0, metadata={
        "help": "scales the critic's loss (verl applies it only to a shared actor-critic loss; with its own "
                "optimizer it matters only through --critic_grad_clip)"})
    # memory
    enable_gradient_checkpointing: bool = field(default=False, metadata={"help": "recompute activations"})
    param_offload: bool = field(default=False, metadata={"help": "actor params, grads and optimizer on CPU"})
    optimizer_offload: bool = field(default=False, metadata={"help": "optimizer state on CPU between steps"})
    ref_param_offload: bool = field(default=False, metadata={"help": "reference model params on CPU"})
    critic_enable_gradient_checkpointing: bool = field(default=False, metadata={"help": "recompute activations"})
    critic_param_offload: bool = field(default=False, metadata={"help": "critic params, grads and optimizer on CPU"})
    critic_optimizer_offload: bool = field(default=False, metadata={"help": "critic optimizer state on CPU"})
    use_remove_padding: bool = field(default=True, metadata={"help": "pack sequences instead of padding"})
    # speed
    use_torch_compile: bool | None = field(default=None, metadata={
        "help": "torch.compile the log-prob and entropy math over the vocabulary, in every pass, its gradient "
        "written by hand (default: on GPU)"})
    compile_layers: bool | None = field(default=None, metadata={
        "help": "torch.compile each decoder layer, in the passes without gradients (default: on GPU)"})
    use_fused_kernels: bool = field(default=False, metadata={
        "help": "the update's log-probs and entropy from the output layer chunk by chunk, never the whole "
        "(tokens, vocabulary) logits: less memory for one more matmul of the output layer (verl's flag; here "
        "for the passes with a gradient only)"})
    compile_update: bool = field(default=False, metadata={
        "help": "compile the decoder layers in the actor's and the critic's updates (forward and backward) too, where "
        "--compile_layers compiles (--use_torch_compile already covers the actor's log-prob math): pays off with "
        "large micro-batches (--use_dynamic_bsz, --ppo_max_token_len_per_gpu 49152 on an H200), costs compiling in "
        "step 1 (about 30 s for GRPO's actor on a fresh H200, docs/benchmarks.md)"})
    # reward
    custom_reward_function_path: str | None = field(default=None, metadata={"help": "a .py file"})
    custom_reward_function_name: str = field(default="compute_score", metadata={"help": "function in that file"})
    reward_errors: str = field(default="raise", metadata={"help": "raise | zero: a failing reward call scores 0"})
    # trainer
    total_epochs: int = field(default=15, metadata={"help": "passes over the training prompts"})
    total_training_steps: int | None = field(default=None, metadata={"help": "overrides total_epochs"})
    save_freq: int = field(default=10, metadata={"help": "checkpoint every N steps, the last, on a stop (-1: never)"})
    test_freq: int = field(default=10, metadata={"help": "validate every N steps (-1: never)"})
    val_before_train: bool = field(default=False, metadata={"help": "validate before the first step"})
    val_only: bool = field(default=False, metadata={"help": "only evaluate --model (or the checkpoint) and exit"})
    val_n: int = field(default=1, metadata={"help": "val_only: samples per prompt for pass@k (T=val_temperature)"})
    val_temperature: float = field(default=1.0, metadata={"help": "val_only: temperature of the pass@k samples"})
    max_val_samples: int | None = field(default=None, metadata={"help": "validate on the first N prompts"})
    resume_mode: str = field(default="auto", metadata={"help": "auto | disable | a global_step_N folder"})
    default_local_dir: str | None = field(default=None, metadata={"help": "default checkpoints/PROJECT/EXPERIMENT"})
    keep_last_checkpoints: int = field(default=2, metadata={"help": "checkpoints kept on disk"})
    export_final: bool = field(default=True, metadata={"help": "write the final policy as a HF folder"})
    rollout_data_dir: str | None = field(default=None, metadata={
        "help": "write each step's responses (text, score) to DIR/STEP.jsonl"})
    validation_data_dir: str | None = field(default=None, metadata={
        "help": "write each validation's responses to DIR/STEP.jsonl (DIR/STEP_nN.jsonl for --val_n N)"})
    logger: str = field(default="console,jsonl", metadata={"help": "comma list of console, jsonl, wandb, tensorboard"})
    project_name: str = field(default="ppo_gsm8k", metadata={"help": "for wandb / tensorboard / folders"})
    experiment_name: str = field(default="qwen2.5_0.5b", metadata={"help": "for wandb / tensorboard / folders"})
    seed: int = field(default=1, metadata={"help": "model init and data order; sampling uses seed + group"})


# --- math: pure tensor functions, no globals, no I/O ---------------------------------------------


def compute_gae_advantage_return(token_level_rewards, values, response_mask, gamma, lam, whiten=True):
    """Generalised advantage estimation (Schulman et al. 2016, eq. 16), backwards over response tokens:

      delta_t = r_t + gamma * V_{t+1} - V_t,   A_t = delta_t + gamma * lam * A_{t+1},   returns_t = A_t + V_t

    with V and A zero after the last token. Then A is whitened over all response tokens of the batch:
    (A - mean) / sqrt(var + 1e-8), unbiased var (verl's masked_whiten); returns stay raw, the critic's target.
    Padding never leaks in: a masked position passes V_{t+1} and A_{t+1} through unchanged (verl's
    multi-turn form), so the last token sees V = 0 past the end whatever the padding holds.
    All tensors (N, T); returns advantages (N, T) and returns (N, T), zero on padding.
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


def compute_value_loss(vpreds, values, returns, response_mask, cliprange_value, loss_agg_mode, num_tokens, num_seqs,
                       max_response_length):
    """Clipped value loss (PPO2's `cliprange_value`, as verl's compute_value_loss), aggregated globally.

      vpredclipped = values + clip(vpreds - values, -c, c)
      vf_loss = 0.5 * agg(max((vpreds - returns)^2, (vpredclipped - returns)^2))

    The max makes the loss pessimistic: a prediction may not move more than c from the old value to
    lower it. vpreds (new), values (old, from the same rollout), returns: (N, T). Returns the scalar
    vf_loss and the sum over response tokens of vf_clipfrac (the clipped term was the larger one);
    the caller divides by the global token count, as for the policy loss.
    """
    vpredclipped = values + (vpreds - values).clamp(-cliprange_value, cliprange_value)
    vf_losses1 = (vpreds - returns).square()
    vf_losses2 = (vpredclipped - returns).square()
    vf_loss = 0.5 * agg_loss(torch.max(vf_losses1, vf_losses2), response_mask, loss_agg_mode, num_tokens, num_seqs,
                             max_response_length)
    return vf_loss, {"vf_clipfrac": ((vf_losses2 > vf_losses1) & response_mask.bool()).sum()}


def explained_variance(returns, values, response_mask):
    """1 - Var[returns - values] / Var[returns] over response tokens: 1 = the critic predicts the returns,
    0 = no better than their mean (verl's critic/vf_explained_var, with its 1e-5)."""
    mask = response_mask.bool()
    return (1 - (returns - values)[mask].var() / (returns[mask].var() + 1e-5)).item()


def rollout_is_weights(old_log_probs, rollout_log_probs, response_mask, level, threshold):
    """Truncated importance weights from the engine's sampling distribution to the trainer's (N, T).

    The batch was sampled by the engine (pi_rollout), but PPO's ratio is taken against the trainer's
    recomputed pi_old: an unbiased gradient weights each token by rho = pi_old / pi_rollout. Truncated
    at C (Ionides 2008; Yao et al. 2025 for LLM RL): min(rho, C), trading a little bias for bounded
    variance. token: rho_t per token; sequence: prod_t rho_t, one weight for all of a response's
    tokens. log rho is clamped to [-20, 20] first, as verl does, so exp() cannot overflow. Zero on
    padding; no gradient flows through the weights. Also returns the rho before truncation.
    """
    log_rho = (old_log_probs - rollout_log_probs) * response_mask
    if level == "sequence":
        log_rho = log_rho.sum(-1, keepdim=True).expand_as(log_rho)
    elif level != "token":
        raise ValueError(f"--rollout_is {level!r} is not one of token, sequence")
    rho = log_rho.clamp(-20.0, 20.0).exp() * response_mask
    return rho.clamp(max=threshold).detach(), rho.detach()


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


class FixedKLController:
    """beta stays at its initial value."""

    def __init__(self, kl_coef):
        self.value = kl_coef

    def update(self, current_kl, n_steps):
        pass


class AdaptiveKLController:
    """beta steered toward a target KL (Ziegler et al. 2019, sec. 2.2):

      e = clip(KL / target - 1, -0.2, 0.2),   beta <- beta * (1 + e * n_steps / horizon)

    n_steps: sequences in the batch that measured KL (verl passes the batch size).
    """

    def __init__(self, kl_coef, target, horizon):
        self.value, self.target, self.horizon = kl_coef, target, horizon

    def update(self, current_kl, n_steps):
        proportional_error = min(max(current_kl / self.target - 1, -0.2), 0.2)
        self.value *= 1 + proportional_error * n_steps / self.horizon


def apply_kl_penalty(token_level_scores, old_log_probs, ref_log_probs, response_mask, beta, kl_type):
    """r_t = score_t - beta * KL_t (Ziegler et al. 2019, eq. 2), KL_t an estimate of KL(pi_old || pi_ref).

    token_level_scores (N, T) holds each score on its last response token. Returns token_level_rewards
    (N, T) and the batch's KL as verl feeds its controller: the per-sequence mean over response
    tokens, averaged over sequences. Does not update the controller: the caller does, with that KL.
    """
    kl = kl_penalty(old_log_probs, ref_log_probs, kl_type) * response_mask  # (N, T)
    current_kl = (kl.sum(-1) / response_mask.sum(-1).clamp(min=1)).mean().item()
    return token_level_scores - beta * kl, current_kl


def entropy_from_logits(logits):
    """H = logsumexp(z) - sum_v softmax(z)_v z_v, per position: logits (..., V) -> (...). At most one
    (..., V) tensor beside the logits: logsumexp's, then the softmax (the sum is a dot product per
    position, einsum, with no product tensor)."""
    lse = torch.logsumexp(logits, -1)
    return lse - torch.einsum("...v,...v->...", torch.softmax(logits, -1), logits)


def token_log_probs(logits, targets, temperature, with_entropy=False):
    """log softmax(z / T) at the taken tokens and, if asked, the entropy of softmax(z / T), in fp32:
    logits (K, V), targets (K,) -> (K,), (K,) or None. Gather minus logsumexp: no (K, V) log-prob
    tensor is made."""
    z = logits.float() / temperature  # verl scales by T too
    log_probs = z.gather(-1, targets[:, None]).squeeze(-1) - torch.logsumexp(z, -1)
    return log_probs, entropy_from_logits(z) if with_entropy else None


# The math over the (K, V) logits. Eagerly it runs as several kernels, each writing a (K, V) fp32
# tensor; at a vocabulary of 152k that costs more than the lm_head matmul itself (on one H200, ~0.5 s
# of a 2.45 s log-prob pass over a GRPO step's 1,280 responses; docs/benchmarks.md).
# `--use_torch_compile` (verl's flag) swaps in sharding.CompiledLogProbs in every pass: the same math in
# one compiled kernel that reads the bf16 logits once, its gradient written by hand.
LOGITS_MATH = {"log_probs": token_log_probs}


def compile_logits_math():
    LOGITS_MATH.update(log_probs=sharding.compiled_log_probs)


def gpu_default(flag, device):
    """A speed flag left unset (None) is on exactly when training on a GPU."""
    return device.type == "cuda" if flag is None else flag


# --- plumbing kept in the script: batching, log-probs, metrics ----------------------------------


def collate(samples, packed, device):
    """Model inputs for a micro-batch of (prompt_ids, response_ids) pairs, and where to read back.

    Padded: prompts left-padded, responses right-padded, logits kept for the last T+1 positions.
    Packed (`--use_remove_padding`): all sequences in one row, positions restarting per sequence,
    segment bounds `cu_seq_lens` for variable-length attention (`sharding.packed_attention`), logits
    kept only where a response token is predicted. `unpack` = (rows, cols, b, T): response token k
    sits at [rows[k], cols[k]] of a (b, T) result, T = longest response, in the order of the kept logits.
    """
    T = max(max(len(r) for _, r in samples), 1)
    rows = torch.tensor([i for i, (_, r) in enumerate(samples) for _ in r], device=device)
    cols = torch.tensor([t for _, r in samples for t in range(len(r))], device=device)
    unpack = (rows, cols, len(samples), T)
    if packed:
        ids, pos, keep, cu = [], [], [], [0]
        for p, r in samples:
            keep += range(len(ids) + len(p) - 1, len(ids) + len(p) + len(r) - 1)
            ids += p + r
            pos += range(len(p) + len(r))
            cu.append(len(ids))
        return dict(input_ids=torch.tensor([ids], device=device), position_ids=torch.tensor([pos], device=device),
                    logits_to_keep=torch.tensor(keep, device=device), unpack=unpack,
                    cu_seq_lens=torch.tensor(cu, dtype=torch.int32, device=device),  # for sharding.packed_attention
                    max_seq_len=max(b - a for a, b in zip(cu, cu[1:])))
    P = max(len(p) for p, _ in samples)
    ids = [[0] * (P - len(p)) + p + r + [0] * (T - len(r)) for p, r in samples]
    attn = [[0] * (P - len(p)) + [1] * (len(p) + len(r)) + [0] * (T - len(r)) for p, r in samples]
    attn = torch.tensor(attn, device=device)
    return dict(input_ids=torch.tensor(ids, device=device), attention_mask=attn,
                position_ids=(attn.cumsum(-1) - 1).clamp(min=0), logits_to_keep=T + 1, unpack=unpack)


def response_targets(samples, T, device):
    """(b, T) response token ids and response_mask."""
    ids = torch.tensor([r + [0] * (T - len(r)) for _, r in samples], device=device)
    mask = torch.tensor([[1] * len(r) + [0] * (T - len(r)) for _, r in samples], device=device)
    return ids, mask.float()


def forward_log_probs(model, samples, temperature, packed, with_entropy=False, fused=False):
    """log pi(y_t | x, y_<t) of each response token, (b, T), and the entropy (b, T) if asked (else
    None), with a gradient where one is recorded. `fused` (--use_fused_kernels), where a gradient is
    recorded: both from the output layer chunk by chunk (sharding.fused_log_probs), never the whole
    (K, V) logits."""
    device = sharding.compute_device(model)  # not the parameters' under --param_offload
    batch = collate(samples, packed, device)
    rows, cols, b, T = batch.pop("unpack")
    targets = torch.tensor([t for _, r in samples for t in r], device=device)
    # one row per response token, (K, ...): packed rows already are; padded ones drop the last
    # position (position t predicts token t+1) and the padding
    select = (lambda x: x[0]) if packed else (lambda x: x[:, :-1][rows, cols])  # noqa: E731
    if fused and torch.is_grad_enabled():
        with sharding.fused_log_probs(model, select, targets, temperature) as head:
            model(**batch, use_cache=False)
        flat, flat_entropy = head["log_probs"], head["entropy"]
    else:
        logits = select(model(**batch, use_cache=False).logits)  # (K, V)
        flat, flat_entropy = LOGITS_MATH["log_probs"](logits, targets, temperature, with_entropy)
    log_probs = torch.zeros(b, T, device=device, dtype=flat.dtype).index_put((rows, cols), flat)
    entropy = None
    if with_entropy:
        entropy = torch.zeros(b, T, device=device, dtype=flat_entropy.dtype).index_put((rows, cols), flat_entropy)
    return log_probs, entropy


def micro_batches(samples, size, max_tokens=None):
    """Split a rank's sequences into micro-batches of indices, the same number on every rank (FSDP2's
    collectives run once per forward). Without a token budget: `size` sequences each, in order. With
    one (`--use_dynamic_bsz`): the fewest groups whose tokens fit `max_tokens` on every rank, filled
    longest sequence first into the lightest group, so a long and a short batch cost alike."""
    if not max_tokens:
        return [list(range(i, min(i + size, len(samples)))) for i in range(0, len(samples), size)]
    lengths = [len(p) + len(r) for p, r in samples]

    def fill(k):
        groups, loads = [[] for _ in range(k)], [0] * k
        for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
            j = loads.index(min(loads))
            groups[j].append(i)
            loads[j] += lengths[i]
        return [sorted(g) for g in groups], max(loads)

    k = max(1, -(-sum(lengths) // max_tokens))
    groups, load = fill(k)
    while k < len(lengths) and load > max_tokens:
        k += 1
        groups, load = fill(k)
    if dist.is_initialized():  # the most groups any rank needs (never more than its sequences: equal counts)
        k_all = torch.tensor(k, device="cuda" if dist.get_backend() == "nccl" else "cpu")
        dist.all_reduce(k_all, op=dist.ReduceOp.MAX)
        if int(k_all) != k:
            groups, _ = fill(min(int(k_all), len(lengths)))
    return groups


@torch.no_grad()
def batched(forward, samples, micro, T, max_tokens=None):
    """`forward` (a list of samples -> a tuple of (b, T_b)) over a rank's sequences in micro-batches
    (same count on every rank), each output gathered into one (N, T) in the order of `samples`."""
    outs = None
    for idx in micro_batches(samples, micro, max_tokens):
        xs = forward([samples[i] for i in idx])
        outs = outs or [x.new_zeros(len(samples), T) for x in xs]
        for out, x in zip(outs, xs):
            out[idx, :x.shape[1]] = x
    return outs


def batched_log_probs(model, samples, micro, temperature, packed, T, max_tokens=None, with_entropy=False):
    """Log-probs (N, T) of a rank's sequences, in micro-batches, and their entropy (N, T) if asked
    (else None), from the same read of the logits."""
    def forward(s):
        log_probs, entropy = forward_log_probs(model, s, temperature, packed, with_entropy)
        return (log_probs, entropy) if with_entropy else (log_probs,)
    outs = batched(forward, samples, micro, T, max_tokens)
    return outs[0], outs[1] if with_entropy else None


def forward_values(model, samples, packed):
    """V of each response token (b, T): the score head read where that token's log-prob is read (position
    P-1+t predicts token t), so the value of token t sees only the prompt and y_<t, as in verl."""
    device = sharding.compute_device(model)  # not the parameters' under --param_offload
    batch = collate(samples, packed, device)
    rows, cols, b, T = batch.pop("unpack")
    keep = batch.pop("logits_to_keep")  # the value model has no logits_to_keep: select after the head
    out = model(**batch, use_cache=False).logits[..., 0].float()  # (1, packed length) or (b, P + T)
    flat = out[0, keep] if packed else out[:, -keep:-1][rows, cols]
    return torch.zeros(b, T, device=device, dtype=flat.dtype).index_put((rows, cols), flat)


def batched_values(model, samples, micro, packed, T, max_tokens=None):
    """Values (N, T) of a rank's sequences, in micro-batches."""
    return batched(lambda s: (forward_values(model, s, packed),), samples, micro, T, max_tokens)[0]


def all_sum(*values, device):
    """Sum floats over ranks."""
    t = torch.tensor(values, dtype=torch.float64, device=device)
    if dist.is_initialized():
        dist.all_reduce(t)
    return t.tolist()


def rollout_is_metrics(is_weights, rho, response_mask, threshold, device):
    """rollout_corr/* as verl names them, over all ranks' response tokens: the weights' mean, min and max
    (after truncation), and the share of tokens whose weight was truncated."""
    mask = response_mask.bool()
    total, n_tokens, n_high = all_sum(is_weights[mask].sum().item(), mask.sum().item(),
                                      (rho[mask] > threshold).sum().item(), device=device)
    w = is_weights[mask] if mask.any() else torch.ones(1, device=device)
    lo_hi = torch.stack([-w.min(), w.max()]).double()  # the min as a max of negatives: one reduction
    if dist.is_initialized():
        dist.all_reduce(lo_hi, op=dist.ReduceOp.MAX)
    return {"rollout_corr/rollout_is_mean": total / max(n_tokens, 1), "rollout_corr/rollout_is_min": -lo_hi[0].item(),
            "rollout_corr/rollout_is_max": lo_hi[1].item(),
            "rollout_corr/rollout_is_ratio_fraction_high": n_high / max(n_tokens, 1)}


def gather_objects(obj):
    """Every rank's `obj`, in rank order, on every rank."""
    if not dist.is_initialized():
        return [obj]
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def gather_batch(*tensors):
    """Every rank's rows of each (b, T_rank) tensor, right-padded to the longest T, in rank order: the
    whole batch on every rank, for statistics over the batch (whitening, the controller's KL)."""
    parts = gather_objects([t.cpu() for t in tensors])
    T = max(p[0].shape[1] for p in parts)
    return [torch.cat([torch.nn.functional.pad(p[k], (0, T - p[k].shape[1])) for p in parts]).to(tensors[0].device)
            for k in range(len(tensors))]


def flops_per_token(config, seq_len):
    """Forward FLOPs per token: 2 x the parameters a token is multiplied through (the lm_head once,
    the embedding lookup never, so tied and untied models count alike) + attention scores and
    values, 2 * 2 * layers * seq_len * heads * head_dim, halved for causal masking."""
    h, L, V = config.hidden_size, config.num_hidden_layers, config.vocab_size
    hd = getattr(config, "head_dim", None) or h // config.num_attention_heads
    q, kv = config.num_attention_heads * hd, config.num_key_value_heads * hd
    per_layer = h * (q + 2 * kv) + q * h + 3 * h * config.intermediate_size
    return 2 * (L * per_layer + V * h) + 2 * L * seq_len * q


def phase_perf(t, config, seq_len, tokens, response_tokens, peak_flops, epochs, push_bytes):
    """Achieved TFLOP/s and MFU of the phases that ran (`t`: their timing_s/*): a log-prob phase is
    one forward over `tokens`, the actor update three (forward + backward) per epoch; the lm_head
    counts only at the `response_tokens` positions where it is applied. Weight sync in GB/s."""
    lm_head = 2 * config.vocab_size * config.hidden_size
    forward = tokens * (flops_per_token(config, seq_len) - lm_head) + response_tokens * lm_head
    out = {"perf/peak_tflops": peak_flops / 1e12}
    for phase, name, passes in (("old_log_prob", "old_log_prob", 1), ("ref", "ref", 1),
                                ("update_actor", "actor", 3 * epochs)):
        if f"timing_s/{phase}" in t:
            rate = passes * forward / t[f"timing_s/{phase}"]
            out |= {f"perf/tflops/{name}": rate / 1e12, f"perf/mfu/{name}": rate / peak_flops}
    if "timing_s/update_weights" in t:
        out["perf/weight_sync_gb_s"] = push_bytes / t["timing_s/update_weights"] / 1e9
    return out


def seconds_since_launch():
    """Wall-clock seconds since this process started (Linux: /proc; elsewhere: since this script was
    imported, which misses the imports of torch and transformers)."""
    try:
        with open("/proc/self/stat") as f:
            start_ticks = int(f.read().rsplit(")", 1)[1].split()[19])  # field 22, starttime
        return time.clock_gettime(time.CLOCK_BOOTTIME) - start_ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, AttributeError):
        return time.time() - IMPORTED


def measure_peak_flops(device):
    """Measured dense matmul rate (FLOP/s) of this device: the MFU denominator."""
    n, dtype = (8192, torch.bfloat16) if device.type == "cuda" else (512, torch.float32)
    a, b = torch.randn(n, n, device=device, dtype=dtype), torch.randn(n, n, device=device, dtype=dtype)
    for _ in range(3):
        a @ b
    sync(device)
    t, iters = time.perf_counter(), 20
    for _ in range(iters):
        a @ b
    sync(device)
    return 2 * n**3 * iters / (time.perf_counter() - t)


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


class Timer:
    """`with timer("gen"):` adds the seconds spent inside to metrics["timing_s/gen"] (nestable), and on a
    GPU the phase's peak memory to metrics["perf/max_memory_allocated_gb/gen"] (innermost phases only).

    torch counts a sleeping engine's pool as allocated though the engine has released its memory, so a
    phase that starts and ends with the engine asleep subtracts it: the peak is what the GPU held."""

    def __init__(self, metrics, device, engine=None):
        self.metrics, self.device, self.engine = metrics, device, engine
        self.inner_done = False  # a phase nested in the current one has recorded its peak

    @contextlib.contextmanager
    def __call__(self, name):
        sync(self.device)
        cuda = self.device.type == "cuda"
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        unbacked = self.engine.unbacked_bytes() if self.engine is not None else 0
        self.inner_done = False
        t0 = time.perf_counter()
        yield
        sync(self.device)
        key = f"timing_s/{name}"
        self.metrics[key] = self.metrics.get(key, 0.0) + time.perf_counter() - t0
        if self.engine is not None and self.engine.unbacked_bytes() != unbacked:
            unbacked = 0  # the engine woke or slept inside the phase: its peak may include the pool
        if cuda and not self.inner_done:  # an outer phase's peak was reset by its inner phases
            key = f"perf/max_memory_allocated_gb/{name}"
            peak = (torch.cuda.max_memory_allocated() - unbacked) / 2**30
            self.metrics[key] = max(self.metrics.get(key, 0.0), peak)
        self.inner_done = True


class Logger:
    """Rank 0 only: console line per step (verl's format), jsonl, wandb, tensorboard."""

    def __init__(self, args, out_dir):
        self.kinds = {k.strip() for k in args.logger.strip("[]").split(",") if k.strip()}
        self.on = sharding.rank() == 0
        self.path, self.wandb, self.tb = os.path.join(out_dir, "metrics.jsonl"), None, None
        if not self.on:
            return
        os.makedirs(out_dir, exist_ok=True)
        if "wandb" in self.kinds:
            import wandb
            self.wandb = wandb.init(project=args.project_name, name=args.experiment_name, config=asdict(args))
        if "tensorboard" in self.kinds:
            from torch.utils.tensorboard import SummaryWriter
            self.tb = SummaryWriter(os.path.join(out_dir, "tensorboard"))

    def truncate(self, step):
        """Drop log lines after `step`: a resumed (or restarted) run rewrites what follows."""
        if self.on and os.path.exists(self.path):
            with open(self.path) as f:
                lines = [line for line in f if json.loads(line)["step"] <= step]
            with open(self.path + ".tmp", "w") as f:
                f.writelines(lines)
            os.replace(self.path + ".tmp", self.path)

    def log(self, metrics, step):
        if not self.on:
            return
        if "console" in self.kinds:
            tqdm.write(f"step:{step} - " + " - ".join(f"{k}:{v:.4g}" if isinstance(v, float) else f"{k}:{v}"
                                                      for k, v in sorted(metrics.items())))
        if "jsonl" in self.kinds:
            with open(self.path, "a") as f:
                f.write(json.dumps({"step": step, **metrics}) + "\n")
        if self.wandb:
            self.wandb.log(metrics, step=step)
        if self.tb:
            for k, v in metrics.items():
                self.tb.add_scalar(k, v, step)

    def close(self):
        """Finish the wandb run and write tensorboard's pending events: a finished run ends without the
        interpreter's exit hooks (the end of this file)."""
        if self.wandb:
            self.wandb.finish()
        if self.tb:
            self.tb.close()


# --- setup ---------------------------------------------------------------------------------------


def check_args(args, world_size):
    """Fail at start-up, naming the flags, before anything heavy loads."""
    def need(ok, msg):
        if not ok:
            raise SystemExit(f"{os.path.basename(__file__)}: {msg}")
    for flag in ("rollout_data_dir", "validation_data_dir"):
        path = getattr(args, flag)
        need(not path or not os.path.exists(path) or os.path.isdir(path),
             f"--{flag} {path} is a file, not a folder: give a folder for the .jsonl files, or leave the flag out")
    need(args.rollout_n >= 1, "--rollout_n must be >= 1")
    need(args.train_batch_size % world_size == 0,
         f"--train_batch_size {args.train_batch_size} must be divisible by the number of GPUs {world_size}")
    need(args.ppo_mini_batch_size <= args.train_batch_size,
         f"--ppo_mini_batch_size {args.ppo_mini_batch_size} must not exceed --train_batch_size {args.train_batch_size}")
    need(args.ppo_mini_batch_size * args.rollout_n % world_size == 0,
         f"--ppo_mini_batch_size x --rollout_n ({args.ppo_mini_batch_size * args.rollout_n}) must be divisible by "
         f"the number of GPUs {world_size}")
    need(args.max_num_seqs >= 1, f"--max_num_seqs {args.max_num_seqs} must be at least 1")
    need(world_size % args.tensor_model_parallel_size == 0,
         f"--tensor_model_parallel_size {args.tensor_model_parallel_size} must divide the number of GPUs {world_size}")
    longest = args.max_prompt_length + args.max_response_length
    for flag in ("ppo_max_token_len_per_gpu", "log_prob_max_token_len_per_gpu", "critic_ppo_max_token_len_per_gpu"):
        need(not args.use_dynamic_bsz or getattr(args, flag) >= longest,
             f"--{flag} {getattr(args, flag)} must hold the longest sequence, --max_prompt_length + "
             f"--max_response_length = {longest}")
    need(args.kl_loss_coef is None or args.use_kl_loss, "--kl_loss_coef is set but --use_kl_loss is false")
    need(args.kl_coef is None or args.use_kl_in_reward, "--kl_coef is set but --use_kl_in_reward is false")
    need(args.kl_ctrl_type in ("fixed", "adaptive"), "--kl_ctrl_type must be fixed or adaptive")
    need(args.kl_penalty in ("kl", "k1", "k2", "k3", "low_var_kl", "abs", "mse"),
         "--kl_penalty must be kl (= k1), k2, k3, low_var_kl, abs or mse")
    need(not args.compile_update or args.compile_layers is not False,
         "--compile_update compiles the update's decoder layers, which --compile_layers false leaves eager; drop one")
    need(args.truncation in ("error", "left", "right"), "--truncation must be error, left or right")
    need(args.lr_scheduler_type in ("constant", "cosine"), "--lr_scheduler_type must be constant or cosine")
    need(0 <= args.min_lr_ratio <= 1, f"--min_lr_ratio {args.min_lr_ratio} must be in [0, 1]")
    need(0 < args.lr_decay_steps_ratio <= 1, f"--lr_decay_steps_ratio {args.lr_decay_steps_ratio} must be in (0, 1]")
    need((args.min_lr_ratio == 0 and args.lr_decay_steps_ratio == 1) or args.lr_scheduler_type == "cosine",
         "--min_lr_ratio and --lr_decay_steps_ratio shape the cosine schedule: add --lr_scheduler_type cosine")
    need(args.reward_errors in ("raise", "zero"), "--reward_errors must be raise or zero")
    need(args.rollout_engine in ("vllm", "hf"), "--rollout_engine must be vllm or hf")
    need(args.rollout_is in (None, "token", "sequence"),
         f"--rollout_is {args.rollout_is!r} must be token or sequence (or left out: no correction)")
    need(args.rollout_is_threshold >= 1, f"--rollout_is_threshold {args.rollout_is_threshold} must be at least 1: "
         "below it the weights of tokens both engine and trainer agree on would be cut")
    need(args.engines_per_gpu >= 1, f"--engines_per_gpu {args.engines_per_gpu} must be at least 1")
    need(args.engines_per_gpu == 1 or (args.rollout_engine == "vllm" and args.tensor_model_parallel_size == 1),
         "--engines_per_gpu above 1 needs --rollout_engine vllm and --tensor_model_parallel_size 1")
    need(args.resume_mode in ("auto", "disable") or os.path.isdir(args.resume_mode),
         f"--resume_mode must be auto, disable or an existing global_step_N folder, got {args.resume_mode!r}")
    for kind in (k.strip() for k in args.logger.strip("[]").split(",") if k.strip()):
        need(kind in ("console", "jsonl", "wandb", "tensorboard"),
             f"--logger {kind!r}: choose from console, jsonl, wandb, tensorboard")
        module = {"wandb": "wandb", "tensorboard": "tensorboard"}.get(kind)
        need(module is None or importlib.util.find_spec(module) is not None,
             f"--logger {kind} needs the {module} package: pip install {module}")
    agg_loss(torch.zeros(1, 1), torch.ones(1, 1), args.loss_agg_mode, 1, 1, 1)  # raises on a bad mode
    kl_penalty(torch.zeros(1), torch.zeros(1), args.kl_loss_type)
    args.optimizer_offload &= not args.param_offload  # param_offload already steps the optimizer on the CPU
    args.critic_optimizer_offload &= not args.critic_param_offload
    args.kl_loss_coef = 0.001 if args.kl_loss_coef is None else args.kl_loss_coef
    args.kl_coef = 0.001 if args.kl_coef is None else args.kl_coef
    args.critic_model = args.critic_model or args.model
    args.default_local_dir = args.default_local_dir or os.path.join("checkpoints", args.project_name,
                                                                    args.experiment_name)


def init_distributed():
    """torchrun sets RANK/WORLD_SIZE; a plain `python train_*.py` runs as a world of one."""
    for k, v in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1"), ("MASTER_ADDR", "127.0.0.1")):
        os.environ.setdefault(k, v)
    os.environ.setdefault("MASTER_PORT", str(29500 + os.getpid() % 1000))
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
        device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
    else:
        device = torch.device("cpu")
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", device_id=device if device.type == "cuda"
                            else None)
    return dist.get_rank(), dist.get_world_size(), device


def attention(args):
    """Variable-length attention for packed sequences, transformers' sdpa for padded ones."""
    return sharding.PACKED_ATTENTION if args.use_remove_padding else "sdpa"


def load_policy(path, device, trainable, offload, args):
    """A Hugging Face causal LM, fp32 masters, sharded with FSDP2 (bf16 compute on GPU)."""
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation=attention(args))
    if device.type == "cuda" and not offload:
        model.to(device)
    if gpu_default(args.compile_layers, device):
        sharding.compile_layers(model, with_grad=trainable and args.compile_update)
    sharding.apply_fsdp2(model, param_dtype=torch.bfloat16 if device.type == "cuda" else torch.float32,
                         gradient_checkpointing=trainable and args.enable_gradient_checkpointing,
                         cpu_offload=offload)
    if not trainable:
        # Frozen: it only runs under torch.no_grad (`batched`) and no optimizer holds it. Its parameters
        # keep requires_grad=True, as the actor's: compiled layers guard on that flag, and flipping it
        # would compile every layer again for this model (14 s of the first step on an H200).
        model.eval()
    return model


def load_critic(path, device, args):
    """A value model on the policy's body, as verl builds it: AutoModelForTokenClassification with one label
    (the body under `.model`, a new linear `.score` head), fp32 masters, sharded with FSDP2. Dropout off
    (transformers' default for the head is 0.1; verl sets 0 too), so values are deterministic."""
    config = AutoConfig.from_pretrained(path, num_labels=1)
    config.classifier_dropout = 0.0  # an attribute: from_pretrained drops a keyword its config class lacks
    model = AutoModelForTokenClassification.from_pretrained(path, config=config, dtype=torch.float32,
                                                            attn_implementation=attention(args))
    if device.type == "cuda" and not args.critic_param_offload:
        model.to(device)
    if gpu_default(args.compile_layers, device):
        sharding.compile_layers(model, with_grad=args.compile_update)
    sharding.apply_fsdp2(model, param_dtype=torch.bfloat16 if device.type == "cuda" else torch.float32,
                         gradient_checkpointing=args.critic_enable_gradient_checkpointing,
                         cpu_offload=args.critic_param_offload)
    return model


def lr_lambda(args, total_steps):
    """The actor's rate at each update step, as a fraction of --actor_lr: a linear warmup, then constant or
    a cosine down to --min_lr_ratio over the last --lr_decay_steps_ratio of the steps (held before it)."""
    warmup = args.lr_warmup_steps if args.lr_warmup_steps >= 0 else int(args.lr_warmup_steps_ratio * total_steps)
    decay_from = max(warmup, total_steps - round(args.lr_decay_steps_ratio * total_steps))
    low = args.min_lr_ratio

    def f(step):
        if step < warmup:
            return (step + 1) / warmup
        if args.lr_scheduler_type == "cosine" and step >= decay_from:
            progress = (step - decay_from) / max(1, total_steps - decay_from)
            return low + (1 - low) * 0.5 * (1 + math.cos(math.pi * progress))
        return 1.0
    return f


def batch_order(n_examples, batch_size, epoch, seed):
    """The prompts of each step of an epoch: a seeded shuffle, last partial batch dropped (verl)."""
    perm = torch.randperm(n_examples, generator=torch.Generator().manual_seed(seed + epoch)).tolist()
    return [perm[i:i + batch_size] for i in range(0, n_examples - batch_size + 1, batch_size)]


def rollout(engine, examples, args, tokenizer, reward_fn, seed, n, temperature):
    """Generate n responses per prompt and score them; returns the groups of all ranks, in order.

    Each tensor-parallel group generates its share of `examples` (the same list on every rank);
    each rank decodes and scores its own slice, then all slices are gathered, so every rank
    holds the whole batch, in the global order, and computes identical batch statistics.
    """
    rank, world = dist.get_rank(), dist.get_world_size()
    mine, my_slice = group_share(examples, rank, world, engine.tp)
    per_rank, k = len(examples) // world, args.logprob_check_prompts
    # the first k prompts of each rank's share; all of them when the update weighs by the engine's log-probs
    check = [args.rollout_is is not None or k < 0 or i % per_rank < k for i in range(len(mine))]
    outs = engine.generate([e.prompt_ids for e in mine], n=n, temperature=temperature, top_p=args.top_p,
                           top_k=args.top_k, max_tokens=args.max_response_length, seed=seed, logprobs=check)
    mine, outs = mine[my_slice], outs[my_slice]
    texts = tokenizer.batch_decode([s.token_ids for out in outs for s in out], skip_special_tokens=True)
    sources = [e.data_source for e in mine for _ in range(n)]
    truths = [e.ground_truth for e in mine for _ in range(n)]
    infos = [e.extra_info for e in mine for _ in range(n)]
    scores, extras, n_errors = reward.score_batch(reward_fn, sources, texts, truths, infos, args.reward_errors)
    flexible = [reward.compute_score(s, t, g, i, method="flexible") if s in reward.SCORERS else float("nan")
                for s, t, g, i in zip(sources, texts, truths, infos)]
    groups = []
    for i, (e, out) in enumerate(zip(mine, outs)):
        k = slice(i * n, (i + 1) * n)
        groups.append(dict(example=e, samples=out, texts=texts[k], scores=scores[k], flexible=flexible[k],
                           extras={key: v[k] for key, v in extras.items()}))
    gathered = gather_objects((groups, n_errors))
    return [g for gs, _ in gathered for g in gs], sum(e for _, e in gathered)


def generation_rows(groups, tokenizer, step):
    """One row per response, as verl's rollout_data_dir and validation_data_dir write them: the prompt and
    the response as text, the ground truth, the score, the step; then the flexible score (GSM8K) and the
    reward function's numeric extras."""
    rows = []
    for g in groups:
        prompt = tokenizer.decode(g["example"].prompt_ids, skip_special_tokens=True)
        for i, text in enumerate(g["texts"]):
            row = {"input": prompt, "output": text, "gts": g["example"].ground_truth, "score": g["scores"][i],
                   "step": step}
            if not math.isnan(g["flexible"][i]):
                row["score_flexible"] = g["flexible"][i]
            rows.append(row | {key: v[i] for key, v in g["extras"].items()})
    return rows


def dump_generations(directory, name, rows):
    """DIRECTORY/NAME.jsonl, one JSON object per row, written whole (a temporary file renamed) or not at all."""
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, f"{name}.jsonl")
    with open(path + ".tmp", "w") as f:
        f.writelines(json.dumps(row, ensure_ascii=False) + "\n" for row in rows)
    os.replace(path + ".tmp", path)


def validate(engine, val, args, tokenizer, reward_fn, step, n=1, temperature=0.0):
    """Greedy mean@1 (strict: the training reward; flexible: the last number) per data source, and
    with n > 1 sampled mean@n and pass@k for k = 1, 2, 4, ..., n; the reward function's numeric extras as
    val-aux/<source>/<key>/mean@n, and "acc", verl's name for a correctness flag, as val-core with its
    pass@k. Uneven shares are fine: groups generate independently. With --validation_data_dir, every
    response goes to a file, in the data's order."""
    examples = val.examples[:args.max_val_samples] if args.max_val_samples else val.examples
    share = examples[engine.dp_rank::engine.dp_size]
    outs = engine.generate([e.prompt_ids for e in share], n=n, temperature=temperature, top_p=1.0, top_k=-1,
                           max_tokens=args.max_response_length, seed=args.seed, logprobs=False)
    texts = tokenizer.batch_decode([s.token_ids for out in outs for s in out], skip_special_tokens=True)
    sources = [e.data_source for e in share for _ in range(n)]
    truths = [e.ground_truth for e in share for _ in range(n)]
    infos = [e.extra_info for e in share for _ in range(n)]
    strict, extras, _ = reward.score_batch(reward_fn, sources, texts, truths, infos, args.reward_errors)
    flex = [reward.compute_score(s, t, g, method="flexible") if s in reward.SCORERS else float("nan")
            for s, t, g in zip(sources, texts, truths)]
    if args.validation_data_dir:  # (index in the data, group) from every rank, then rank 0 writes them in order
        groups = [(engine.dp_rank + i * engine.dp_size,
                   dict(example=e, texts=texts[k], scores=strict[k], flexible=flex[k],
                        extras={key: v[k] for key, v in extras.items()}))
                  for i, e in enumerate(share) for k in [slice(i * n, (i + 1) * n)]]
        groups = sorted((g for gs in gather_objects(groups if engine.tp_rank == 0 else []) for g in gs),
                        key=lambda g: g[0])
        if dist.get_rank() == 0:
            dump_generations(args.validation_data_dir, str(step) if n == 1 else f"{step}_n{n}",
                             generation_rows([g for _, g in groups], tokenizer, step))
    rows = [(e.data_source, {key: v[k] for key, v in extras.items()} | dict(reward=strict[k], reward_flexible=flex[k]),
             [len(s.token_ids) for s in outs[i]]) for i, e in enumerate(share) for k in [slice(i * n, (i + 1) * n)]]
    return validation_metrics([r for rs in gather_objects(rows if engine.tp_rank == 0 else []) for r in rs], n)


def validation_metrics(rows, n):
    """The metrics of `validate` from one row per problem: (data_source, {score name: its n values},
    response lengths). The names are "reward", "reward_flexible" (NaN where the source has no flexible
    scorer) and the reward function's extras, which a problem lacks where its function returned none."""
    metrics = {}
    for source in sorted({r[0] for r in rows}):
        mine = [r for r in rows if r[0] == source]
        for name in dict.fromkeys(key for r in mine for key in r[1]):
            vals = np.array([r[1].get(name, [0.0] * n) for r in mine])  # a missing extra counts 0, as in training
            if np.isnan(vals).all():
                continue
            core = name in ("reward", "reward_flexible", "acc")
            metrics[f"val-{'core' if core else 'aux'}/{source}/{name}/mean@{n}"] = float(vals.mean())
            for k in reward.pass_ks(n) if core else []:
                metrics[f"val-core/{source}/{name}/pass@{k}"] = reward.pass_at_k(vals > 0, k)
        metrics[f"val-aux/{source}/response_length/mean"] = float(np.mean([x for r in mine for x in r[2]]))
    return metrics


def main(args):
    rank, world, device = init_distributed()
    check_args(args, world)
    if args.resume_mode == "disable" and sharding.list_checkpoints(args.default_local_dir):
        # a fresh run there would interleave its checkpoints with the old ones (and prune its own)
        raise SystemExit(f"{os.path.basename(__file__)}: {args.default_local_dir} holds checkpoints of an earlier "
                         "run; continue it with --resume_mode auto, or choose another --default_local_dir / "
                         "--experiment_name, or delete them")
    reward_fn = reward.load_reward_function(args.custom_reward_function_path, args.custom_reward_function_name)
    if gpu_default(args.use_torch_compile, device):
        compile_logits_math()
    random.seed(args.seed), np.random.seed(args.seed), torch.manual_seed(args.seed)  # same init on every rank
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    data_kw = dict(tokenizer=tokenizer, max_prompt_length=args.max_prompt_length,
                   filter_overlong_prompts=args.filter_overlong_prompts, truncation=args.truncation)
    val = load_rl_dataset(args.val_files.split(","), **data_kw) if args.test_freq > 0 or args.val_only else None
    train = None if args.val_only else load_rl_dataset(args.train_files.split(","), **data_kw)
    if train is not None and len(train) < args.train_batch_size:
        raise SystemExit(f"{os.path.basename(__file__)}: {args.train_files} holds {len(train)} usable prompts, "
                         f"fewer than --train_batch_size {args.train_batch_size}")
    steps_per_epoch = len(train) // args.train_batch_size if train else 0
    total_steps = args.total_training_steps or steps_per_epoch * args.total_epochs

    # models: the actor (trained), the reference (frozen, only when a KL term is on), the critic, the engine
    use_ref = (args.use_kl_loss or args.use_kl_in_reward) and not args.val_only
    actor = load_policy(args.model, device, not args.val_only, args.param_offload, args)
    ref = load_policy(args.model, device, False, args.ref_param_offload, args) if use_ref else None
    optimizer = torch.optim.AdamW(actor.parameters(), lr=args.actor_lr, weight_decay=args.weight_decay,
                                  betas=(0.9, 0.999))
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(args, total_steps))
    models, optimizers, schedulers = {"actor": actor}, {"actor": optimizer}, {"actor": scheduler}
    if not args.val_only:
        critic = load_critic(args.critic_model, device, args)
        critic_optimizer = torch.optim.AdamW(critic.parameters(), lr=args.critic_lr,
                                             weight_decay=args.critic_weight_decay, betas=(0.9, 0.999))
        critic_scheduler = torch.optim.lr_scheduler.LambdaLR(critic_optimizer, lambda _: 1.0)  # verl: constant
        models["critic"], optimizers["critic"], schedulers["critic"] = critic, critic_optimizer, critic_scheduler
    kl_ctrl = (AdaptiveKLController(args.kl_coef, args.kl_target, args.kl_horizon) if args.kl_ctrl_type == "adaptive"
               else FixedKLController(args.kl_coef))
    step, epoch, batch_idx = 0, 0, 0
    resume = sharding.latest_checkpoint(args.default_local_dir) if args.resume_mode == "auto" else (
        None if args.resume_mode == "disable" else args.resume_mode)
    if resume:
        state = sharding.load_checkpoint(resume, models, optimizers, schedulers)
        step, epoch, batch_idx = state["global_step"], state["epoch"], state["batch_idx"]
        kl_ctrl.value = state.get("kl_coef", kl_ctrl.value)
        if rank == 0:
            print(f"resumed from {resume} (step {step})", flush=True)
    if step >= total_steps and not args.val_only:
        if rank == 0:
            print(f"{os.path.basename(__file__)}: {resume} already finished {step} of {total_steps} steps; nothing "
                  "to do. Raise --total_training_steps / --total_epochs to train on, or use --resume_mode disable "
                  "to start over.")
        return
    models_loaded = seconds_since_launch()
    engine = make_engine(args.rollout_engine, args.model, engines_per_gpu=args.engines_per_gpu,
                         tensor_parallel_size=args.tensor_model_parallel_size,
                         gpu_memory_utilization=args.gpu_memory_utilization, max_num_seqs=args.max_num_seqs,
                         torch_compile=args.rollout_compile, seed=args.seed,
                         max_model_len=args.max_prompt_length + args.max_response_length,
                         dtype="bfloat16" if device.type == "cuda" else "float32",
                         enforce_eager=device.type != "cuda", load_format="dummy")
    ahead = not engine.in_process and not args.val_only and (gpu_default(args.compile_layers, device)
                                                             or gpu_default(args.use_torch_compile, device))
    if ahead:
        compile_ahead(actor, ref, critic, args, device)  # while the engines start in their own processes
    compiled = seconds_since_launch()
    push_dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    engine.update_weights(sharding.iter_full_tensors(actor, dtype=push_dtype, device=device))
    if rank == 0:  # where the time to the first step goes (docs/benchmarks.md, "The first step")
        print(f"models loaded {models_loaded:.1f} s after launch, "
              + (f"passes compiled ahead at {compiled:.1f} s, " if ahead else "")
              + f"engine ready at {seconds_since_launch():.1f} s", flush=True)
    logger = Logger(args, args.default_local_dir)
    logger.truncate(step - 1 if step == 0 else step)
    if args.val_only:
        metrics = validate(engine, val, args, tokenizer, reward_fn, step)
        if args.val_n > 1:
            metrics |= validate(engine, val, args, tokenizer, reward_fn, step, n=args.val_n,
                                temperature=args.val_temperature)
        logger.log(metrics, step)
        logger.close()
        return metrics
    if args.val_before_train and val is not None and step == 0:
        logger.log(validate(engine, val, args, tokenizer, reward_fn, step), step)
    peak_flops = measure_peak_flops(device) * world
    push_bytes = sum(p.numel() for p in actor.parameters()) * push_dtype.itemsize
    config = actor.config
    packed = args.use_remove_padding
    log_prob_tokens = args.log_prob_max_token_len_per_gpu if args.use_dynamic_bsz else None
    critic_tokens = args.critic_ppo_max_token_len_per_gpu if args.use_dynamic_bsz else None
    n, B = args.rollout_n, args.train_batch_size
    per_rank = B // world  # prompts per rank

    def next_prompts():
        nonlocal epoch, batch_idx
        order = batch_order(len(train), B, epoch, args.seed)
        if batch_idx >= len(order):
            epoch, batch_idx = epoch + 1, 0
            order = batch_order(len(train), B, epoch, args.seed)
        batch_idx += 1
        return [train[i] for i in order[batch_idx - 1]]

    stop, stopping = sharding.StopRequest(), False  # a SIGTERM checkpoints the step in progress and stops
    bar = tqdm(total=total_steps, initial=step, disable=rank != 0, desc="steps")
    while step < total_steps:
        step += 1
        metrics, timer = {}, Timer({}, device, engine)
        with timer("step"):
            # 1 generate: the engine (awake, holding the latest weights) samples n responses per prompt
            # 2 score: rule or user reward per response, in the same call
            with timer("gen"):
                groups, n_errors = rollout(engine, next_prompts(), args, tokenizer, reward_fn,
                                           seed=hash((args.seed, step, engine.dp_rank)) % 2**31, n=n,
                                           temperature=args.temperature)
                engine.sleep()
            if args.rollout_data_dir and rank == 0:  # the responses this step trains on, as text
                dump_generations(args.rollout_data_dir, str(step), generation_rows(groups, tokenizer, step))
            all_scores = torch.tensor([s for g in groups for s in g["scores"]])
            mine = groups[rank * per_rank:(rank + 1) * per_rank]
            samples = [(g["example"].prompt_ids, s.token_ids) for g in mine for s in g["samples"]]  # N/world
            T = max(max(len(r) for _, r in samples), 1)
            _, response_mask = response_targets(samples, T, device)  # (N/world, T)
            # the engine's own log-probs of the sampled tokens, for the sync check (rows `checked`; all with
            # --rollout_is)
            checked = [i for i, s in enumerate(s for g in mine for s in g["samples"]) if s.logprobs is not None]
            rollout_log_probs = torch.tensor([s.logprobs + [0.0] * (T - len(s.logprobs)) for g in mine
                                              for s in g["samples"] if s.logprobs is not None],
                                             device=device).reshape(len(checked), T)
            scores = torch.tensor([s for g in mine for s in g["scores"]], device=device)  # (N/world,)

            # 3 old and reference log-probs, recomputed by the FSDP2 actor (the engine's are a check); the
            # policy's entropy as verl reports it, from the old pass (the update computes it only for a bonus)
            with timer("old_log_prob"):
                old_log_probs, entropy = batched_log_probs(actor, samples, args.log_prob_micro_batch_size_per_gpu,
                                                           args.temperature, packed, T, log_prob_tokens,
                                                           with_entropy=True)
                n_tokens = all_sum(response_mask.sum().item(), device=device)[0]  # response tokens, all ranks
                mean_entropy = agg_loss(entropy, response_mask, args.loss_agg_mode, n_tokens, len(samples) * world,
                                        args.max_response_length)
                metrics["actor/entropy"] = all_sum(mean_entropy.item(), device=device)[0]
            is_weights = None
            if args.rollout_is:  # truncated importance sampling: from the engine's distribution to the trainer's
                is_weights, rho = rollout_is_weights(old_log_probs, rollout_log_probs, response_mask, args.rollout_is,
                                                     args.rollout_is_threshold)
                metrics |= rollout_is_metrics(is_weights, rho, response_mask, args.rollout_is_threshold, device)
            if ref is not None:
                with timer("ref"):
                    ref_log_probs, _ = batched_log_probs(ref, samples, args.log_prob_micro_batch_size_per_gpu,
                                                         args.temperature, packed, T, log_prob_tokens)

            # 3b values: the critic's estimate of each token's return, before its update
            with timer("values"):
                values = batched_values(critic, samples, args.critic_ppo_micro_batch_size_per_gpu, packed, T,
                                        critic_tokens)

            # 4 advantages: the score sits on the last response token; KL-in-reward subtracts beta * KL on
            # every token, then GAE. Over the whole batch, gathered on every rank: the controller's KL and
            # the whitening are batch statistics (verl computes them on the whole batch too).
            with timer("adv"):
                last = (response_mask.sum(-1).long() - 1).clamp(min=0)
                token_level_scores = torch.zeros_like(response_mask)
                token_level_scores[torch.arange(len(samples)), last] = scores
                batch_scores, batch_values, batch_mask, *batch_log_probs = gather_batch(
                    token_level_scores, values, response_mask,
                    *((old_log_probs, ref_log_probs) if args.use_kl_in_reward else ()))  # (N, T_max)
                batch_rewards = batch_scores
                if args.use_kl_in_reward:
                    metrics["actor/reward_kl_penalty_coeff"] = kl_ctrl.value  # the beta this step used
                    batch_rewards, metrics["actor/reward_kl_penalty"] = apply_kl_penalty(
                        batch_scores, *batch_log_probs, batch_mask, kl_ctrl.value, args.kl_penalty)
                    kl_ctrl.update(metrics["actor/reward_kl_penalty"], n_steps=len(batch_mask))
                batch_advantages, batch_returns = compute_gae_advantage_return(batch_rewards, batch_values,
                                                                               batch_mask, args.gamma, args.lam)
                metrics["critic/vf_explained_var"] = explained_variance(batch_returns, batch_values, batch_mask)
                my_rows = slice(rank * len(samples), (rank + 1) * len(samples))  # back to this rank's share
                token_level_rewards, advantages, returns = (x[my_rows, :T] for x in (batch_rewards, batch_advantages,
                                                                                     batch_returns))

            # 5a update the critic: clipped regression of the values toward the returns
            with timer("update_critic"):
                metrics["critic/lr"] = critic_scheduler.get_last_lr()[0]
                if args.critic_optimizer_offload:
                    sharding.move_optimizer_state(critic_optimizer, device)
                metrics |= update_critic(critic, critic_optimizer, samples, values, returns, response_mask, args,
                                         step, device)
                critic_scheduler.step()
                if args.critic_optimizer_offload:
                    sharding.move_optimizer_state(critic_optimizer, "cpu")

            # 5b update the actor once the critic has warmed up: mini-batches x epochs, micro-batch gradient
            # accumulation, global normalisation
            if step > args.critic_warmup:
                with timer("update_actor"):
                    metrics["actor/lr"] = scheduler.get_last_lr()[0]  # this update's rate (after step(): the next's)
                    if args.optimizer_offload:
                        sharding.move_optimizer_state(optimizer, device)
                    metrics |= update_actor(actor, optimizer, samples, old_log_probs,
                                            ref_log_probs if args.use_kl_loss else None, advantages,
                                            response_mask, args, step, device, is_weights)
                    scheduler.step()
                    if args.optimizer_offload:
                        sharding.move_optimizer_state(optimizer, "cpu")

            # 6 push the new weights into the engine: FSDP2 shards -> full tensors -> vLLM's loaders
            with timer("update_weights"):
                optimizer.zero_grad(set_to_none=True)
                engine.update_weights(sharding.iter_full_tensors(actor, dtype=push_dtype, device=device))

        # 7 log, validate, save
        lengths = torch.tensor([len(s.token_ids) for g in groups for s in g["samples"]], dtype=torch.float)
        prompt_tokens = sum(len(g["example"].prompt_ids) for g in groups) * n
        seq_len = (prompt_tokens + lengths.sum().item()) / len(lengths)
        t = timer.metrics
        metrics |= {
            "critic/score/mean": all_scores.mean().item(), "critic/score/max": all_scores.max().item(),
            "critic/score/min": all_scores.min().item(),
            "critic/rewards/mean": all_sum(token_level_rewards.sum().item(), device=device)[0] / len(lengths),
            "critic/advantages/mean": all_sum((advantages * response_mask).sum().item(), device=device)[0]
            / max(n_tokens, 1),
            "critic/values/mean": all_sum((values * response_mask).sum().item(), device=device)[0] / max(n_tokens, 1),
            "critic/returns/mean": all_sum((returns * response_mask).sum().item(), device=device)[0]
            / max(n_tokens, 1),
            "response_length/mean": lengths.mean().item(), "response_length/max": lengths.max().item(),
            "response_length/clip_ratio": float(np.mean([s.finish_reason == "length" for g in groups
                                                         for s in g["samples"]])),
            "response_length/empty": float((lengths == 0).sum().item()),
            "prompt_length/mean": prompt_tokens / len(lengths),
            "critic/score_flexible/mean": float(np.nanmean([f for g in groups for f in g["flexible"]]))
            if any(g["example"].data_source in reward.SCORERS for g in groups) else float("nan"),
            "rollout/logprob_gap_mean": logprob_gap(old_log_probs[checked], rollout_log_probs,
                                                    response_mask[checked]),
            "reward/errors": float(n_errors),
            "perf/throughput": (prompt_tokens + lengths.sum().item()) / t["timing_s/step"] / world,
            "perf/gen_tokens_per_s": lengths.sum().item() / t["timing_s/gen"],
            "perf/max_memory_allocated_gb": max([v for k, v in t.items() if k.startswith("perf/max_memory")],
                                                default=0.0),
            "training/global_step": step, "training/epoch": epoch,
            "timing_s/since_launch": seconds_since_launch(),
        } | t
        metrics |= phase_perf(t, config, seq_len, prompt_tokens + lengths.sum().item(), lengths.sum().item(),
                              peak_flops, args.ppo_epochs, push_bytes)  # no actor MFU during the critic's warm-up
        for key in {k for g in groups for k in g["extras"]}:
            metrics[f"critic/score/{key}/mean"] = float(np.mean([x for g in groups for x in g["extras"].get(key, [])]))
        last_step = step == total_steps
        stopping = not last_step and stop.agreed(device)  # checkpointed at once, not validated
        if val is not None and args.test_freq > 0 and (step % args.test_freq == 0 or last_step) and not stopping:
            with Timer(metrics, device)("testing"):
                metrics |= validate(engine, val, args, tokenizer, reward_fn, step)
            stopping = not last_step and stop.agreed(device)  # a SIGTERM during validation: this step, too
        if args.save_freq > 0 and (step % args.save_freq == 0 or last_step or stopping):
            with Timer(metrics, device)("save_checkpoint"):
                sharding.save_checkpoint(args.default_local_dir, step, models, optimizers, schedulers,
                                         {"epoch": epoch, "batch_idx": batch_idx, "kl_coef": kl_ctrl.value},
                                         keep_last=args.keep_last_checkpoints)
            # one during the checkpoint: the run stops now, the checkpoint holds this step
            stopping = stopping or (not last_step and stop.agreed(device))
        logger.log(metrics, step)
        bar.update(1)
        if stopping:
            break
    bar.close()
    if stopping:
        if rank == 0:
            if args.save_freq > 0:
                print(f"stopped by SIGTERM after step {step} of {total_steps}, checkpointed in "
                      f"{args.default_local_dir}; the same command with --resume_mode auto continues from there",
                      flush=True)
            else:
                print(f"stopped by SIGTERM after step {step} of {total_steps}, not checkpointed (--save_freq "
                      f"{args.save_freq}: never)", flush=True)
        logger.close()
        return metrics
    if args.export_final:
        path = sharding.export_hf(os.path.join(args.default_local_dir, "hf_model"), actor, tokenizer)
        if rank == 0:
            print(f"done: {step} steps; metrics {logger.path}; checkpoints {args.default_local_dir}; "
                  f"final policy (Hugging Face format) {path}", flush=True)
    logger.close()
    return metrics


def clip_and_step(model, optimizer, max_norm, step, lr_flag):
    """Clip the global gradient norm and step; a non-finite norm stops the run before the update, so
    the last checkpoint stays the last good state. Returns the norm before clipping."""
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    grad_norm = grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm
    if not torch.isfinite(grad_norm):
        raise FloatingPointError(f"step {step}: non-finite gradient norm {grad_norm.item()}; stopping before the "
                                 f"update (the last checkpoint is untouched). Lower {lr_flag}.")
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return grad_norm.item()


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
            tokens = all_sum(response_mask[start:stop].sum().item(), device=device)[0]
            seqs = (stop - start) * world
            mini_loss = torch.zeros((), device=device)
            for idx in micro_batches(samples[start:stop], micro, max_tokens):
                mb = [start + i for i in idx]
                log_probs, entropy = forward_log_probs(actor, [samples[i] for i in mb], args.temperature,
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
            grad_norms.append(clip_and_step(actor, optimizer, args.grad_clip, step, "--actor_lr"))
            n_updates += 1
    totals = all_sum(*(v.item() for v in sums.values()), device=device)
    metrics = {f"actor/{k}": v / n_updates for k, v in zip(sums, totals)}
    metrics["actor/grad_norm"] = float(np.mean(grad_norms))
    actor.eval()
    return metrics


def update_critic(critic, optimizer, samples, values, returns, response_mask, args, step, device):
    """Clipped value regression on a rank's share of the batch, over the actor's mini-batches; returns
    critic/* metrics."""
    # train mode for the update only, as the actor's: gradient checkpointing acts only in it
    critic.train()
    world = dist.get_world_size()
    mini = args.ppo_mini_batch_size * args.rollout_n // world  # sequences per rank per optimizer step
    micro = args.critic_ppo_micro_batch_size_per_gpu
    max_tokens = args.critic_ppo_max_token_len_per_gpu if args.use_dynamic_bsz else None
    sums = {k: torch.zeros((), device=device) for k in ("vf_loss", "vf_clipfrac", "vpred_mean")}  # on the device
    grad_norms, n_updates = [], 0
    for _ in range(args.ppo_epochs):
        for start in range(0, len(samples), mini):
            stop = min(start + mini, len(samples))  # the last mini-batch may be smaller, as in verl
            tokens = all_sum(response_mask[start:stop].sum().item(), device=device)[0]
            seqs = (stop - start) * world
            mini_loss = torch.zeros((), device=device)
            for idx in micro_batches(samples[start:stop], micro, max_tokens):
                mb = [start + i for i in idx]
                vpreds = forward_values(critic, [samples[i] for i in mb], args.use_remove_padding)
                Tm = vpreds.shape[1]
                mask = response_mask[mb, :Tm]
                vf_loss, stats = compute_value_loss(vpreds, values[mb, :Tm], returns[mb, :Tm], mask,
                                                    args.cliprange_value, args.loss_agg_mode, tokens, seqs,
                                                    args.max_response_length)
                loss = args.vf_coef * vf_loss
                (loss * world).backward()  # FSDP2 averages gradients over ranks; the loss is a global mean
                mini_loss += loss.detach()
                sums["vf_loss"] += vf_loss.detach()
                sums["vf_clipfrac"] += stats["vf_clipfrac"] / tokens
                sums["vpred_mean"] += (vpreds.detach() * mask).sum() / tokens
            if not torch.isfinite(mini_loss):
                raise FloatingPointError(f"step {step}: non-finite critic loss {mini_loss.item()}; stopping before the "
                                         "update (the last checkpoint is untouched). Lower --critic_lr.")
            grad_norms.append(clip_and_step(critic, optimizer, args.critic_grad_clip, step, "--critic_lr"))
            n_updates += 1
    totals = all_sum(*(v.item() for v in sums.values()), device=device)
    metrics = {f"critic/{k}": v / n_updates for k, v in zip(sums, totals)}
    metrics["critic/grad_norm"] = float(np.mean(grad_norms))
    critic.eval()
    return metrics


def made_up_batch(args):
    """compile_ahead's sequences and their response length. With --use_dynamic_bsz, enough sequences of
    8 + --max_response_length tokens to fill the largest token budget, as a real step's micro-batches nearly
    do: inductor's code, and the guards it puts on it, change with size (past 2**31 logits it indexes in 64
    bits; some fusions it allows only below a size), and a pass compiled on 20 tokens compiled again at the
    real 50-65k in the first step on an H200 (8 s, docs/benchmarks.md). Otherwise two short sequences. The
    last sequence is shorter than the others, and no size is 1, on which torch.compile would specialise."""
    R = args.max_response_length
    if not args.use_dynamic_bsz:
        return [(list(range(1, 9)), list(range(1, 13))), (list(range(1, 5)), list(range(1, 7)))], 12
    budget = max(args.log_prob_max_token_len_per_gpu, args.ppo_max_token_len_per_gpu,
                  args.critic_ppo_max_token_len_per_gpu)
    count = max(2, budget // (8 + R))
    response = [j % 97 + 1 for j in range(R)]
    return [(list(range(1, 9)), response)] * (count - 1) + [(list(range(1, 9)), response[:max(2, R // 2)])], R


def compile_ahead(actor, ref, critic, args, device):
    """Compile a step's passes before the first step: the old (and reference) log-prob passes, the values and
    both updates, on a made-up batch (`made_up_batch`), the actor's with advantages of 0, each with a throwaway
    SGD at learning rate 0, so the weights and the optimizers' state stay as they were. torch.compile's graphs
    take dynamic shapes: the real batches reuse them. With --engines_per_gpu the engines start in their own
    processes meanwhile, so the compiling (about 50 s of a GRPO step on an H200, docs/benchmarks.md) overlaps
    their start."""
    no_step = torch.optim.SGD(actor.parameters(), lr=0.0)  # taken before a forward unshards the root's parameters
    no_critic_step = torch.optim.SGD(critic.parameters(), lr=0.0)
    samples, T = made_up_batch(args)
    _, response_mask = response_targets(samples, T, device)
    budget = args.log_prob_max_token_len_per_gpu if args.use_dynamic_bsz else None
    old_log_probs, _ = batched_log_probs(actor, samples, args.log_prob_micro_batch_size_per_gpu, args.temperature,
                                         args.use_remove_padding, T, budget, with_entropy=True)
    ref_log_probs = None
    if ref is not None:
        ref_log_probs, _ = batched_log_probs(ref, samples, args.log_prob_micro_batch_size_per_gpu, args.temperature,
                                             args.use_remove_padding, T, budget)
    values = batched_values(critic, samples, args.critic_ppo_micro_batch_size_per_gpu, args.use_remove_padding, T,
                            args.critic_ppo_max_token_len_per_gpu if args.use_dynamic_bsz else None)
    update_critic(critic, no_critic_step, samples, values, torch.zeros_like(values), response_mask, args, 0, device)
    update_actor(actor, no_step, samples, old_log_probs,
                 ref_log_probs if args.use_kl_loss else None, torch.zeros_like(response_mask), response_mask, args, 0,
                 device)


if __name__ == "__main__":
    (parsed,) = HfArgumentParser(Args).parse_args_into_dataclasses()
    try:
        main(parsed)
    finally:
        # vLLM tears the process group down itself when its engine is collected; only then is it
        # safe (and needed) to destroy it here.
        if dist.is_initialized():
            dist.barrier()
    # A finished run has written everything (metrics, checkpoints, the export) and closed its loggers. It
    # ends without the interpreter's teardown, which shuts vLLM's engine down and collects what it held:
    # 4-6 s per process on CPU, for nothing. An EnginePool's engines exit when their pipes close.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
