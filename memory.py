"""The memory planner: each phase's peak GPU memory, predicted from the run's models (as its train
script declares them, models.Model), the batch's lengths and the memory flags; where that memory
goes; the largest token budgets that fit; and, when the defaults do not fit, the switches a user
would reach for, turned on until they do.

A run's phases take turns on the GPU (rollout.py's engine sleeps while the trainer works), so each
phase's peak is what stays resident plus what that phase adds:

  resident        each model's fp32 master weights (4 bytes a parameter) and, for a trained one,
                  AdamW's two moments (8 bytes), sharded over the GPUs by FSDP2; each model's root
                  unit (embeddings, head) in bf16 after its forward
  gen, testing    resident + the awake engine (its weights and KV cache), --gpu_memory_utilization
  update_weights  of the GPU (validation generates with it too; the push streams one tensor at once)
  <pass>          a model's pass without gradients (old_log_prob, ref, values): resident + one
                  micro-batch's logits over the vocabulary, in bf16, for its response tokens (the
                  head sees nothing else; --use_fused_kernels: one chunk), and an MLP's transient
                  activations
  update_<role>   resident + fp32 gradients + every layer's activations for the backward (or, with
                  gradient checkpointing, each layer's input and one layer's activations) + the
                  logits and their gradient (two bf16 copies; --use_fused_kernels: one chunk);
                  AdamW's state offloaded between updates (--optimizer_offload) is back on the
                  GPU for its model's update
  save_checkpoint resident + the awake engine (they follow a step's weight push) + the largest
  export          tensor gathered

The first step with --warm_compile_caches runs its passes eager (more activations, fp32 logits)
beside the compiling helper process: its plan (`Plan.first`) leaves the helper its memory, and where
that leaves too little the helper is left out (the first step then compiles as the others do).

Every response is planned at --max_response_length after the mean prompt, and a micro-batch full
to its budget (or holding the whole pass, when that is less), so the plan holds for the longest
responses; a model that answers shorter uses less (`Plan.at` redoes the arithmetic at a step's mean
lengths, for its measured peaks to be set beside). Two constants are measured, not derived: the
activations a token keeps per layer (eager and compiled, `shapes.ACT_EAGER` /
`shapes.ACT_COMPILED`, against one H200's peaks, docs/benchmarks.md). Everything is in bytes; the
table prints GiB, as `perf/max_memory_allocated_gb/<phase>` logs them (torch's allocated bytes,
without its cache or the CUDA context: `usable` leaves room for those).

--gpu_memory_gib G plans for a GPU of G GiB and, on a larger one, makes the run behave as on that
one (`fence`): torch's allocations in the trainer capped at G less what else holds the GPU (the
sleeping engine's released memory, which torch goes on counting, left out), the engine's share
taken of G. Where memory, not speed, set the budgets (`Plan.bound`), each phase starts with torch's
cache given back (metrics.Timer.release_cache).
"""

import functools
import math
import os
from dataclasses import dataclass, field
from types import SimpleNamespace

from shapes import Shape, config_of, scaled_logits

GiB = 2**30
# the largest budgets worth planning: beyond them a pass is no faster (H200, docs/benchmarks.md:
# the update at 49k tokens ran at 40-41% MFU, the log-prob passes at 64k)
UPDATE_CAP = 49152
LOG_PROB_CAP = 65536
ENGINE_SHARE = 0.6  # the engine's share of the GPU when the trainer leaves room for it
MARGIN = 0.92  # the share of the GPU a plan fills with torch's allocations (its cache, fragments)
# the GPU memory of a trainer's process outside torch's allocator: the CUDA context, NCCL's buffers,
# libraries' workspaces, the in-process engine's own. Measured on an H200 (2026-12-05, the card's
# GRPO command at --gpu_memory_gib 24): 21.87 GiB in use by the process, of which torch's allocator
# held 18.32 (28.96 reserved less the sleeping engine's released 10.64)
OVERHEAD = 3.5 * GiB
# the smallest budget a plan settles for before it turns switches on: below it an update waits on
# the CPU (Python, autograd, kernel launches: at 12k tokens on an H200, docs/benchmarks.md)
BUDGET_FLOOR = 16384
CHUNK = 2 * GiB  # --use_fused_kernels: a chunk of fp32 logits and its gradient
GPUS = (24, 40, 48, 80, 94, 141, 192)  # GPU sizes (GiB) a plan that does not fit is tried on


