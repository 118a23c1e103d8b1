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

import concurrent.futures
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
from transformers import AutoModelForCausalLM, AutoTokenizer, HfArgumentParser

import reward
import sharding
from data.dataset import load_rl_dataset
from rollout import exclusive_tracing, group_share, logprob_gap, make_engine, turn_to_generate

IMPORTED = time.time()


@dataclass
class Args:
    # model and data
    model: str = field(default="Qwen/Qwen2.5-0.5B-Instruct", metadata={"help": "hub id or local folder"})
    train_files: str = field(default="~/data/gsm8k/train.parquet", metadata={"help": "parquet, comma-separated"})
    val_files: str = field(default="~/data/gsm8k/test.parquet", metadata={"help": "parquet, comma-separated"})
    train_batch_size: int = field(default=256, metadata={"help": "prompts per step (all ranks)"})
    max_prompt_length: int = field(default=512, metadata={"help": "tokens, after the chat template"})
    max_response_length: int = field(default=1024, metadata={"help": "tokens generated at most"})
    filter_overlong_prompts: bool = field(default=False, metadata={"help": "drop prompts over max_prompt_length"})
    truncation: str = field(default="error", metadata={"help": "overlong prompts when not filtered: error|left|right"})
    # rollout
    rollout_engine: str = field(default="vllm", metadata={"help": "vllm | hf (transformers generate)"})
    rollout_n: int = field(default=5, metadata={"help": "responses per prompt (the group size)"})
    temperature: float = field(default=1.0, metadata={"help": "sampling temperature"})
    top_p: float = field(default=1.0, metadata={"help": "nucleus sampling"})
    top_k: int = field(default=-1, metadata={"help": "-1 = off"})
    tensor_model_parallel_size: int = field(default=1, metadata={"help": "GPUs per vLLM replica"})
    logprob_check_prompts: int = field(default=8, metadata={
        "help": "prompts per GPU per step whose engine log-probs are checked (rollout/logprob_gap_mean); -1: all"})
    gpu_memory_utilization: float = field(default=0.6, metadata={"help": "vLLM's share of GPU memory while awake"})
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
    norm_adv_by_std_in_grpo: bool = field(default=True, metadata={"help": "false = Dr.GRPO"})
    entropy_coeff: float = field(default=0.0, metadata={"help": "entropy bonus"})
    rollout_is: str | None = field(default=None, metadata={
        "help": "token | sequence: weight each token's loss by pi_old / pi_rollout, the trainer's over the engine's "
                "probability of the sampled tokens, truncated at --rollout_is_threshold (truncated importance "
                "sampling, verl's algorithm.rollout_correction.rollout_is): corrects for the engine's numerics "
                "and, with --one_step_off_policy, for the update between the weights that sampled and the "
                "trainer's. Asks the engine for the log-probs of every response. With --top_p or --top_k on, the "
                "engine's are of the truncated distribution, so the weights sit below 1"})
    rollout_is_threshold: float = field(default=2.0, metadata={"help": "rollout_is: the weights' upper bound"})
    use_kl_loss: bool = field(default=True, metadata={"help": "KL to the reference model in the loss"})
    kl_loss_coef: float | None = field(default=None, metadata={"help": "default 0.001 when use_kl_loss"})
    kl_loss_type: str = field(default="low_var_kl", metadata={"help": "k1 | k2 | k3 | low_var_kl | abs | mse"})
    use_kl_in_reward: bool = field(default=False, metadata={"help": "subtract kl_coef * KL from the reward"})
    kl_coef: float | None = field(default=None, metadata={"help": "default 0.001 when use_kl_in_reward"})
    filter_groups: bool = field(default=False, metadata={"help": "DAPO dynamic sampling: drop all-equal groups"})
    max_num_gen_batches: int = field(default=10, metadata={
        "help": "filter_groups: generation rounds per step at most; 0: no limit (verl's meaning)"})
    gen_batch_size: int = field(default=0, metadata={
        "help": "filter_groups: prompts a generation round takes at most (DAPO: 3 x train_batch_size); "
                "0: train_batch_size"})
    filter_groups_from_step: int = field(default=1, metadata={
        "help": "filter_groups: the first step that filters; the steps before it train on one batch as generated "
                "(while the reward is still 0 almost everywhere, too few groups vary to fill a batch)"})
    skip_all_equal: bool = field(default=False, metadata={
        "help": "filter_groups: GRESO's selective rollout: on filtering steps, skip before generating a prompt "
                "whose latest group scored all-equal (the filter would likely drop its group again)"})
    skip_explore_prob: float = field(default=0.5, metadata={
        "help": "skip_all_equal: a prompt whose last z groups in a row scored all-equal is generated anyway "
                "with probability P**z"})
    one_step_off_policy: bool = field(default=False, metadata={
        "help": "generate the next step's batch in a second thread while this step trains, with the weights from "
                "before this step's update (one-step off-policy, as verl's recipe of that name). The engine stays "
                "awake: give it less memory (--gpu_memory_utilization 0.3 on an H200). Measured on one H200 with a "
                "0.5B model: steps 7-13% shorter (the two share the GPU and the Python interpreter, so each ran "
                "slower), and in one learning run lower accuracy by step and by minute (docs/benchmarks.md)"})
    # memory
    enable_gradient_checkpointing: bool = field(default=False, metadata={"help": "recompute activations"})
    param_offload: bool = field(default=False, metadata={"help": "actor params, grads and optimizer on CPU"})
    optimizer_offload: bool = field(default=False, metadata={"help": "optimizer state on CPU between steps"})
    ref_param_offload: bool = field(default=False, metadata={"help": "reference model params on CPU"})
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
        "help": "compile the decoder layers in the actor's update (forward and backward) too, where --compile_layers "
        "compiles (--use_torch_compile already covers the update's log-prob math): pays off with large "
        "micro-batches (--use_dynamic_bsz, --ppo_max_token_len_per_gpu 49152 on an H200), costs about 30 s more "
        "compiling in the first step on a fresh machine (docs/benchmarks.md)"})
    # reward
    custom_reward_function_path: str | None = field(default=None, metadata={"help": "a .py file"})
    custom_reward_function_name: str = field(default="compute_score", metadata={"help": "function in that file"})
    reward_errors: str = field(default="raise", metadata={"help": "raise | zero: a failing reward call scores 0"})
    # trainer
    total_epochs: int = field(default=15, metadata={"help": "passes over the training prompts"})
    total_training_steps: int | None = field(default=None, metadata={"help": "overrides total_epochs"})
    save_freq: int = field(default=-1, metadata={"help": "checkpoint every N steps, the last, on a stop (-1: never)"})
    test_freq: int = field(default=10, metadata={"help": "validate every N steps (-1: never)"})
    val_before_train: bool = field(default=True, metadata={"help": "validate before the first step"})
    val_only: bool = field(default=False, metadata={"help": "only evaluate --model (or the checkpoint) and exit"})
    val_n: int = field(default=1, metadata={"help": "val_only: samples per prompt for pass@k (T=val_temperature)"})
    val_temperature: float = field(default=1.0, metadata={"help": "val_only: temperature of the pass@k samples"})
    max_val_samples: int | None = field(default=None, metadata={"help": "validate on the first N prompts"})
    resume_mode: str = field(default="auto", metadata={"help": "auto | disable | a global_step_N folder"})
    default_local_dir: str | None = field(default=None, metadata={"help": "default checkpoints/PROJECT/EXPERIMENT"})
    keep_last_checkpoints: int = field(default=2, metadata={"help": "checkpoints kept on disk"})
    export_final: bool = field(default=True, metadata={"help": "write the final policy as a HF folder"})
    rollout_data_dir: str | None = field(default=None, metadata={
        "help": "write the responses each step trains on (text, score) to DIR/STEP.jsonl"})
    validation_data_dir: str | None = field(default=None, metadata={
        "help": "write each validation's responses to DIR/STEP.jsonl (DIR/STEP_nN.jsonl for --val_n N)"})
    logger: str = field(default="console,jsonl", metadata={"help": "comma list of console, jsonl, wandb, tensorboard"})
    project_name: str = field(default="grpo_gsm8k", metadata={"help": "for wandb / tensorboard / folders"})
    experiment_name: str = field(default="qwen2.5_0.5b", metadata={"help": "for wandb / tensorboard / folders"})
    seed: int = field(default=1, metadata={"help": "model init and data order; sampling uses seed + group"})


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


