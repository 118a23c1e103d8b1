"""Compiling a step's passes before the step needs them: while a pool of engines starts, or in a
helper process while the first step runs eager (`--warm_compile_caches`).

torch.compile compiles a graph the first time a pass runs it: on a fresh H200 about 40-50 s of
GRPO's first step. `compile_ahead` runs each model's passes on a made-up batch, as a step runs them,
so that the real step finds its graphs compiled (torch.compile's graphs take dynamic shapes). It
knows the passes from the script's models (`models.Model`): a policy's log-probs, a value model's
values, and a trained model's forward and backward as its update runs them; it never calls the
script's own functions, so a fork may change their signatures.

With `--warm_compile_caches` (on a GPU with the in-process engine, by default) a helper process
compiles them on one-layer copies of the models while the trainer loads its models, starts the
engine and runs its first step eager (`WarmStart`); after that step the trainer compiles the same
passes, which load the helper's code from torch's caches on disk.
"""

import atexit
import os
import sys
import time

import torch
import torch.distributed as dist

import flags
import memory
import models
import ops
import passes
import shapes
from metrics import Timer, seconds_since_launch


def made_up_batch(response_length, budget=None):
    """compile_ahead's sequences and their response length. With a token budget (--use_dynamic_bsz),
    enough sequences of 8 + response_length tokens to fill it, as a real step's micro-batches nearly
    do: inductor's code, and the guards it puts on it, change with size (past 2**31 logits it
    indexes in 64 bits; some fusions it allows only below a size), and a pass compiled on 20 tokens
    compiled again at the real 50-65k in the first step on an H200 (8 s, docs/benchmarks.md).
    Otherwise two short sequences. The last sequence is shorter than the others, and no size is 1,
    on which torch.compile would specialise."""
    R = response_length
    if not budget:
        return [(list(range(1, 9)), list(range(1, 13))), (list(range(1, 5)), list(range(1, 7)))], 12
    count = max(2, budget // (8 + R))
    response = [j % 97 + 1 for j in range(R)]
    return [(list(range(1, 9)), response)] * (count - 1) + [
        (list(range(1, 9)), response[: max(2, R // 2)])
    ], R


def budgets(specs, args):
    """The token budgets of every pass the models run (their flags' values)."""
    return [getattr(args, flag) for spec in specs for flag in spec.budget_flags()]


def compile_ahead(loaded, specs, args, device, tokens=None):
    """Run each model's passes once on a made-up batch (`made_up_batch`, filling the largest token
    budget, or of `tokens`): every model's pass without gradients (log-probs, a trained policy's
    with the entropy; values), then each trained model's forward and backward, in train mode, as its
    update runs them (its loss times 0: the gradients are dropped, nothing steps). `loaded`: the
    models by role. With --engines_per_gpu the engines start in their own processes meanwhile, so
    the compiling (about 50 s of a GRPO step on an H200, docs/benchmarks.md) overlaps their
    start."""
    dynamic = args.use_dynamic_bsz
    samples, T = made_up_batch(
        args.max_response_length, (tokens or max(budgets(specs, args))) if dynamic else None
    )
    packed = args.use_remove_padding
    for spec in specs:
        micro, budget = (getattr(args, flag) for flag in spec.passes)
        budget = budget if dynamic else None
        if spec.value:
            passes.batched_values(loaded[spec.role], samples, micro, packed, T, budget)
        else:
            passes.batched_log_probs(
                loaded[spec.role],
                samples,
                micro,
                args.temperature,
                packed,
                T,
                budget,
                with_entropy=spec.trained,
                fused=args.use_fused_kernels,
            )
    for spec in (s for s in specs if s.trained):
        model = loaded[spec.role]
        model.train()  # as the update (Hugging Face's checkpointing acts in train mode only)
        micro, budget = (getattr(args, flag) for flag in spec.update)
        for idx in passes.micro_batches(samples, micro, budget if dynamic else None):
            part = [samples[i] for i in idx]
            if spec.value:
                loss = passes.forward_values(model, part, packed).sum() * 0
            else:
                log_probs, entropy = passes.policy_forward(model, part, args, spec.entropy)
                loss = log_probs.sum() * 0 + (0 if entropy is None else entropy.sum() * 0)
            loss.backward()
        model.zero_grad(set_to_none=True)
        model.eval()


def small_batch_tokens(args, config, specs):
    """The size of --warm_compile_caches' made-up batch (`made_up_batch`), where `compile_ahead`
    would fill the largest token budget: the fewest sequences past the sizes at which inductor's
    code changes (the guards it put on a made-up batch of 20 tokens, docs/benchmarks.md), so that a
    real step's micro-batches reuse the graphs: logits (K, V) past 2**31 elements, indexed in 64
    bits, and a fusion in the layers it makes only below 5,242,880 / hidden size tokens. For
    Qwen2.5-0.5B at 1,024-token responses: 15 sequences, 15,480 tokens (14,848 of them responses;
    14,134 pass 2**31 logits). At most the largest token budget (whose micro-batches never
    cross those sizes)."""
    R = args.max_response_length
    seqs = 2**31 // (config.vocab_size * R) + 2  # made_up_batch's last response is half as long
    tokens = max(seqs * (8 + R), 5_242_880 // config.hidden_size + 1)
    return min(tokens, max(budgets(specs, args)))


def warms(args, device):
    """--warm_compile_caches as given, or (unset) on where it runs: on a GPU, with the in-process
    engine, where the step's passes compile."""
    if args.warm_compile_caches is not None:
        return args.warm_compile_caches
    return device.type == "cuda" and args.engines_per_gpu == 1 and ops.compiles(args, device)


def helper_bytes(args, config, specs):
    """--warm_compile_caches' helper process on a GPU, at most: its one-layer models (a trained
    model's fp32 weights and gradients and a bf16 copy gathered, a frozen one's without gradients; a
    value model's root holds the embeddings only), the logits of its made-up batch
    (`small_batch_tokens`) and their gradient in bf16, a quarter more for the rest, and 2 GiB for
    CUDA's context and the compiler (Qwen2.5-0.5B, GRPO's tutorial: 15.7 GiB, its embeddings
    tied). Each model counts at its own shape; `config` is the policy's."""
    shape = shapes.Shape.of(config)
    weights = 0
    for spec in specs:
        own = shapes.Shape.of(shapes.config_of(spec.path))
        root = own.vocab * own.hidden if spec.value else own.root_params
        weights += (root + own.layer_params) * (10 if spec.trained else 6)
    if args.use_dynamic_bsz:
        tokens = small_batch_tokens(args, config, specs)
        response = tokens * args.max_response_length / (8 + args.max_response_length)
    else:  # micro-batches by count: two short sequences (made_up_batch)
        response = sum(len(r) for _, r in made_up_batch(args.max_response_length)[0])
    logits = response * shape.vocab * 2 * 2
    return int(1.25 * (weights + logits)) + 2 * 2**30


def cache_hits():
    """How many of the graphs compiled so far were loaded from torch's compile caches on disk (by
    AOTAutograd's cache, which holds a graph's forward and backward), as "N of M graphs"."""
    from torch._dynamo.utils import counters

    c = counters["aot_autograd"]
    hits = c["autograd_cache_hit"]
    return f"{hits} of {hits + c['autograd_cache_miss'] + c['autograd_cache_bypass']} graphs"


# --- the helper process ---------------------------------------------------------------------------


def name_globals_as_the_trainer():
    """In a process spawned from a train script: make pickle name globals as the trainer does. The
    compile caches' keys pickle globals such as torch.contiguous_format by reference, and pickle's C
    implementation names one by the first module in sys.modules that holds it: torch._utils in the
    trainer, but in a spawned process the trainer's script, imported first as __mp_main__, so every
    key would differ from the trainer's. Moved last in the order, the script is found last."""
    script = sys.modules.pop("__mp_main__", None)
    if script is not None:
        sys.modules["__mp_main__"] = script


def set_as_the_engine_will(args):
    """In --warm_compile_caches' helper: the torch settings that the in-process vLLM engine's
    worker makes in the trainer's process once it starts, and that the compile caches' keys hold
    (in AOTAutograd's, the "cuda_matmul_settings"): the float32 matmul precision, from
    VLLM_FLOAT32_MATMUL_PRECISION ("highest" unless set). Set explicitly, even to torch's own
    default, it changes every key, so without it no graph the helper compiled matched the
    trainer's (0 of 13 on an H200)."""
    if args.rollout_engine == "vllm":
        precision = os.environ.get("VLLM_FLOAT32_MATMUL_PRECISION", "highest").lower()
        torch.set_float32_matmul_precision(precision)


def helper(args, device, specs, launched, engine_started):
    """The helper process of --warm_compile_caches (`WarmStart`), while the trainer loads its
    models, starts the in-process engine and runs its first step eager: `compile_ahead` on randomly
    initialised one-layer copies of the run's models and a small made-up batch, in a process group
    of its own. torch.compile keeps what it compiles in caches on disk (inductor's graphs,
    AOTAutograd's, Triton's kernels), keyed by the graph, and every decoder layer of a model shares
    one (`ops.compile_layers`): after its first step the trainer runs `compile_ahead` on the
    same batch (little memory beside the awake engine) and loads the code instead of compiling it.
    Only the same calls in the same order hit: which sizes torch.compile makes one symbol depends
    on the sizes it has seen."""
    from engine_pool import TORCHRUN_ENV

    for key in TORCHRUN_ENV:  # not one of torchrun's workers
        os.environ.pop(key, None)
    name_globals_as_the_trainer()
    set_as_the_engine_will(args)
    if device.type == "cuda":
        torch.cuda.set_device(device)
        if args.gpu_memory_gib:  # as on a GPU of that size: the plan's room for the helper
            config = shapes.config_of(specs[0].path)
            total = torch.cuda.get_device_properties(device).total_memory
            share = helper_bytes(args, config, specs) / total
            torch.cuda.set_per_process_memory_fraction(min(share, 1.0), device)
    dist.init_process_group(
        "nccl" if device.type == "cuda" else "gloo",
        store=dist.HashStore(),
        rank=0,
        world_size=1,
        device_id=device if device.type == "cuda" else None,
    )
    if ops.gpu_default(args.use_torch_compile, device):
        ops.compile_logits_math()
    copies = {spec.role: models.load(spec, device, args, layers=1) for spec in specs}
    tokens = small_batch_tokens(args, shapes.config_of(specs[0].path), specs)
    started = time.time() - launched
    compile_ahead(copies, specs, args, device, tokens=tokens)
    dist.destroy_process_group()
    print(
        f"the helper process compiled the passes {time.time() - launched:.1f} s after launch "
        f"(from {started:.1f} s)",
        flush=True,
    )
    # GPU memory freed while the trainer's vLLM engine starts would upset the engine's measure of
    # the free memory ("Error in memory profiling"): the helper ends, freeing its memory, once the
    # engine has started (or the trainer has ended)
    trainer = torch.multiprocessing.parent_process()
    while not engine_started.wait(1.0) and trainer.is_alive():
        pass


class WarmStart:
    """--warm_compile_caches for a run (`run.Run`): the helper process, one per machine, started
    before the models load; the first step eager, at token budgets planned for eager passes beside
    the helper; after it, the step's passes compiled from the helper's caches, the compiled budgets
    back."""

    def __init__(self, run):
        args, device = run.args, run.device
        flags.need(
            args.engines_per_gpu == 1,
            "--warm_compile_caches is for the in-process engine: with --engines_per_gpu above 1 "
            "the passes compile while the engines start; drop it",
        )
        flags.need(
            ops.compiles(args, device),
            "--warm_compile_caches compiles the step's passes ahead, and none compiles here: add "
            "--compile_layers true or --use_torch_compile true, or drop it",
        )
        self.run, self.process, self.eager = run, None, False
        if int(os.environ["LOCAL_RANK"]) == 0:
            ctx = torch.multiprocessing.get_context("spawn")
            self.engine_started = ctx.Event()
            launched = time.time() - seconds_since_launch()
            self.process = ctx.Process(
                target=helper,
                name="warm_compile_caches",
                args=(args, device, run.specs, launched, self.engine_started),
            )
            self.process.start()
            atexit.register(self.process.kill)  # the run ended before it did

    def first_step_eager(self):
        """Once the engine has started: the helper may end once it has compiled; every
        torch.compile'd function runs eager, at the eager plan's budgets (`eager_budgets`)."""
        if self.process is not None:
            self.engine_started.set()
        self.eager = True
        self.eager_budgets()
        torch.compiler.set_stance("force_eager")
        ops.compile_logits_math(False)

    def eager_budgets(self):
        """The token budgets of a plan for eager passes (whose activations and logits take more
        memory than the compiled ones'), where the flags did not set them, kept until `after_step`
        restores the compiled ones."""
        run, args = self.run, self.run.args
        names = memory.budget_flags(run.specs)
        self.compiled_budgets = {name: getattr(args, name) for name in names}
        self.compiled_plan, self.compiled_fused = run.plan, args.use_fused_kernels
        actor = run.loaded.get(run.specs[0].role)
        if run.device.type == "cuda" and actor is not None and ops.plain_output_layer(actor):
            # the eager update's output layer chunk by chunk (ops.fused_log_probs): eager
            # (K, V) fp32 logits of unequal micro-batches split torch's cached segments until one
            # no longer fits (an H200 ran out of memory so at 36,864-token micro-batches)
            args.use_fused_kernels = True
        self.release_cache, Timer.release_cache = Timer.release_cache, run.device.type == "cuda"
        if run.plan is not None and run.plan.first is not None:
            # planned before the models loaded (memory.plan_memory): eager passes beside the helper
            for name in names:
                setattr(args, name, min(getattr(args, name), run.plan.first.budgets[name]))
            run.plan = run.plan.first
        if run.rank == 0:  # the flags that size its micro-batches
            shown = names if args.use_dynamic_bsz else memory.micro_batch_flags(run.specs)
            chosen = " ".join(f"--{name} {getattr(args, name)}" for name in shown)
            fused = " --use_fused_kernels true" if args.use_fused_kernels else ""
            print(
                f"the first step runs eager while the helper compiles, with {chosen}{fused}",
                flush=True,
            )

    def flags(self):
        """The flags that the eager first step changed, as the command line made them (for
        checkpoints and loggers)."""
        if not self.eager:
            return {}
        return self.compiled_budgets | {"use_fused_kernels": self.compiled_fused}

    def after_step(self):
        """After the eager first step: wait for the helper, then compile the step's passes on the
        helper's made-up batch, which loads its graphs from the compile caches, with the compiled
        passes' token budgets back."""
        run, args = self.run, self.run.args
        self.eager = False
        self.join()
        torch.compiler.set_stance("default")
        ops.compile_logits_math(ops.gpu_default(args.use_torch_compile, run.device))
        for name, budget in self.compiled_budgets.items():
            setattr(args, name, budget)
        run.plan, args.use_fused_kernels = self.compiled_plan, self.compiled_fused
        Timer.release_cache = self.release_cache
        started = seconds_since_launch()
        config = shapes.config_of(run.specs[0].path)
        tokens = small_batch_tokens(args, config, run.specs)
        compile_ahead(run.loaded, run.specs, args, run.device, tokens=tokens)
        if run.rank == 0:
            print(
                f"compiled the passes in {seconds_since_launch() - started:.1f} s, "
                f"{cache_hits()} from the helper's compile caches",
                flush=True,
            )

    def join(self):
        """Wait for this machine's helper to end; every rank waits."""
        if self.process is not None:
            waited = seconds_since_launch()
            self.process.join()
            atexit.unregister(self.process.kill)
            print(
                f"waited {seconds_since_launch() - waited:.1f} s for the compiling helper"
                if self.process.exitcode == 0
                else f"the compiling helper process failed (exit code {self.process.exitcode}, "
                "its error above): the passes compile here",
                flush=True,
            )
        if dist.is_initialized():
            dist.barrier()