@dataclass
class Part:
    """A model as the planner counts it: its shape, what it is, where its memory lives, and the
    budget keys of its passes (`passes`: without gradients; `update`: a trained model's)."""

    role: str
    shape: Shape
    phase: str  # its pass without gradients: old_log_prob, ref, values
    passes: str = "log_prob"
    update: str = "update"
    value: bool = False  # a value model: the body and a one-output head, no vocabulary head
    trained: bool = True
    param_offload: bool = False
    optimizer_offload: bool = False
    gradient_checkpointing: bool = False

    @property
    def params(self):
        s = self.shape
        if self.value:  # the body, its embeddings, the final norm and a one-output head
            return s.layers * s.layer_params + s.vocab * s.hidden + 2 * s.hidden
        return s.params

    @property
    def root(self):
        """Its root unit, gathered in bf16 (a value model's holds the embeddings only)."""
        s = self.shape
        return 2 * (s.vocab * s.hidden if self.value else s.root_params)

    def adamw(self, world):
        """AdamW's two fp32 moments, sharded over the GPUs."""
        return 8 * self.params / world

    def resident(self, world):
        """What it holds between phases, by what."""
        held = {
            f"{self.role} weights": self.root
            + (0 if self.param_offload else 4 * self.params / world)
        }
        if self.trained and not (self.param_offload or self.optimizer_offload):
            held[f"{self.role} AdamW"] = self.adamw(world)
        return held


@dataclass
class Plan:
    """Each phase's predicted peak (bytes) and where it goes, the budgets chosen, and what to change
    when something does not fit. `first`: the first step's own plan (eager, beside the compiling
    helper's `helper` bytes), or None when the first step runs as the others."""

    gpu: int  # bytes of GPU memory planned for
    usable: int
    world: int = 1
    phases: dict = field(default_factory=dict)  # name -> (peak, note)
    parts: dict = field(default_factory=dict)  # name -> {what: bytes}
    budgets: dict = field(default_factory=dict)
    engine_share: float = 0.0
    problems: list = field(default_factory=list)
    first: "Plan | None" = None
    helper: int = 0
    small: list = field(default_factory=list)  # budgets it chose below BUDGET_FLOOR
    # memory, not speed, set a budget or the engine's share: below its cap (`release_cache`)
    bound: bool = False
    notes: list = field(default_factory=list)  # what the planner chose beyond budgets, and why
    advice: list = field(default_factory=list)  # what would make it fit, where it does not
    at: object = None  # at(prompt_len, response_len): {phase: peak} at a step's mean lengths

    def worst(self):
        """Why it is not `good`, as a phrase: the phase furthest over what it may use, or the
        budgets below BUDGET_FLOOR."""
        if not self.fits:
            name, (peak, _) = max(self.phases.items(), key=lambda kv: kv[1][0])
            return f"{name} needs {peak / GiB:.1f} GiB of {self.usable / GiB:.1f}"
        small = ", ".join(f"--{key} {self.budgets[key]}" for key in self.small)
        return f"micro-batches of {small} tokens, below {BUDGET_FLOOR}"

    @property
    def good(self):
        """It fits, at budgets a step runs fast with."""
        return self.fits and not self.small

    @property
    def fits(self):
        return not self.problems and (self.first is None or self.first.fits)

    def rows(self, title):
        lines = [title, f"  {'phase':<15} {'GiB':>5}  {'budget':<14} where it goes (GiB)"]
        for name, (peak, note) in self.phases.items():
            parts = sorted(self.parts[name].items(), key=lambda kv: -kv[1])
            where = ", ".join(f"{what} {b / GiB:.1f}" for what, b in parts if b >= 0.05 * GiB)
            lines.append(f"  {name:<15} {peak / GiB:>5.1f}  {note:<14} {where}")
        return lines

    def table(self):
        gpus = f"{self.world} GPUs" if self.world > 1 else "a GPU"
        lines = self.rows(
            f"memory plan for {gpus} of {self.gpu / GiB:.1f} GiB (torch's allocations planned up "
            f"to {self.usable / GiB:.1f} GiB):"
        )
        if self.first is not None:
            lines += self.first.rows(
                f"the first step, eager beside the compiling helper's {self.helper / GiB:.1f} GiB "
                f"(up to {self.first.usable / GiB:.1f} GiB):"
            )
        lines += [f"  {note}" for note in self.notes]
        if self.problems:
            lines.append(f"  does not fit: {'; '.join(self.problems)}")
        if self.first is not None and self.first.problems:
            lines.append(f"  does not fit in the first step: {'; '.join(self.first.problems)}")
        return "\n".join(lines)


