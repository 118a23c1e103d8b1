"""The memory planner: each phase's peak GPU memory, predicted from the model's config, the batch's
lengths and the memory flags, and the largest token budgets that fit.

A run's phases take turns on the GPU (rollout.py's engine sleeps while the trainer works), so each
phase's peak is what stays resident plus what that phase adds:

  resident        fp32 master weights (4 bytes a parameter) and AdamW's two moments (8 bytes),
                  each sharded over the GPUs by FSDP2; the reference model's masters; PPO's
                  critic's; each model's root unit (embeddings, head) in bf16 after its forward
  gen             resident + the awake engine, --gpu_memory_utilization of the GPU
  old_log_prob    resident + one micro-batch's logits over the vocabulary, in bf16, for its response
  ref, values     tokens (the head sees nothing else) and little more: no activations are kept
  update_actor    resident + fp32 gradients + every layer's activations for the backward (or, with
                  --enable_gradient_checkpointing, each layer's input and one layer's activations)
                  + the logits and their gradient (two bf16 copies; --use_fused_kernels: one chunk)
  update_critic   the same for the critic's body, with no vocabulary head

Every response is planned at --max_response_length after the mean prompt, and a micro-batch full
to its budget (or holding the whole pass, when that is less), so the plan holds for the longest
responses; a model that answers shorter uses less.
Two constants are measured, not derived: the activations a token keeps per layer (eager and
compiled, `ACT_EAGER` / `ACT_COMPILED`, against one H200's peaks, docs/benchmarks.md). Everything is
in bytes; the table prints GiB, as `perf/max_memory_allocated_gb/<phase>` logs them (torch's
allocated bytes, without its cache or the CUDA context: `usable` leaves room for those).
"""

import math
from dataclasses import dataclass, field

GiB = 2**30
# activations an update keeps per token and decoder layer, as a multiple of
# 2 bytes * (8 hidden + 2 q + 2 kv + 4 intermediate): the norms' fp32 inputs, q/k/v and their
# rotary copies, the attention output, the MLP's gate, up and product. Measured on an H200
# (Qwen2.5-0.5B shape, 2026-11-30): 1.38 MiB a token with eager layers, 0.97 with --compile_update.
ACT_EAGER = 1.05
ACT_COMPILED = 0.74
# the largest budgets worth planning: beyond them a pass is no faster (H200, docs/benchmarks.md:
# the update at 49k tokens ran at 40-41% MFU, the log-prob passes at 64k)
UPDATE_CAP = 49152
LOG_PROB_CAP = 65536
ENGINE_SHARE = 0.6  # the engine's share of the GPU when the trainer leaves room for it
MARGIN = 0.92  # the share of the GPU a plan fills with torch's allocations (its cache, fragments)
OVERHEAD = 1.0 * GiB  # CUDA context, NCCL buffers, workspace


@dataclass
class Shape:
    """What the planner needs of a Hugging Face config."""

    hidden: int
    intermediate: int
    layers: int
    q_dim: int  # heads * head_dim
    kv_dim: int  # key-value heads * head_dim
    vocab: int
    tied: bool

    @classmethod
    def of(cls, config):
        heads = config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        kv_heads = getattr(config, "num_key_value_heads", None) or heads
        return cls(
            config.hidden_size,
            config.intermediate_size,
            config.num_hidden_layers,
            heads * head_dim,
            kv_heads * head_dim,
            config.vocab_size,
            bool(getattr(config, "tie_word_embeddings", False)),
        )

    @property
    def layer_params(self):
        h = self.hidden
        attention = h * self.q_dim * 2 + h * self.kv_dim * 2 + self.q_dim + 2 * self.kv_dim
        return attention + 3 * h * self.intermediate + 2 * h

    @property
    def root_params(self):
        """Embeddings, final norm and (untied) head: FSDP2's root unit."""
        return self.vocab * self.hidden * (1 if self.tied else 2) + self.hidden

    @property
    def params(self):
        return self.layers * self.layer_params + self.root_params

    def activations(self, compiled):
        """Bytes a token keeps per decoder layer for the backward."""
        h, q, kv, i = self.hidden, self.q_dim, self.kv_dim, self.intermediate
        return (ACT_COMPILED if compiled else ACT_EAGER) * 2 * (8 * h + 2 * q + 2 * kv + 4 * i)