def gather_objects(obj, group=None):
    """Every rank's `obj`, in rank order, on every rank (over `group`, default: the default group)."""
    if not dist.is_initialized():
        return [obj]
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj, group=group)
    return out


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
    need(args.rollout_n > 1, "--rollout_n must be > 1: GRPO compares responses within a group")
    need(args.train_batch_size % world_size == 0,
         f"--train_batch_size {args.train_batch_size} must be divisible by the number of GPUs {world_size}")
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
    need(args.ppo_mini_batch_size <= args.train_batch_size,
         f"--ppo_mini_batch_size {args.ppo_mini_batch_size} must not exceed --train_batch_size {args.train_batch_size}")
    need(args.ppo_mini_batch_size * args.rollout_n % world_size == 0,
         f"--ppo_mini_batch_size x --rollout_n ({args.ppo_mini_batch_size * args.rollout_n}) must be divisible by "
         f"the number of GPUs {world_size}")
    need(not args.one_step_off_policy or args.tensor_model_parallel_size == 1,
         "--one_step_off_policy needs --tensor_model_parallel_size 1: the engine's tensor-parallel collectives would "
         "run beside the trainer's in another thread, in no fixed order between ranks")
    need(args.max_num_seqs >= 1, f"--max_num_seqs {args.max_num_seqs} must be at least 1")
    need(world_size % args.tensor_model_parallel_size == 0,
         f"--tensor_model_parallel_size {args.tensor_model_parallel_size} must divide the number of GPUs {world_size}")
    longest = args.max_prompt_length + args.max_response_length
    for flag in ("ppo_max_token_len_per_gpu", "log_prob_max_token_len_per_gpu"):
        need(not args.use_dynamic_bsz or getattr(args, flag) >= longest,
             f"--{flag} {getattr(args, flag)} must hold the longest sequence, --max_prompt_length + "
             f"--max_response_length = {longest}")
    need(args.kl_loss_coef is None or args.use_kl_loss, "--kl_loss_coef is set but --use_kl_loss is false")
    need(args.kl_coef is None or args.use_kl_in_reward, "--kl_coef is set but --use_kl_in_reward is false")
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
    args.kl_loss_coef = 0.001 if args.kl_loss_coef is None else args.kl_loss_coef
    args.kl_coef = 0.001 if args.kl_coef is None else args.kl_coef
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