def hundredths(share):
    """`share` rounded down to hundredths, as --gpu_memory_utilization gets it; one already so
    stays itself (0.29 * 100 is 28.999999999999996 in floats)."""
    return math.floor(round(share * 100, 6)) / 100


def plan(
    models,
    gpu_bytes,
    *,
    world=1,
    prompt_len,
    response_len,
    batch_seqs,
    mini_batch_seqs,
    fused_kernels=False,
    compiled_log_probs=True,
    compile_update=True,
    engine_share=None,
    budgets=None,
    helper=0,
    budget_floor=BUDGET_FLOOR,
    split=False,
    sequences=None,
):
    """Predict each phase's peak on one GPU for `models` (a list of `Part`, the policy first) and
    choose what is not given: the engine's share of the GPU (`engine_share`: what the trainer
    leaves beside a gathered tensor, at most ENGINE_SHARE) and the token budgets (`budgets`, a dict
    by the parts' budget keys: each the largest multiple of 1,024 up to its cap at which every
    phase using it fits, at least one whole sequence). `helper`: bytes another process holds
    meanwhile (the compiling helper), left out of what the trainer may use. A budget chosen below
    `budget_floor` tokens (0: no floor) is noted in `Plan.small`.

    prompt_len: the prompts' mean length in tokens (their maximum when the data is not read);
    response_len: --max_response_length; batch_seqs / mini_batch_seqs: the sequences of a step and
    of an optimizer step on this GPU (a micro-batch holds no more than they do). `split`: each
    micro-batch as passes.micro_batches fills it, an equal share of the pass's tokens (at a step's
    mean lengths), rather than full to its budget (what the longest responses may do).
    `sequences`: budget keys whose micro-batches hold a fixed count of sequences (verl's
    *_micro_batch_size_per_gpu, without --use_dynamic_bsz), each planned at that count of the
    longest sequences."""
    usable = int(gpu_bytes * MARGIN - OVERHEAD) - helper
    longest = prompt_len + response_len
    share = response_len / longest  # the response tokens of a full micro-batch
    resident = {}
    for m in models:
        resident |= m.resident(world)
    held = sum(resident.values())

    def full(budget, seqs):
        """A micro-batch's tokens at most: the budget, unless the pass holds fewer (sequences of
        unequal length fill some micro-batch of a step nearly to the budget)."""
        if split:
            return seqs * longest / math.ceil(seqs * longest / budget)
        return min(budget, seqs * longest)

    def no_grad_pass(m, budget):
        tokens = full(budget, batch_seqs)
        if m.value:
            logits = 0
        elif fused_kernels:  # a chunk of logits, its fp32 copy and their exponential
            logits = CHUNK
        else:  # eager: fp32 copies and log-softmax too
            logits = tokens * share * 2 * m.shape.vocab * (1 if compiled_log_probs else 5)
        # an MLP's product while it runs (eager: an fp32 copy too)
        return resident | {"logits": logits, "activations": tokens * 4 * m.shape.intermediate}

    def update(m, budget):
        s, tokens = m.shape, full(budget, mini_batch_seqs)
        per_layer = s.activations(compile_update)
        if m.gradient_checkpointing:  # each layer's input; one layer's activations recomputed
            act = tokens * (2 * s.hidden * s.layers + per_layer)
        else:
            act = tokens * per_layer * s.layers
        if m.value:
            logits = 0
        elif fused_kernels:  # a chunk of fp32 logits and the head's fp32 weight gradient
            logits = CHUNK + 4 * s.vocab * s.hidden
        else:  # the saved logits and their gradient (eager: fp32 copies too)
            logits = tokens * share * 2 * s.vocab * (2 if compiled_log_probs else 6)
        grads = 0 if m.param_offload else 4 * m.params / world
        peak = resident | {f"{m.role} gradients": grads, "activations": act, "logits": logits}
        if m.optimizer_offload and not m.param_offload:  # on the GPU for the update only
            peak[f"{m.role} AdamW"] = m.adamw(world)
        return peak

    # each budget key's phases, as functions of the budget
    uses = {}
    for m in models:
        uses.setdefault(m.passes, []).append((m.phase, lambda t, m=m: no_grad_pass(m, t)))
        if m.trained:
            uses.setdefault(m.update, []).append((f"update_{m.role}", lambda t, m=m: update(m, t)))
    caps = {key: LOG_PROB_CAP for key in uses} | {m.update: UPDATE_CAP for m in models if m.trained}
    sequences = sequences or {}
    chosen = dict(budgets or {}) | {key: n * longest for key, n in sequences.items()}
    small = []
    for key, phases in uses.items():
        if key not in chosen:  # the largest that fits; the smallest when none does
            fits = [t for t in range(1024, caps[key] + 1, 1024) if t >= longest]
            fits = [t for t in fits if all(sum(f(t).values()) <= usable for _, f in phases)]
            chosen[key] = max(fits or [max(longest, 1024)])
            seqs = mini_batch_seqs if key in {m.update for m in models if m.trained} else batch_seqs
            if chosen[key] < min(budget_floor, seqs * longest):
                small.append(key)

    # the checkpoint and the export run after a step's weight push, the engine awake: each
    # gathers the full tensors one at a time, in fp32, the largest an embedding
    gathered = {"a tensor gathered": 4 * max(m.shape.vocab * m.shape.hidden for m in models)}
    squeezed = False  # the engine's share, chosen here, below ENGINE_SHARE
    if engine_share is None:
        room = usable - held - sum(gathered.values())
        # in hundredths, rounded down, as the flag gets it
        engine_share = hundredths(max(0.0, min(ENGINE_SHARE, room / gpu_bytes)))
        squeezed = engine_share < ENGINE_SHARE
    engine = engine_share * gpu_bytes
    result = Plan(
        gpu_bytes, usable, world, budgets=chosen, engine_share=engine_share, helper=helper
    )
    result.small = small
    fixed = set(budgets or {}) | set(sequences)  # budgets not chosen here
    result.bound = squeezed or any(chosen[k] < caps[k] for k in uses if k not in fixed)
    policy = models[0]
    # the engine's pool: the policy's bf16 weights, and its KV cache with vLLM's working memory
    weights = min(engine, 2 * policy.params)
    awake = resident | {"engine weights": weights, "engine KV cache": engine - weights}
    engine_note = f"engine {hundredths(engine_share):.2f}"  # as the flag gets it
    parts = {"gen": (awake, engine_note)}
    for key, phases in uses.items():
        for name, f in phases:
            label = f"{sequences[key]} seqs" if key in sequences else f"{chosen[key]} tokens"
            parts[name] = (f(chosen[key]), label)
    # the pass without gradients first, then the updates, as a step runs them
    parts = dict(sorted(parts.items(), key=lambda kv: kv[0].startswith("update_")))
    parts["update_weights"] = (awake, engine_note)
    if not helper:  # a run's phases after its steps; not the first step's (beside the helper)
        parts["testing"] = parts["update_weights"]
        parts["save_checkpoint"] = (awake | gathered, engine_note)
        parts["export"] = parts["save_checkpoint"]
    result.parts = {name: what for name, (what, _) in parts.items()}
    result.phases = {name: (sum(what.values()), note) for name, (what, note) in parts.items()}
    engine_min = 2 * policy.params + 2 * GiB  # its bf16 weights and a little cache
    if engine < engine_min:
        result.problems.append(
            f"gen: the engine needs {engine_min / GiB:.1f} GiB beside the trainer's "
            f"{held / GiB:.1f} GiB"
        )
    result.problems += [
        f"{name}: {peak / GiB:.1f} GiB"
        for name, (peak, _) in result.phases.items()
        if peak > usable
    ]

    # Plan.at: the same arithmetic, budgets and engine share at a step's mean lengths, its passes
    # split as passes.micro_batches splits them. A plan is made for responses at the length limit
    # and micro-batches full to their budgets; a step's responses are mostly shorter, so its
    # micro-batches hold fewer tokens and logits: that is what its measured peaks test
    again = functools.partial(
        plan, models, gpu_bytes, world=world, batch_seqs=batch_seqs,
        mini_batch_seqs=mini_batch_seqs, fused_kernels=fused_kernels,
        compiled_log_probs=compiled_log_probs, compile_update=compile_update,
        engine_share=engine_share, budgets=chosen, helper=helper, split=True,
        sequences=sequences,
    )  # fmt: skip

    def at(prompt_len, response_len):
        step = again(prompt_len=prompt_len, response_len=response_len)
        return {name: peak for name, (peak, _) in step.phases.items()}

    result.at = at
    return result