@dataclass
class Plan:
    """Each phase's predicted peak (bytes), the budgets chosen, and what to change when something
    does not fit."""

    gpu: int  # bytes of GPU memory planned for
    usable: int
    phases: dict = field(default_factory=dict)
    budgets: dict = field(default_factory=dict)
    engine_share: float = 0.0
    problems: list = field(default_factory=list)

    @property
    def fits(self):
        return not self.problems

    def table(self):
        lines = [
            f"memory plan for a GPU of {self.gpu / GiB:.1f} GiB (torch's allocations planned up to "
            f"{self.usable / GiB:.1f} GiB):",
            f"  {'phase':<15} {'predicted GiB':>13}  budget",
        ]
        for name, (peak, note) in self.phases.items():
            lines.append(f"  {name:<15} {peak / GiB:>13.1f}  {note}")
        lines += [f"  does not fit: {p}" for p in self.problems]
        return "\n".join(lines)


def plan(
    shape,
    gpu_bytes,
    *,
    world=1,
    prompt_len,
    response_len,
    batch_seqs,
    mini_batch_seqs,
    critic=False,
    reference=True,
    gradient_checkpointing=False,
    critic_gradient_checkpointing=False,
    fused_kernels=False,
    compiled_log_probs=True,
    compile_update=True,
    param_offload=False,
    optimizer_offload=False,
    ref_param_offload=False,
    critic_param_offload=False,
    critic_optimizer_offload=False,
    engine_share=None,
    budgets=None,
):
    """Predict each phase's peak on one GPU and choose what is not given: the engine's share of the
    GPU (`engine_share`: what the trainer leaves, at most ENGINE_SHARE) and the token budgets
    (`budgets`, a dict with any of "update", "log_prob", "critic": each the largest multiple of
    1,024 up to its cap whose phase fits, at least one whole sequence).

    prompt_len: the prompts' mean length in tokens (their maximum when the data is not read);
    response_len: --max_response_length; batch_seqs / mini_batch_seqs: the sequences of a step and
    of an optimizer step on this GPU (a micro-batch holds no more than they do)."""
    P, V, h, s = shape.params, shape.vocab, shape.hidden, world
    P_critic = shape.layers * shape.layer_params + V * h + 2 * h  # the body and a 1-output head
    usable = int(gpu_bytes * MARGIN - OVERHEAD)
    root = 2 * shape.root_params  # a model's root unit, gathered in bf16
    longest = prompt_len + response_len
    share = response_len / longest  # the response tokens of a full micro-batch
    resident = root + (0 if param_offload else 4 * P / s)
    resident += 0 if (param_offload or optimizer_offload) else 8 * P / s
    if reference:
        resident += root + (0 if ref_param_offload else 4 * P / s)
    if critic:  # its root holds the embeddings only
        resident += 2 * V * h + (0 if critic_param_offload else 4 * P_critic / s)
        resident += 0 if (critic_param_offload or critic_optimizer_offload) else 8 * P_critic / s
    logit = 2 * V  # one token's bf16 logits

    def full(budget, seqs):
        """A micro-batch's tokens at most: the budget, unless the pass holds fewer (sequences of
        unequal length fill some micro-batch of a step nearly to the budget)."""
        return min(budget, seqs * longest)

    def log_prob_pass(budget, with_head=True):
        tokens = full(budget, batch_seqs)
        head = tokens * share * logit * (1 if compiled_log_probs else 5) if with_head else 0
        return resident + head + tokens * 4 * shape.intermediate  # eager: an fp32 copy too

    def update(budget, checkpointing, with_head, params, offloaded):
        tokens = full(budget, mini_batch_seqs)
        per_layer = shape.activations(compile_update)
        if checkpointing:  # each layer's input, and one layer's activations while it recomputes
            act = tokens * (2 * h * shape.layers + per_layer)
        else:
            act = tokens * per_layer * shape.layers
        if not with_head:
            head = 0
        elif fused_kernels:  # a chunk of fp32 logits and the head's fp32 weight gradient
            head = 2 * GiB + 4 * V * h
        else:  # the saved logits and their gradient (eager: fp32 copies too)
            head = tokens * share * logit * (2 if compiled_log_probs else 6)
        return resident + (0 if offloaded else 4 * params / s) + act + head

    peaks = {
        "update": lambda t: update(t, gradient_checkpointing, True, P, param_offload),
        "log_prob": log_prob_pass,
    }
    if critic:
        peaks["critic"] = lambda t: update(
            t, critic_gradient_checkpointing, False, P_critic, critic_param_offload
        )
    caps = {"update": UPDATE_CAP, "log_prob": LOG_PROB_CAP, "critic": UPDATE_CAP}
    chosen = dict(budgets or {})
    for name, peak in peaks.items():
        if name not in chosen:  # the largest that fits; the smallest when none does
            fits = [t for t in range(1024, caps[name] + 1, 1024) if t >= longest]
            fits = [t for t in fits if peak(t) <= usable] or [max(longest, 1024)]
            chosen[name] = max(fits)

    if engine_share is None:
        engine_share = max(0.0, min(ENGINE_SHARE, (usable - resident) / gpu_bytes))
    engine = engine_share * gpu_bytes
    result = Plan(gpu_bytes, usable, budgets=chosen, engine_share=engine_share)
    phases = {"gen": (resident + engine, f"engine {engine_share:.2f} of the GPU")}
    phases["old_log_prob"] = (log_prob_pass(chosen["log_prob"]), f"{chosen['log_prob']} tokens")
    if reference:
        phases["ref"] = phases["old_log_prob"]
    if critic:
        phases["values"] = (log_prob_pass(chosen["critic"], False), f"{chosen['critic']} tokens")
        phases["update_critic"] = (peaks["critic"](chosen["critic"]), f"{chosen['critic']} tokens")
    phases["update_actor"] = (peaks["update"](chosen["update"]), f"{chosen['update']} tokens")
    phases["update_weights"] = phases["gen"]
    result.phases = phases
    engine_min = 2 * P + 2 * GiB  # its bf16 weights and a little cache
    if engine < engine_min:
        result.problems.append(
            f"gen: the engine needs {engine_min / GiB:.1f} GiB beside the trainer's "
            f"{resident / GiB:.1f} GiB"
        )
    result.problems += [
        f"{name}: {peak / GiB:.1f} GiB" for name, (peak, _) in phases.items() if peak > usable
    ]
    return result