def epoch_order(n_examples, epoch, seed):
    """The training prompts' order in an epoch: a seeded shuffle, a new one each epoch."""
    return torch.randperm(n_examples, generator=torch.Generator().manual_seed(seed + epoch)).tolist()


def batch_order(n_examples, batch_size, epoch, seed):
    """The prompts of each step of an epoch when each step takes one batch: last partial batch dropped (verl)."""
    perm = epoch_order(n_examples, epoch, seed)
    return [perm[i:i + batch_size] for i in range(0, n_examples - batch_size + 1, batch_size)]


class PromptOrder:
    """A cursor over the epochs' orders. A generation round looks at the next m prompts (`peek`), then
    moves past the ones it used (`advance`). When fewer than m remain, the epoch ends and they are
    dropped, as verl drops the last partial batch. (epoch, offset) is the position a checkpoint keeps.
    Example: 10 prompts, rounds that look at 4 and use 4, 3, 2: offsets 4, 7, then a new epoch (3 left < 4),
    whose first 2 prompts the third round uses."""

    def __init__(self, n_examples, seed, epoch=0, offset=0):
        self.n, self.seed, self.epoch, self.offset = n_examples, seed, epoch, offset

    def peek(self, m):
        if self.offset + m > self.n:
            self.epoch, self.offset = self.epoch + 1, 0
        return epoch_order(self.n, self.epoch, self.seed)[self.offset:self.offset + m]

    def advance(self, k):
        self.offset += k