# --- the run's plan: its models (models.Model) and flags ------------------------------------------


def budget_flags(specs):
    """The token-budget flags of a run's passes, each once, in the order of its models."""
    return list(dict.fromkeys(flag for spec in specs for flag in spec.budget_flags()))


def micro_batch_flags(specs):
    """The sequences-per-micro-batch flags of a run's passes, each once."""
    return list(dict.fromkeys(flag for spec in specs for flag in spec.micro_batch_flags()))


def parts_of(args, specs):
    """The planner's `Part` of each of a run's models, its switches read from the flags its
    declaration names, its budgets keyed by their flags."""
    configs = {}
    parts = []
    for spec in specs:
        if spec.path not in configs:
            configs[spec.path] = config_of(spec.path)
        parts.append(
            Part(
                spec.role,
                Shape.of(configs[spec.path]),
                spec.phase,
                passes=spec.passes[1],
                update=spec.update[1],
                value=spec.value,
                trained=spec.trained,
                param_offload=spec.on(args, "param_offload"),
                optimizer_offload=spec.on(args, "optimizer_offload"),
                gradient_checkpointing=spec.on(args, "gradient_checkpointing"),
            )
        )
    return parts


def memory_plan(args, specs, world, memory_bytes, prompt_len, budgets, compiled=True, helper=0):
    """`plan` for a run's models (`specs`) and flags on a GPU of `memory_bytes`, the `budgets` given
    (a dict by flag; the rest chosen); `compiled` False plans every pass eager, beside a helper of
    `helper` bytes (--warm_compile_caches' first step, its output layer chunk by chunk where it
    can be). Without --use_dynamic_bsz each pass is planned at its micro-batches' count of
    sequences (`sequences`), the budgets unused."""
    fused = args.use_fused_kernels
    if not compiled:
        fused = fused or not scaled_logits(config_of(specs[0].path))
    return plan(
        parts_of(args, specs),
        memory_bytes,
        world=world,
        prompt_len=prompt_len,
        response_len=args.max_response_length,
        batch_seqs=args.train_batch_size * args.rollout_n // world,
        mini_batch_seqs=args.ppo_mini_batch_size * args.rollout_n // world,
        fused_kernels=fused,
        compiled_log_probs=compiled and args.use_torch_compile is not False,
        compile_update=compiled and args.compile_update,
        engine_share=args.gpu_memory_utilization,
        budgets=budgets,
        helper=helper,
        budget_floor=BUDGET_FLOOR if args.use_dynamic_bsz else 0,  # budgets in use, or not
        sequences=None if args.use_dynamic_bsz else micro_batch_sequences(args, specs),
    )