def advice(args):
    """The flags that would lower the plan, for the message when nothing fits."""
    tips = []
    if not args.enable_gradient_checkpointing:
        tips.append("--enable_gradient_checkpointing (recompute activations)")
    if not args.use_fused_kernels:
        tips.append("--use_fused_kernels (no full logits)")
    if not args.optimizer_offload and not args.param_offload:
        tips.append("--optimizer_offload (AdamW's state on the CPU between updates)")
    if not args.param_offload:
        tips.append("--param_offload (weights on the CPU)")
    if getattr(args, "ref_param_offload", True) is False:
        tips.append("--ref_param_offload (the reference model on the CPU)")
    tips.append(f"a shorter --max_response_length (now {args.max_response_length})")
    tips.append("more GPUs (FSDP2 shards weights and optimizer over them) or a smaller model")
    return tips


# --- the run's plan: its models (models.Model) and flags ------------------------------------------


def budget_flags(specs):
    """The token-budget flags of a run's passes, each once, in the order of its models."""
    return list(dict.fromkeys(flag for spec in specs for flag in spec.budget_flags()))


def memory_plan(args, specs, world, memory_bytes, prompt_len, budgets, compiled=True):
    """`plan` for a run's models (`specs`) and flags on a GPU of `memory_bytes`, the `budgets` given
    (a dict by flag; the rest chosen); `compiled` False plans every pass eager
    (--warm_compile_caches' first step). Returns the plan with its budgets by flag."""
    from transformers import AutoConfig

    policy = specs[0]  # the policy the engine generates with
    frozen = [s for s in specs if not s.trained and not s.value]
    value = next((s for s in specs if s.value), None)
    keys = {policy.passes[1]: "log_prob", policy.update[1]: "update"}
    keys |= {value.update[1]: "critic"} if value else {}
    p = plan(
        Shape.of(AutoConfig.from_pretrained(policy.path)),
        memory_bytes,
        world=world,
        prompt_len=prompt_len,
        response_len=args.max_response_length,
        batch_seqs=args.train_batch_size * args.rollout_n // world,
        mini_batch_seqs=args.ppo_mini_batch_size * args.rollout_n // world,
        critic=value is not None,
        reference=bool(frozen),
        gradient_checkpointing=policy.gradient_checkpointing,
        critic_gradient_checkpointing=value is not None and value.gradient_checkpointing,
        fused_kernels=args.use_fused_kernels,
        compiled_log_probs=compiled and args.use_torch_compile is not False,
        compile_update=compiled and args.compile_update,
        param_offload=policy.param_offload,
        optimizer_offload=policy.optimizer_offload,
        ref_param_offload=bool(frozen) and frozen[0].param_offload,
        critic_param_offload=value is not None and value.param_offload,
        critic_optimizer_offload=value is not None and value.optimizer_offload,
        engine_share=args.gpu_memory_utilization,
        budgets={keys[flag]: tokens for flag, tokens in budgets.items()},
    )
    p.budgets = {flag: p.budgets[key] for flag, key in keys.items()}
    return p