def round_size(missing, kept, generated, G, world):
    """Prompts a --filter_groups generation round generates, of the G it looks at.

    The whole batch while nothing has been kept this step (the first round, or rounds that kept nothing).
    After that, enough prompts for the `missing` groups at the share of groups kept so far, 20% over,
    rounded up to a multiple of the ranks: generating the whole batch would only make groups that are
    dropped once the step has its train_batch_size. The rest stay next in the epoch's order (PromptOrder).
    Example: 26 groups missing after 230 of 512 were kept: 26 * 512 / 230 * 1.2 = 69.5, so 70 prompts.
    """
    if kept == 0:
        return G
    k = -(-missing * generated * 6 // (kept * 5))  # ceil(missing / (kept / generated) * 1.2)
    return min(G, -(-k // world) * world)


def selective_rollout(indices, streak, explore, seed, world):
    """GRESO's pre-rollout skip (Zheng et al. 2025): the prompts of `indices` to generate.

    A prompt whose last z groups in a row scored all-equal (`streak[i]` = z) is kept with probability
    explore**z, any other always; the draw is seeded, so every rank keeps the same prompts. The kept
    ones are cut to a multiple of the ranks (each generates an equal share), in their order.
    Example: streaks [0, 1, 2] with explore 0.5 keep the first always, the second half the time and
    the third a quarter of the time.
    """
    draw = random.Random(seed)
    kept = [i for i in indices if streak[i] == 0 or draw.random() < explore ** streak[i]]
    return kept[:len(kept) // world * world]


def rollout(engine, examples, args, tokenizer, reward_fn, seed, n, temperature, group=None):
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
    gathered = gather_objects((groups, n_errors), group)
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
    G = args.gen_batch_size or args.train_batch_size  # prompts per generation round
    if train is not None and len(train) < max(args.train_batch_size, G):
        flag = "--gen_batch_size" if G > args.train_batch_size else "--train_batch_size"
        raise SystemExit(f"{os.path.basename(__file__)}: {args.train_files} holds {len(train)} usable prompts, "
                         f"fewer than {flag} {max(args.train_batch_size, G)}")
    steps_per_epoch = len(train) // args.train_batch_size if train else 0
    total_steps = args.total_training_steps or steps_per_epoch * args.total_epochs

    # models: the actor (trained), the reference (frozen, only when a KL term is on), the engine
    use_ref = (args.use_kl_loss or args.use_kl_in_reward) and not args.val_only
    actor = load_policy(args.model, device, not args.val_only, args.param_offload, args)
    ref = load_policy(args.model, device, False, args.ref_param_offload, args) if use_ref else None
    optimizer = torch.optim.AdamW(actor.parameters(), lr=args.actor_lr, weight_decay=args.weight_decay,
                                  betas=(0.9, 0.999))
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(args, total_steps))
    step, epoch, offset = 0, 0, 0  # the global step; the data's epoch, and the prompts of it already used
    # per train prompt: how many of its latest groups in a row scored all-equal on filtering steps
    streak = [0] * (len(train) if train else 0)
    resume = sharding.latest_checkpoint(args.default_local_dir) if args.resume_mode == "auto" else (
        None if args.resume_mode == "disable" else args.resume_mode)
    if resume:
        state = sharding.load_checkpoint(resume, {"actor": actor}, {"actor": optimizer}, {"actor": scheduler})
        step, epoch = state["global_step"], state["epoch"]
        # checkpoints before the cursor counted whole rounds of their --gen_batch_size
        offset = state.get("data_offset",
                           state.get("batch_idx", 0) * state.get("gen_batch_size", args.train_batch_size))
        for i, z in state.get("all_equal_streak", {}).items():  # JSON made the prompt indices strings
            if int(i) < len(streak):  # (--train_files may have changed since)
                streak[int(i)] = z
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
        compile_ahead(actor, ref, args, device)  # while the engines start in their own processes
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
    n, B = args.rollout_n, args.train_batch_size
    per_rank = B // world  # prompts per rank

    order = PromptOrder(len(train), args.seed, epoch, offset) if train else None

    def generate_batch(step):
        """Step `step`'s batch: B groups of n scored responses, in generation rounds until B groups are kept
        (with --filter_groups, only groups whose scores vary), and the rollout/* counts. With
        --one_step_off_policy it runs in a second thread, beside the previous step's training."""
        t0 = time.perf_counter()
        groups, n_errors, rounds, n_prompts, n_all_equal, n_none, n_all, gen_tokens = [], 0, 0, 0, 0, 0, 0, 0
        n_drawn, n_skipped = 0, 0
        filtering = args.filter_groups and step >= args.filter_groups_from_step
        while len(groups) < B:
            rounds += 1
            look = order.peek(G if filtering else B)  # the next prompts of the epoch
            kept = look
            if filtering and args.skip_all_equal:  # skip what the filter would likely drop
                kept = selective_rollout(look, streak, args.skip_explore_prob,
                                         hash((args.seed, step, rounds)) % 2**31, world)
            # the rounds after the first generate only what the step still needs; the round moves past the
            # prompts it used: all it looked at, or, when it generates only some, up to the last of those
            indices = kept[:round_size(B - len(groups), len(groups), n_prompts, G, world)] if filtering else kept
            pos = {i: j for j, i in enumerate(look)}
            used = len(look) if len(indices) == len(kept) else pos[indices[-1]] + 1
            order.advance(used)
            n_drawn += used
            n_skipped += used - sum(pos[i] < used for i in kept)
            n_prompts += len(indices)
            new, errs = rollout(engine, [train[i] for i in indices], args, tokenizer, reward_fn,
                                seed=hash((args.seed, step, rounds, engine.dp_rank)) % 2**31, n=n,
                                temperature=args.temperature, group=gen_group) if indices else ([], 0)  # all skipped
            n_errors += errs
            gen_tokens += sum(len(s.token_ids) for g in new for s in g["samples"])  # kept or not
            equal = [len(set(g["scores"])) == 1 for g in new]  # zero advantage: nothing to learn
            n_all_equal += sum(equal)
            n_none += sum(max(g["scores"]) <= 0 for g in new)  # too hard for the policy, for now
            n_all += sum(min(g["scores"]) >= 1 for g in new)  # learned
            if filtering:  # DAPO's dynamic sampling: keep the others, generate more
                for i, e in zip(indices, equal):  # each prompt's all-equal streak, for --skip_all_equal
                    streak[i] = streak[i] + 1 if e else 0
                new = [g for g, e in zip(new, equal) if not e]
                if 0 < args.max_num_gen_batches <= rounds and len(groups) + len(new) < B:
                    raise RuntimeError(
                        f"step {step}: --filter_groups kept {len(groups) + len(new)} of {B} groups after "
                        f"{rounds} generation rounds (--max_num_gen_batches); all-equal scores dominate: "
                        "check the reward, raise --rollout_n or --max_num_gen_batches, or start filtering "
                        "once the reward varies (--filter_groups_from_step)")
            groups += new
        return dict(groups=groups[:B], n_errors=n_errors, rounds=rounds, n_prompts=n_prompts, n_all_equal=n_all_equal,
                    n_none=n_none, n_all=n_all, gen_tokens=gen_tokens, n_drawn=n_drawn, n_skipped=n_skipped,
                    epoch=order.epoch, seconds=time.perf_counter() - t0)

    def push_weights():
        engine.update_weights(sharding.iter_full_tensors(actor, dtype=push_dtype, device=device))

    def data_position():  # where the data stands, for a checkpoint: a resume draws the next prompts from there
        return {"epoch": order.epoch, "data_offset": order.offset,
                "all_equal_streak": {i: z for i, z in enumerate(streak) if z}}

    # --one_step_off_policy: the batch of step k+1 is generated, in a second thread, while step k trains.
    # The engine then holds the weights from before step k's update; they are pushed once that batch is
    # done (`stale` until then), so each batch is trained on one update after the weights that sampled it.
    overlap = args.one_step_off_policy
    pool = None
    if overlap:  # (CUDA's current device is per thread: the second one would start on GPU 0)
        init = (torch.cuda.set_device, (device,)) if device.type == "cuda" else (None, ())
        pool = concurrent.futures.ThreadPoolExecutor(1, "rollout", *init)
        if engine.in_process:  # the trainer's compiles and that thread's generations take turns (rollout.py)
            exclusive_tracing()

    def generate_beside(step):
        with turn_to_generate(engine):
            return generate_batch(step)

    # that thread gathers the ranks' groups over a group of its own: the trainer's collectives run meanwhile
    gen_group = dist.new_group(backend="gloo") if overlap else None
    pending, stale, drawn_from = None, False, None  # the next batch; the data position before it
    stop, stopping = sharding.StopRequest(), False  # a SIGTERM checkpoints the step in progress and stops
    bar = tqdm(total=total_steps, initial=step, disable=rank != 0, desc="steps")
    while step < total_steps:
        step += 1
        metrics, timer = {}, Timer({}, device, engine)
        with timer("step"):
            # 1 generate: the engine (awake, holding the latest weights) samples n responses per prompt
            # 2 score: rule or user reward per response, in the same call
            with timer("gen"):  # --one_step_off_policy: the wait for the batch generated during the last step
                batch = pending.result() if pending else generate_batch(step)
                pending = None
            if overlap:
                if stale:  # the engine is idle now: the last update's weights go in
                    with timer("update_weights"):
                        push_weights()
                    stale = False
                if step < total_steps:  # and generate the next batch with them while this one trains
                    drawn_from = data_position()
                    sync(device)  # the push's copies are done before the other thread's stream reads the weights
                    pending = pool.submit(generate_beside, step + 1)
            else:
                engine.sleep()
            groups = batch["groups"]
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

            # 4 advantages: the score sits on the last response token; KL-in-reward spreads -kl_coef * KL
            with timer("adv"):
                last = (response_mask.sum(-1).long() - 1).clamp(min=0)
                token_level_rewards = torch.zeros_like(response_mask)
                token_level_rewards[torch.arange(len(samples)), last] = scores
                if args.use_kl_in_reward:
                    kl = kl_penalty(old_log_probs, ref_log_probs, "k1") * response_mask
                    token_level_rewards = token_level_rewards - args.kl_coef * kl
                    metrics["actor/reward_kl_penalty"] = all_sum(kl.sum().item(), device=device)[0] / max(
                        1, all_sum(response_mask.sum().item(), device=device)[0])
                advantages = compute_grpo_outcome_advantage(token_level_rewards.sum(-1), response_mask, n,
                                                            args.norm_adv_by_std_in_grpo)

            # 5 update: mini-batches x epochs, micro-batch gradient accumulation, global normalisation
            with timer("update_actor"):
                lr = scheduler.get_last_lr()[0]  # the rate of this update (after step() it is the next one's)
                if args.optimizer_offload:
                    sharding.move_optimizer_state(optimizer, device)
                update_stats = update_actor(actor, optimizer, samples, old_log_probs,
                                            ref_log_probs if args.use_kl_loss else None, advantages,
                                            response_mask, args, step, device, is_weights)
                scheduler.step()
                if args.optimizer_offload:
                    sharding.move_optimizer_state(optimizer, "cpu")

            # 6 push the new weights into the engine: FSDP2 shards -> full tensors -> vLLM's loaders (with
            # --one_step_off_policy once the engine has generated the next batch: at the next step's start)
            optimizer.zero_grad(set_to_none=True)
            if overlap:
                stale = True
            else:
                with timer("update_weights"):
                    push_weights()

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
            "response_length/mean": lengths.mean().item(), "response_length/max": lengths.max().item(),
            "response_length/clip_ratio": float(np.mean([s.finish_reason == "length" for g in groups
                                                         for s in g["samples"]])),
            "response_length/empty": float((lengths == 0).sum().item()),
            "prompt_length/mean": prompt_tokens / len(lengths),
            "critic/score_flexible/mean": float(np.nanmean([f for g in groups for f in g["flexible"]]))
            if any(g["example"].data_source in reward.SCORERS for g in groups) else float("nan"),
            "rollout/logprob_gap_mean": logprob_gap(old_log_probs[checked], rollout_log_probs,
                                                    response_mask[checked]),
            "rollout/gen_rounds": float(batch["rounds"]), "rollout/gen_prompts": float(batch["n_prompts"]),
            "rollout/all_equal_groups": batch["n_all_equal"] / batch["n_prompts"],
            "rollout/solve_none": batch["n_none"] / batch["n_prompts"],
            "rollout/solve_all": batch["n_all"] / batch["n_prompts"],
            "rollout/skipped_prompts": batch["n_skipped"] / batch["n_drawn"],
            "reward/errors": float(batch["n_errors"]),
            "actor/lr": lr,
            "perf/throughput": (prompt_tokens + lengths.sum().item()) / t["timing_s/step"] / world,
            # the generation's own rate: beside the training with --one_step_off_policy
            "perf/gen_tokens_per_s": batch["gen_tokens"] / (batch["seconds"] if overlap else t["timing_s/gen"]),
            "perf/max_memory_allocated_gb": max([v for k, v in t.items() if k.startswith("perf/max_memory")],
                                                default=0.0),
            "training/global_step": step, "training/epoch": batch["epoch"],
            "timing_s/since_launch": seconds_since_launch(),
        } | update_stats | t | phase_perf(t, config, seq_len, prompt_tokens + lengths.sum().item(),
                                          lengths.sum().item(), peak_flops, args.ppo_epochs, push_bytes)
        if overlap:  # the generation's own time, beside the previous step's training
            metrics["timing_s/gen_background"] = batch["seconds"]
        for key in {k for g in groups for k in g["extras"]}:
            metrics[f"critic/score/{key}/mean"] = float(np.mean([x for g in groups for x in g["extras"].get(key, [])]))
        last_step = step == total_steps
        stopping = not last_step and stop.agreed(device)  # checkpointed at once, not validated
        if val is not None and args.test_freq > 0 and (step % args.test_freq == 0 or last_step) and not stopping:
            if overlap:  # validation needs the engine idle, with this step's weights: the wait and the push
                before = dict(metrics)  # count as this step's
                with Timer(metrics, device)("gen"):
                    if pending:
                        pending.result()
                if stale:
                    with Timer(metrics, device)("update_weights"):
                        push_weights()
                    stale = False
                metrics["timing_s/step"] += sum(metrics[k] - before.get(k, 0.0)
                                                for k in ("timing_s/gen", "timing_s/update_weights") if k in metrics)
            with Timer(metrics, device)("testing"):
                metrics |= validate(engine, val, args, tokenizer, reward_fn, step)
            stopping = not last_step and stop.agreed(device)  # a SIGTERM during validation: this step, too
        if args.save_freq > 0 and (step % args.save_freq == 0 or last_step or stopping):
            with Timer(metrics, device)("save_checkpoint"):
                sharding.save_checkpoint(args.default_local_dir, step, {"actor": actor}, {"actor": optimizer},
                                         {"actor": scheduler},
                                         drawn_from if pending else data_position(),  # a batch in flight: again
                                         keep_last=args.keep_last_checkpoints)
            # one during the checkpoint: the run stops now, the checkpoint holds this step
            stopping = stopping or (not last_step and stop.agreed(device))
        logger.log(metrics, step)
        bar.update(1)
        if stopping:
            break
    bar.close()
    if pool:  # a batch still generating (the run stopped early): it ends before the engine does
        pool.shutdown(wait=True)
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
    budget = max(args.log_prob_max_token_len_per_gpu, args.ppo_max_token_len_per_gpu)
    count = max(2, budget // (8 + R))
    response = [j % 97 + 1 for j in range(R)]
    return [(list(range(1, 9)), response)] * (count - 1) + [(list(range(1, 9)), response[:max(2, R // 2)])], R


def compile_ahead(actor, ref, args, device):
    """Compile a step's passes before the first step: the old (and reference) log-prob passes and an update,
    on a made-up batch (`made_up_batch`), the update with advantages of 0 and a throwaway SGD at learning rate
    0, so the weights and the optimizer's state stay as they were. torch.compile's graphs take dynamic shapes:
    the real batches reuse them. With --engines_per_gpu the engines start in their own processes meanwhile, so
    the compiling (about 50 s of the first step on an H200, docs/benchmarks.md) overlaps their start."""
    no_step = torch.optim.SGD(actor.parameters(), lr=0.0)  # taken before a forward unshards the root's parameters
    samples, T = made_up_batch(args)
    _, response_mask = response_targets(samples, T, device)
    budget = args.log_prob_max_token_len_per_gpu if args.use_dynamic_bsz else None
    old_log_probs, _ = batched_log_probs(actor, samples, args.log_prob_micro_batch_size_per_gpu, args.temperature,
                                         args.use_remove_padding, T, budget, with_entropy=True)
    ref_log_probs = None
    if ref is not None:
        ref_log_probs, _ = batched_log_probs(ref, samples, args.log_prob_micro_batch_size_per_gpu, args.temperature,
                                             args.use_remove_padding, T, budget)
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