def micro_batch_sequences(args, specs):
    """Each budget key's micro-batch size in sequences, as the flags set it (the count that
    replaces the token budget without --use_dynamic_bsz)."""
    pairs = [spec.passes for spec in specs] + [spec.update for spec in specs if spec.trained]
    return {budget: getattr(args, size) for size, budget in pairs}


def remedies(args, specs):
    """What a user would turn on when a run does not fit, in the order to try them, the cheapest in
    time first: (flag, what it does). The chunked output layer costs nothing measurable (H200,
    docs/benchmarks.md); an offloaded reference moves its weights in for its pass; offloaded AdamW
    state moves in and out for each update; recomputed activations add about a third of a forward
    and backward to the update."""
    out = []
    if not scaled_logits(config_of(specs[0].path)):
        out.append(("use_fused_kernels", "the output layer chunk by chunk: no full logits"))
    for spec in specs:
        if not spec.trained and spec.param_offload:
            out.append((spec.param_offload, f"the {spec.role} model's weights on the CPU"))
    for spec in specs:
        if spec.trained and spec.optimizer_offload:
            out.append((spec.optimizer_offload, f"the {spec.role}'s AdamW state on the CPU"))
    for spec in specs:
        if spec.trained and spec.gradient_checkpointing:
            out.append((spec.gradient_checkpointing, f"the {spec.role}'s activations recomputed"))
    return out