def plan_memory(args, specs, world, device, prompt_len, given):
    """Fill the speed and memory flags left to their defaults: on a GPU (or for --gpu_memory_gib),
    micro-batches by the token budgets the memory planner picks, the update compiled, the engine's
    share of what the trainer leaves; on a CPU, the small fixed ones. Returns the plan (None on a
    CPU without --gpu_memory_gib). A flag given on the command line (`given`) always wins, and a
    per-sequence micro-batch size given there keeps verl's meaning (no token budgets)."""
    gpu = device.type == "cuda"
    planning = gpu or args.print_plan or args.gpu_memory_gib is not None
    per_sequence = {flag for spec in specs for flag in spec.micro_batch_flags()}
    if args.use_dynamic_bsz is None:
        args.use_dynamic_bsz = planning and not (per_sequence & given)
    if args.compile_update is None:
        args.compile_update = planning and args.use_dynamic_bsz and args.compile_layers is not False
    args.compile_update = bool(args.compile_update)
    memory_bytes = None
    if args.gpu_memory_gib:
        memory_bytes = int(args.gpu_memory_gib * GiB)
    elif gpu:
        import torch

        memory_bytes = torch.cuda.get_device_properties(device).total_memory
    names = budget_flags(specs)
    result = None
    if memory_bytes:
        chosen = {name: getattr(args, name) for name in names if getattr(args, name)}
        result = memory_plan(args, specs, world, memory_bytes, prompt_len, chosen)
    if result is not None:
        for name in names:
            setattr(args, name, getattr(args, name) or result.budgets[name])
        if args.gpu_memory_utilization is None:
            args.gpu_memory_utilization = math.floor(result.engine_share * 100) / 100
    for name in names:  # a CPU's, or the per-sequence micro-batches' unused ones
        setattr(args, name, getattr(args, name) or 16384)
    if args.gpu_memory_utilization is None:
        args.gpu_memory_utilization = 0.6
    return result


def plan_message(plan, args, specs):
    """The plan's table and the flags it set, or what to change when it does not fit."""
    lines = [plan.table()]
    if plan.fits:
        names = [
            "use_dynamic_bsz",
            *budget_flags(specs),
            "compile_update",
            "gpu_memory_utilization",
        ]
        lines.append("  with " + " ".join(f"--{k} {getattr(args, k)}" for k in names))
    else:
        lines.append("  to fit, try: " + "; ".join(advice(args)))
    return "\n".join(lines)