def advice(args, specs, world, prompt_len, budgets, gpu_bytes, given):
    """What would make a run fit, for the message when nothing does: the switches not on yet, and
    the GPUs on which the flags as given would fit (the others turned on as the planner does)."""
    tips = [f"--{name} ({why})" for name, why in remedies(args, specs) if not getattr(args, name)]
    for spec in specs:
        if spec.trained and spec.param_offload and not getattr(args, spec.param_offload):
            tips.append(f"--{spec.param_offload} (the {spec.role}'s weights on the CPU)")
    tips.append(f"a shorter --max_response_length (now {args.max_response_length})")
    planner = SimpleNamespace(**vars(args))
    for name, _ in remedies(args, specs):
        setattr(planner, name, getattr(args, name) if name in given else True)

    def fits(gib, gpus):
        return memory_plan(planner, specs, gpus, int(gib * GiB), prompt_len, budgets).fits

    size = next((g for g in GPUS if g * GiB > gpu_bytes and fits(g, world)), None)
    more = next((n for n in (2, 4, 8, 16, 32, 64) if n > world and fits(gpu_bytes / GiB, n)), None)
    if size or more:
        what = [f"a GPU of {size} GiB"] if size else []
        what += [f"{more} GPUs of {gpu_bytes / GiB:.0f} GiB"] if more else []
        tips.append(f"with the flags given, {' or '.join(what)} (FSDP2 shards over GPUs)")
    return tips


def fit_with_switches(args, specs, given, replan):
    """`replan()`, the plan for the flags as they are, with `remedies` turned on one by one, the
    cheapest first, until it is `good`, then off again those it does without; a switch given on
    the command line (`given`) stays as given. The plan's notes say which were turned on and why."""
    result = replan()
    worst = result.worst()
    turned = []
    for name, why in remedies(args, specs):
        if result.good:
            break
        if name not in given and not getattr(args, name):
            setattr(args, name, True)
            turned.append((name, why))
            result = replan()
    for name, why in reversed(turned if result.fits else []):
        setattr(args, name, False)
        without = replan()
        if without.good or (without.fits and not result.good):
            turned.remove((name, why))
            result = without
        else:
            setattr(args, name, True)
    result.notes = [f"turned on --{name} ({why})" for name, why in turned]
    if turned:
        result.notes[-1] += f": with the defaults, {worst}"
    if result.fits and result.small:  # a switch given off, or none left: it runs, but slowly
        off = [
            f"--{name} (given false)"
            for name, _ in remedies(args, specs)
            if name in given and not getattr(args, name)
        ]
        result.notes.append(
            f"{result.worst()}, where a step waits on the CPU"
            + (f"; {', '.join(off)} would make room for more" if off else "")
        )
    return result


def plan_first_step(args, given, replan, budgets, helper, result):
    """--warm_compile_caches' first step, eager beside the compiling helper's `helper` bytes, as
    `result.first`; where it does not fit (and the flag was not given) the helper is left out and
    the first step compiles as the others do, which the notes say."""
    first = replan(budgets, compiled=False, helper=helper)
    if first.fits or "warm_compile_caches" in given:
        result.first, result.helper = first, helper
        return
    args.warm_compile_caches = False
    peak = max(p for p, _ in first.phases.values())
    left = f"only {first.usable / GiB:.1f} GiB are" if first.usable > 0 else "nothing is"
    result.notes.append(
        f"left out the compiling helper (--warm_compile_caches false): the first step, eager, "
        f"needs up to {peak / GiB:.1f} GiB, and {left} left beside the helper's "
        f"{helper / GiB:.1f} GiB; the first step compiles its passes"
    )


def plan_memory(args, specs, world, device, prompt_len, given, helper=None):
    """Fill the speed and memory flags left to their defaults: on a GPU (or for --gpu_memory_gib),
    micro-batches by the token budgets the memory planner picks, the update compiled, the engine's
    share of what the trainer leaves; on a CPU, the small fixed ones. Where the defaults do not
    fit, it turns on `remedies` one by one until they do, and, with the compiling helper
    (`helper`: its bytes as a function of the flags, once the budgets are chosen; None without
    it), plans the first step eager beside it or leaves the helper out (--warm_compile_caches
    false) where that does not fit. Returns the plan (None on a
    CPU without --gpu_memory_gib). A flag given on the command line (`given`) always wins, and a
    per-sequence micro-batch size given there keeps verl's meaning (no token budgets)."""
    gpu = device.type == "cuda"
    planning = gpu or args.print_plan or args.gpu_memory_gib is not None
    if args.use_dynamic_bsz is None:
        args.use_dynamic_bsz = planning and not (set(micro_batch_flags(specs)) & given)
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

        def replan(budgets=chosen, compiled=True, helper=0):
            return memory_plan(
                args, specs, world, memory_bytes, prompt_len, budgets, compiled, helper
            )

        result = fit_with_switches(args, specs, given, replan)
        if not result.fits:
            result.advice = advice(args, specs, world, prompt_len, chosen, memory_bytes, given)
        for name in names if args.use_dynamic_bsz else ():
            setattr(args, name, getattr(args, name) or result.budgets[name])
        if args.gpu_memory_utilization is None:
            args.gpu_memory_utilization = hundredths(result.engine_share)
        if helper is not None and result.fits:
            given_budgets = {name: getattr(args, name) for name in names if name in given}
            plan_first_step(args, given, replan, given_budgets, helper(args), result)
    for name in names:  # a CPU's, or the per-sequence micro-batches' unused ones
        setattr(args, name, getattr(args, name) or 16384)
    if args.gpu_memory_utilization is None:
        args.gpu_memory_utilization = 0.6
    return result


def cpu_kv_cache_bytes(args):
    """On a CPU, the engine's KV cache (fp32): a generation round's sequences at full length, up to
    --max_num_seqs, and never more than --gpu_memory_utilization of the machine's memory, which is
    what vLLM's CPU backend takes otherwise (0.6 of a 24 GiB machine for a tiny model, which a
    second process then drives out of memory). VLLM_CPU_KVCACHE_SPACE, vLLM's own setting, wins."""
    shape = Shape.of(config_of(args.model))
    per_token = 2 * shape.layers * shape.kv_dim * 4
    sequences = min(args.max_num_seqs, args.train_batch_size * args.rollout_n)
    need = sequences * (args.max_prompt_length + args.max_response_length) * per_token
    machine = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return int(max(min(need, args.gpu_memory_utilization * machine), 64 * 2**20))


def plan_message(plan, args, specs):
    """The plan's table and the flags it set, or what to change when it does not fit."""
    lines = [plan.table()]
    if plan.fits:
        sizes = budget_flags(specs) if args.use_dynamic_bsz else micro_batch_flags(specs)
        names = [
            "use_dynamic_bsz",
            *sizes,
            "compile_update",
            "gpu_memory_utilization",
        ]
        lines.append("  with " + " ".join(f"--{k} {getattr(args, k)}" for k in names))
    else:
        advice = plan.advice or ["--warm_compile_caches false (no helper beside the first step)"]
        lines.append("  to fit, try: " + "; ".join(advice))
    return "\n".join(lines)


# --- --gpu_memory_gib on a larger GPU -------------------------------------------------------------


def fence(args, device):
    """--gpu_memory_gib G on a GPU that holds more: cap this process's torch allocations at G GiB
    (torch's per-process memory fraction; the in-process engine allocates through torch too).

    Returns `allow(unbacked)`, which the in-process engine calls as it sleeps and wakes: vLLM's
    sleep mode releases the memory of its weights and KV cache but keeps their tensors, and torch's
    allocator goes on counting them (the engine's `unbacked_bytes`). A cap fixed at G would leave
    the update G less the engine's whole pool; raised by those bytes, it leaves the update what a
    GPU of G GiB would. Each call also leaves out what else holds the GPU then, as measured: this
    process's memory outside torch's allocator (the CUDA context, NCCL's buffers, libraries'
    workspaces: 3.5 GiB beside the in-process engine on an H200) and other processes' (the
    compiling helper), so the whole run stays within G, as NVML counts it."""
    import torch

    from flags import need

    total = torch.cuda.get_device_properties(device).total_memory
    cap = int(args.gpu_memory_gib * GiB)
    need(
        cap <= total,
        f"--gpu_memory_gib {args.gpu_memory_gib}: this GPU holds {total / GiB:.1f} GiB; give at "
        "most that, or leave it out",
    )

    def allow(unbacked=0):
        free, _ = torch.cuda.mem_get_info(device)
        # the GPU's memory in use less what torch's allocator holds of it (its count less the
        # sleeping engine's released pool)
        others = max(0, total - free - (torch.cuda.memory_reserved(device) - unbacked))
        torch.cuda.set_per_process_memory_fraction(
            min(1.0, max(0, cap - others + unbacked) / total), device
        )

    allow()
    return allow


def expandable_segments():
    """Have torch's allocator grow its blocks in place (expandable segments) from here on, unless
    the user's PYTORCH_CUDA_ALLOC_CONF (or PYTORCH_ALLOC_CONF) says how it allocates; returns
    whether it did. For runs whose budgets memory set: an update's blocks, cut to its tensors'
    sizes, leave pieces no larger request fits (an H200 run as a 24 GiB GPU ran out in its first
    update with 2.5 GiB so held, and ran its steps, validation, checkpoint and export with segments
    that grow). vLLM's sleep-mode pool turns them off for its own allocations and on again after."""
    if os.environ.get("PYTORCH_CUDA_ALLOC_CONF") or os.environ.get("PYTORCH_ALLOC_CONF"):
        return False
    import torch

    torch._C._accelerator_setAllocatorSettings("expandable_segments:True")
    return True


def engine_utilization(args, total):
    """The share of the whole GPU (`total` bytes) to give the engine: --gpu_memory_utilization is
    a share of the GPU planned for, which --gpu_memory_gib makes smaller than this one (`total`
    None: no GPU, nothing to take it of)."""
    if not args.gpu_memory_gib or not total:
        return args.gpu_memory_utilization
    return args.gpu_memory_utilization * args.gpu_memory_gib * GiB / total
