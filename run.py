"""A run's life around a train script's loop: start-up, its models loaded and resumed, the engine's
start, the validate / checkpoint / stop cadence at the end of each step, and the final export.

A train script declares `Args(flags.RunArgs)` with its algorithm's flags and `models(args)`, the
models it holds (`models.Model`), then, in `main`:

    r = run.start(args, check_args, models)  # process group, flags, reward, data, memory plan
    actor, ref = r.load("actor"), r.load("ref")  # FSDP2-sharded; None for a model left out
    ...its optimizers and schedulers...
    state = r.resume(optimizers, schedulers)  # its trainer state, {} when fresh
    engine = r.make_engine()
    r.engine_ready(engine, actor)
    source = batches.Batches(r, engine, actor, state)
    for step in range(r.step + 1, r.total_steps + 1):
        ...phases 1-6...
        if r.end_step(step, metrics, timer, batch, old_log_probs, source):  # 7
            break
    return r.finish(step, metrics, actor, source)

Nothing here knows an algorithm: what differs between scripts (their models, their trainer state)
is passed in as values. Start-up tuning (compiling ahead, the compiling helper and the eager first
step: compile_ahead.py) happens inside these calls.
"""

import fcntl
import functools
import math
import os
import random
import socket
import sys
import time
from collections import Counter
from dataclasses import asdict

import numpy as np
import torch
import torch.distributed as dist
from tqdm import tqdm
from transformers import AutoTokenizer

import checkpoint
import compile_ahead
import flags
import memory
import models
import ops
import reward
import shapes
import sharding
from batches import batch_metrics, round_metrics, validate
from cli import given_flags, parse
from data.dataset import load_rl_dataset
from ending import StopRequest, Unbroken, finished, record_for_torchrun, run_to_end, watch_peers
from flags import need
from metrics import (
    PHASES,
    Logger,
    Timer,
    check_logins,
    forward_flops,
    measure_peak_flops,
    phase_perf,
    repair_metrics,
    seconds_since_launch,
)
from rollout import make_engine


def init_distributed():
    """torchrun sets RANK/WORLD_SIZE; a plain `python train_*.py` runs as a world of one."""
    for k, v in (
        ("RANK", "0"),
        ("LOCAL_RANK", "0"),
        ("WORLD_SIZE", "1"),
        ("MASTER_ADDR", "127.0.0.1"),
    ):
        os.environ.setdefault(k, v)
    os.environ.setdefault("MASTER_PORT", str(29500 + os.getpid() % 1000))
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
        device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
    else:
        device = torch.device("cpu")
    dist.init_process_group(
        "nccl" if device.type == "cuda" else "gloo",
        device_id=device if device.type == "cuda" else None,
    )
    if dist.get_world_size() > 1:
        watch_peers()  # a rank that fails ends the others within a second
    return dist.get_rank(), dist.get_world_size(), device


def lr_lambda(args, total_steps):
    """The actor's rate at each update step, as a fraction of --actor_lr: a linear warmup, then
    constant or a cosine down to --min_lr_ratio over the last --lr_decay_steps_ratio of the steps
    (held before it)."""
    warmup = (
        args.lr_warmup_steps
        if args.lr_warmup_steps >= 0
        else int(args.lr_warmup_steps_ratio * total_steps)
    )
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


def lock_folder(folder):
    """One run per folder at a time: an exclusive lock on FOLDER/.lock for as long as the returned
    file stays open. The system drops it when the process ends, however it ends, so a killed run
    leaves none behind."""
    os.makedirs(folder, exist_ok=True)
    f = open(os.path.join(folder, ".lock"), "a+")
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        f.seek(0)
        holder = f.read().strip() or "another process"
        f.close()
        need(
            False,
            f"{folder} is in use by another run ({holder}): wait for it to end, or give this run "
            "another --default_local_dir / --experiment_name",
        )
    f.seek(0)
    f.truncate()
    f.write(f"pid {os.getpid()} on {socket.gethostname()}\n")
    f.flush()
    return f


# --- a run: its models, resume, the engine, the end of each step, the end -------------------------


class Run:
    """What a run holds beside the script's loop: the process group and device, the reward
    function, tokenizer and data, the number of steps, the models (`specs`, as the script declared
    them; `loaded`, by role), the memory plan, the engine, the logger, the SIGTERM watch and the
    progress bar. `start` makes one; the script calls its methods in the order of the module's
    docstring."""

    def __init__(self, args, rank, world, device, specs):
        self.args, self.rank, self.world, self.device, self.specs = args, rank, world, device, specs
        self.step, self.loaded, self.optimizers, self.schedulers = 0, {}, {}, {}
        self.state, self.last_row, self.plan, self.warm = {}, None, None, None
        self.gpu_bytes = None  # the GPU's own size, where there is one
        self.fence = None  # with --gpu_memory_gib on a larger GPU: memory.fence's cap
        self.engine, self.logger, self.stop, self.bar, self.stopping = None, None, None, None, False
        self.given = given_flags()  # the flags named on the command line

    def load(self, role):
        """The model of `role` as the script declared it (`models.load`), or None where the run has
        none: a role not declared, or with --val_only every model but the first (the policy it
        evaluates, loaded frozen)."""
        spec = next((s for s in self.specs if s.role == role), None)
        first = spec is self.specs[0]
        if spec is None or (self.args.val_only and not first):
            return None
        trainable = spec.trained and not self.args.val_only
        self.loaded[role] = models.load(spec, self.device, self.args, trainable)
        return self.loaded[role]

    def resume(self, optimizers, schedulers):
        """Load the checkpoint --resume_mode names (auto: the newest under --default_local_dir)
        into the trained models, the optimizers and schedulers (dicts by role, as the models), kept
        for the checkpoints to come. Returns its trainer state ({} when starting afresh), or None
        when that run has already finished its steps."""
        args = self.args
        trained = {s.role for s in self.specs if s.trained}
        models_ = {role: m for role, m in self.loaded.items() if role in trained}
        self.models, self.optimizers, self.schedulers = models_, optimizers, schedulers
        # --resume_mode auto: the newest checkpoint that can be read, saying which could not
        if args.resume_mode == "auto":
            steps = reversed(checkpoint.list_checkpoints(args.default_local_dir))
            candidates = [os.path.join(args.default_local_dir, f"global_step_{s}") for s in steps]
        else:
            candidates = [] if args.resume_mode == "disable" else [args.resume_mode]
        # the optimizers' settings as the command line made them (a checkpoint's would replace them)
        settings = {
            role: [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups]
            for role, opt in optimizers.items()
        }
        state, resume = {}, None
        for i, resume in enumerate(candidates):
            try:
                state = checkpoint.load_checkpoint(resume, models_, optimizers, schedulers)
                break
            except checkpoint.CheckpointError as e:
                what = "Resume from another global_step_N (--resume_mode PATH), or start over"
                need(i + 1 < len(candidates), f"{e}. {what} with --resume_mode disable")
                if self.rank == 0:
                    print(f"{e}; resuming from the checkpoint before it", flush=True)
        if state:
            self.step = state["global_step"]
            if self.rank == 0:
                print(f"resumed from {resume} (step {self.step})", flush=True)
            self.apply_flags(state.get("args", {}), optimizers, schedulers, settings)
        self.state = state
        # the optimizers' state exists from step 1 on (the memory plan's peaks hold from there),
        # where --optimizer_offload keeps it between updates
        offload = {s.role: s.on(args, "optimizer_offload") for s in self.specs}
        for role, opt in optimizers.items():
            if not args.val_only:
                sharding.init_optimizer_state(opt)
            if offload.get(role):
                sharding.move_optimizer_state(opt, "cpu")
        # the checkpoint's own metrics row, for a metrics.jsonl that lost it: only in its own folder
        # (a run resumed from another run's checkpoint starts its log at the step after it)
        folder = os.path.dirname(os.path.normpath(resume)) if resume else None
        here = folder is not None and os.path.samefile(folder, args.default_local_dir)
        self.last_row = state.get("metrics_row") if here else None
        if here and args.resume_mode != "auto" and not args.val_only and self.rank == 0:
            checkpoint.set_aside_later(args.default_local_dir, self.step)
        if self.step >= self.total_steps and not args.val_only:
            if self.rank == 0:
                path = os.path.join(args.default_local_dir, "metrics.jsonl")
                repair_metrics(path, self.step, self.last_row)
            final = os.path.join(args.default_local_dir, "hf_model")
            if args.export_final and not os.path.isdir(final):  # a crash before it was written
                checkpoint.export_hf(final, self.loaded[self.specs[0].role], self.tokenizer)
                if self.rank == 0:
                    print(f"{resume} had finished its steps; wrote its final policy {final}")
                return None
            if self.rank == 0:
                print(
                    f"{os.path.basename(sys.argv[0])}: {resume} already finished {self.step} of "
                    f"{self.total_steps} steps; nothing to do. Raise --total_training_steps / "
                    "--total_epochs to train on, or use --resume_mode disable to start over."
                )
            return None
        return state

    def apply_flags(self, saved, optimizers, schedulers, settings):
        """A resume whose flags differ from the checkpoint's run (`saved`): say which, and let the
        command line's values win, the optimizers' too (`settings`: their groups as built before
        the checkpoint loaded, whose learning rate and weight decay would replace them)."""
        ignored = {"resume_mode", "total_training_steps", "total_epochs"}  # how far, from where
        now = asdict(self.args)
        changed = {k: (v, now[k]) for k, v in saved.items() if k in now and v != now[k]}
        changed = {k: v for k, v in changed.items() if k not in ignored}
        if changed and self.rank == 0:
            what = ", ".join(f"--{k} {old} -> {new}" for k, (old, new) in sorted(changed.items()))
            print(f"resumed with other flags than the checkpoint's run: {what}; the command line's "
                  "values apply", flush=True)  # fmt: skip
        for role, opt in optimizers.items():
            for g, built in zip(opt.param_groups, settings[role]):
                g.update(built)
            s = schedulers.get(role)  # LambdaLR: lr = initial_lr x its factor at the step reached
            if s is not None:
                s.base_lrs = [g["initial_lr"] for g in opt.param_groups]
                for g, base, factor in zip(opt.param_groups, s.base_lrs, s.lr_lambdas):
                    g["lr"] = base * factor(s.last_epoch)
                s._last_lr = [g["lr"] for g in opt.param_groups]

    def make_engine(self):
        """The rollout engine (--rollout_engine, --engines_per_gpu), with dummy weights until
        `engine_ready`. A pool's engines start in their own processes, so the step's passes compile
        meanwhile where the speed flags compile (compile_ahead.py). With --warm_compile_caches the
        first step runs eager instead, while the helper compiles, and the trainer loads the
        helper's graphs after it."""
        args, device = self.args, self.device
        self.models_loaded = seconds_since_launch()
        on_gpu = device.type == "cuda"
        engine = make_engine(
            args.rollout_engine,
            args.model,
            engines_per_gpu=args.engines_per_gpu,
            tensor_parallel_size=args.tensor_model_parallel_size,
            gpu_memory_utilization=memory.engine_utilization(args, self.gpu_bytes),
            fence=self.fence,
            max_num_seqs=args.max_num_seqs,
            torch_compile=args.rollout_compile,
            seed=args.seed,
            max_model_len=args.max_prompt_length + args.max_response_length,
            dtype="bfloat16" if on_gpu else "float32",
            kv_cache_memory_bytes=None if on_gpu else memory.cpu_kv_cache_bytes(args),
            enforce_eager=not on_gpu,
            load_format="dummy",
        )
        self.compiled_ahead = (
            not engine.in_process and not args.val_only and ops.compiles(args, device)
        )
        if self.compiled_ahead:  # compile_ahead's batch fills the largest token budget
            compile_ahead.compile_ahead(self.loaded, self.specs, args, device)
        if self.warm is not None:
            self.warm.first_step_eager()
        return engine

    def flags(self):
        """The run's flags as the command line made them, for checkpoints and loggers (without
        --warm_compile_caches' eager first step's own budgets and output layer)."""
        return asdict(self.args) | (self.warm.flags() if self.warm else {})

    def engine_ready(self, engine, actor):
        """Push the actor's weights into the engine, open the logs (a resumed run drops the rows
        after its checkpoint) and, at step 0 with --val_before_train, validate the starting
        policy."""
        args, device = self.args, self.device
        compiled = seconds_since_launch()
        push_dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
        engine.update_weights(sharding.iter_full_tensors(actor, dtype=push_dtype, device=device))
        # where the time to the first step goes (docs/benchmarks.md, "The first step")
        if self.rank == 0:
            print(
                f"models loaded {self.models_loaded:.1f} s after launch, "
                + (f"passes compiled ahead at {compiled:.1f} s, " if self.compiled_ahead else "")
                + f"engine ready at {seconds_since_launch():.1f} s",
                flush=True,
            )
        self.engine = engine
        if args.val_only:  # its rows apart: a training run's metrics.jsonl there stays whole
            self.logger = Logger(args, args.default_local_dir, self.flags(), "val_only.jsonl")
            return
        self.logger = Logger(args, args.default_local_dir, self.flags())
        self.logger.resume(self.step, self.last_row)
        if self.step == 0 and self.rank == 0:  # afresh: keep what was here
            checkpoint.keep_earlier(os.path.join(args.default_local_dir, "hf_model"))
        if args.val_before_train and self.val is not None and self.step == 0:
            self.logger.log(self.validate(), self.step)
        self.peak_flops = measure_peak_flops(device) * self.world
        self.push_bytes = sum(p.numel() for p in actor.parameters()) * push_dtype.itemsize
        # a SIGTERM checkpoints the step in progress and stops; a stuck phase ends at the deadline
        self.stop = StopRequest(self.args.stop_grace_s, self.where)
        self.bar = tqdm(
            total=self.total_steps, initial=self.step, disable=self.rank != 0, desc="steps"
        )

    def where(self):
        """What the run is doing now, for a message: its phase and the reward call in progress."""
        phase = f"phase {' > '.join(PHASES)}" if PHASES else "no phase (between two)"
        busy = getattr(self.reward_fn, "busy", None)
        return phase + (f", {busy}" if busy else "")

    def validate(self, step=None):
        """Greedy mean@1 of the policy and, with --val_n above 1, sampled mean@n and pass@k."""
        step = self.step if step is None else step
        val = (self.engine, self.val, self.args, self.tokenizer, self.reward_fn, step)
        metrics = validate(*val)
        if self.args.val_n > 1:
            metrics |= validate(*val, n=self.args.val_n, temperature=self.args.val_temperature)
        return metrics

    def validate_only(self):
        """--val_only: the loaded policy's validation, logged as step N."""
        metrics = self.validate()
        self.logger.log(metrics, self.step)
        self.logger.close()
        if self.rank == 0 and "jsonl" in self.logger.kinds:
            print(f"validation of {self.args.model}: {self.logger.path}", flush=True)
        return metrics

    def work(self, tokens, responses, n_seqs):
        """The FLOPs of each phase of a step over `tokens` tokens, `responses` of them response
        tokens, in `n_seqs` sequences: a model's pass without gradients is one forward, its update
        three (forward and backward) per epoch; {phase: (name in perf/mfu/<name>, FLOPs)}."""
        work = {}
        for spec in self.specs:
            if spec.role in self.loaded:
                config = self.loaded[spec.role].config
                forward = forward_flops(config, tokens / n_seqs, tokens, responses, spec.value)
                work[spec.phase] = (spec.phase, forward)
                if spec.trained:  # named as verl's perf/mfu/actor
                    work[spec.update_phase] = (spec.role, 3 * self.args.ppo_epochs * forward)
        return work

    def end_step(self, step, metrics, timer, batch, old_log_probs, source, trainer_state=None):
        """Phase 7: the step's shared metrics (the batch's, timings, memory, MFU), then validate
        every --test_freq steps, checkpoint every --save_freq steps (and at the last, and on a
        SIGTERM), log. `trainer_state` is what the script's checkpoint keeps beside the data's
        position. Returns whether the run stops here (a SIGTERM: the step is checkpointed and not
        validated)."""
        args, t, device = self.args, timer.metrics, self.device
        responses = sum(len(s.token_ids) for g in batch.groups for s in g["samples"])
        n_seqs = sum(len(g["samples"]) for g in batch.groups)
        tokens = sum(len(g["example"].prompt_ids) * len(g["samples"]) for g in batch.groups)
        tokens += responses
        # the generation's own rate: beside the training with one-step off-policy generation
        gen_seconds = batch.seconds if source.overlap else t["timing_s/gen"]
        memory_gb = max([v for k, v in t.items() if k.startswith("perf/max_memory")], default=0.0)
        metrics |= batch_metrics(batch, old_log_probs, gen_seconds) | round_metrics(batch) | t
        metrics |= {
            "perf/throughput": tokens / t["timing_s/step"] / self.world,
            "perf/max_memory_allocated_gb": memory_gb,
            "training/global_step": step,
            "training/epoch": batch.epoch,
            "timing_s/since_launch": seconds_since_launch(),
        }
        if self.plan is not None:  # the memory planner's prediction beside each measured peak:
            # its plan (responses at the length limit) and its arithmetic at this step's lengths
            metrics |= {
                f"perf/planned_memory_gb/{phase}": peak / 2**30
                for phase, (peak, _) in self.plan.phases.items()
            }
            at = self.plan.at((tokens - responses) / n_seqs, responses / n_seqs)
            metrics |= {f"perf/predicted_memory_gb/{phase}": v / 2**30 for phase, v in at.items()}
        metrics |= phase_perf(
            t, self.work(tokens, responses, n_seqs), self.peak_flops, self.push_bytes
        )
        if source.overlap:  # the generation's own time, beside the previous step's training
            metrics["timing_s/gen_background"] = batch.seconds
        last_step = step == self.total_steps
        # checkpointed at once, not validated (nor exported, at the last step: a resume does that)
        stopping = self.stop.agreed(device)
        if (
            self.val is not None
            and args.test_freq > 0
            and (step % args.test_freq == 0 or last_step)
            and not stopping
        ):
            # the engine idle, with this step's weights
            source.settle(metrics, Timer(metrics, device))
            with Timer(metrics, device)("testing"):
                metrics |= self.validate(step)
            # a SIGTERM during validation: this step, too
            stopping = self.stop.agreed(device)
        # a stop is checkpointed whatever --save_freq says: a SIGTERM never loses the run
        if stopping or (args.save_freq > 0 and (step % args.save_freq == 0 or last_step)):
            with Timer(metrics, device)("save_checkpoint"):
                checkpoint.save_checkpoint(
                    args.default_local_dir,
                    step,
                    self.models,
                    self.optimizers,
                    self.schedulers,
                    # the step's row too: a crash before it reaches metrics.jsonl loses nothing
                    source.position()
                    | (trainer_state or {})
                    | {"metrics_row": {"step": step, **metrics}, "args": self.flags()},
                    keep_last=args.keep_last_checkpoints,
                )
            # one during the checkpoint: the run stops now, the checkpoint holds this step
            stopping = stopping or self.stop.agreed(device)
        self.logger.log(metrics, step)
        self.bar.update(1)
        self.stopping = stopping
        if self.warm is not None and self.warm.eager and not (stopping or last_step):
            self.warm.after_step()
        return stopping

    def finish(self, step, metrics, actor, source):
        """After the loop: the stop's message (a SIGTERM; a batch still generating is not waited
        for) or, the last batch in flight ended, the final policy exported as a Hugging Face folder
        (--export_final); the logs closed."""
        args = self.args
        self.bar.close()
        self.stop.stand_down()
        # a stop's checkpoint is written: a batch still generating is not waited for
        source.close(wait=not self.stopping)
        if self.stopping:
            if self.rank == 0:
                then = "writes the final policy" if step == self.total_steps else "continues"
                how = (
                    f"checkpointed in {args.default_local_dir}; the same command with "
                    f"--resume_mode auto {then} from there"
                )
                print(
                    f"stopped by {self.stop.name} after step {step} of {self.total_steps}, {how}",
                    flush=True,
                )
        elif args.export_final:
            export = {}  # its time and, on a GPU, its peak: after the last row of metrics.jsonl
            with Timer(export, self.device)("export"):
                path = checkpoint.export_hf(
                    os.path.join(args.default_local_dir, "hf_model"), actor, self.tokenizer
                )
            if self.rank == 0:
                kept = checkpoint.list_checkpoints(args.default_local_dir)
                saved = f"checkpoints {args.default_local_dir}; " if kept else ""
                print(
                    f"done: {step} step{'s' if step != 1 else ''}; metrics {self.logger.path}; "
                    f"{saved}final policy (Hugging Face format) {path}",
                    flush=True,
                )
                print(export_line(export, self.plan), flush=True)
        self.logger.close()
        return metrics


def export_line(export, plan):
    """The final export's time, and on a GPU its peak beside the plan's, as the log's last line
    (bench/plan_table.py reads it: the export comes after the last row of metrics.jsonl)."""
    line = f"export: {export['timing_s/export']:.1f} s"
    peak = export.get("perf/max_memory_allocated_gb/export")
    if peak is not None:
        line += f", peak {peak:.1f} GiB"
        if plan is not None and "export" in plan.phases:
            line += f" (planned {plan.phases['export'][0] / 2**30:.1f} GiB)"
    return line


# --- start and launch -----------------------------------------------------------------------------


def planned_world(args, world):
    """The GPUs a plan is for: --n_gpus_per_node x --nnodes where given (--print_plan plans for
    them without launching them), else the launched processes."""
    local = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    return (args.n_gpus_per_node or local) * (args.nnodes or max(world // local, 1))


def start(args, check_args, declare_models):
    """Start a run: the process group, the flags checked (the script's `check_args`), its models
    (`declare_models(args)`, a list of models.Model), the reward function, seeds, tokenizer, data,
    the number of steps and the memory plan; with --warm_compile_caches, the compiling helper.
    Refuses a fresh run (--resume_mode disable) in a folder that holds another run's checkpoints."""
    rank, world, device = init_distributed()
    try:  # --print_plan checks the flags as for the GPUs it plans for
        check_args(args, planned_world(args, world) if args.print_plan else world)
    except ValueError as error:  # a mode the script's math does not know, named by it
        need(False, str(error))
    specs = [m for m in declare_models(args) if m is not None]
    flags.check_budgets(args, specs)
    offloaded = [
        getattr(s, switch)
        for s in specs
        for switch in ("param_offload", "optimizer_offload")
        if s.on(args, switch)
    ]
    need(
        device.type == "cuda" or not offloaded or args.print_plan,  # a plan for a GPU elsewhere
        f"--{offloaded[0] if offloaded else ''} keeps a model's state on the CPU between its "
        "passes on the GPU; with no GPU there is nothing to offload: drop it",
    )
    run = Run(args, rank, world, device, specs)
    if device.type == "cuda":
        run.gpu_bytes = torch.cuda.get_device_properties(device).total_memory
        if args.gpu_memory_gib:  # behave as on a GPU of that size
            run.fence = memory.fence(args, device)
    if not args.print_plan:  # which reads configs only (shapes.config_of)
        for path in dict.fromkeys(spec.path for spec in specs):  # hub ids: reachable, or cached
            models.check_source(path, models.flag_of(args, path))
    if device.type == "cpu" and rank == 0 and not args.print_plan:
        print(
            "no GPU is visible: this run trains on the CPU, which suits tiny models (bash "
            "examples/quickstart_cpu.sh); on a GPU machine, see that nvidia-smi lists one and that "
            "torch.cuda.is_available() holds in this environment",
            flush=True,
        )
    gpus = planned_world(args, world)
    if args.print_plan:  # the model's config only: no weights, no data
        need(
            device.type == "cuda" or args.gpu_memory_gib,
            "--print_plan: no GPU is visible; say what size to plan for with --gpu_memory_gib G",
        )
        plan = plan_memory(run, gpus, args.max_prompt_length)
        if rank == 0:
            print(memory.plan_message(plan, args, specs), flush=True)
        finished.set()  # a clean exit, not a run ended early
        raise SystemExit(0 if plan.fits else 1)
    planned = [
        f"--{n} {getattr(args, n)}" for n in ("n_gpus_per_node", "nnodes") if getattr(args, n)
    ]
    need(
        gpus == world,
        f"{' '.join(planned)} plan for {gpus} GPUs, but {world} processes were launched: drop "
        "them (they are for --print_plan), or launch as many (torchrun --nproc_per_node N, "
        "--nnodes M)",
    )
    flags.check_paths(args)
    if rank == 0:
        check_logins(args)
    if args.resume_mode == "disable" and checkpoint.list_checkpoints(args.default_local_dir):
        # a fresh run there would interleave its checkpoints with the old ones (and prune its own)
        need(
            False,
            f"{args.default_local_dir} holds checkpoints of an earlier run; continue it with "
            "--resume_mode auto, or choose another --default_local_dir / --experiment_name, or "
            "delete them",
        )
    workers = max(args.reward_workers, 1 if args.reward_timeout else 0)
    run.reward_fn = reward.RewardFunction(
        args.custom_reward_function_path,
        args.custom_reward_function_name,
        workers,
        args.reward_timeout,
    )
    if ops.gpu_default(args.use_torch_compile, device):
        ops.compile_logits_math()
    # same init on every rank
    random.seed(args.seed)
    np.random.seed(args.seed)
    torch.manual_seed(args.seed)
    run.tokenizer = AutoTokenizer.from_pretrained(args.model)
    data_kw = dict(
        tokenizer=run.tokenizer,
        max_prompt_length=args.max_prompt_length,
        filter_overlong_prompts=args.filter_overlong_prompts,
        truncation=args.truncation,
    )
    run.val = (
        load_rl_dataset(args.val_files.split(","), **data_kw)
        if args.test_freq > 0 or args.val_only
        else None
    )
    run.train = None if args.val_only else load_rl_dataset(args.train_files.split(","), **data_kw)
    if args.custom_reward_function_path is None:  # the built-in reward: a scorer per source
        for flag, data in (("train_files", run.train), ("val_files", run.val)):
            sources = Counter(e.data_source for e in data.examples) if data else {}
            for source, n in sources.items():
                need(
                    source in reward.SCORERS,
                    f"--{flag} {getattr(args, flag)}: data_source {source!r} ({n} prompts) has no "
                    f"scorer in reward.py (known: {', '.join(sorted(reward.SCORERS))}); give a "
                    "reward function for it with --custom_reward_function_path, or add a scorer "
                    "to reward.SCORERS",
                )
    G = args.gen_batch_size or args.train_batch_size  # prompts per generation round
    if run.train is not None and len(run.train) < max(args.train_batch_size, G):
        name = "--gen_batch_size" if G > args.train_batch_size else "--train_batch_size"
        need(
            False,
            f"{args.train_files} holds {len(run.train)} usable prompts, fewer than {name} "
            f"{max(args.train_batch_size, G)}",
        )
    # the memory plan, before any weights load: the prompts' mean length from the data
    prompts = run.train or run.val
    mean_prompt = np.mean([len(e.prompt_ids) for e in prompts.examples]) if prompts else 0
    run.prompt_len = int(mean_prompt) or args.max_prompt_length
    run.plan = plan_memory(run, world, run.prompt_len)
    if run.plan is not None:
        # where memory set the budgets, each phase starts with torch's cached memory given back:
        # one phase's large blocks split by the next one's tensors held 8 GiB that no allocation
        # could use on an H200 run as a 24 GiB GPU; and the blocks grow in place
        Timer.release_cache = device.type == "cuda" and run.plan.bound
        if run.plan.fits and Timer.release_cache and memory.expandable_segments():
            run.plan.notes.append(
                "torch's allocator grows its blocks in place from here on (expandable segments): "
                "memory set the budgets"
            )
        message = memory.plan_message(run.plan, args, specs)
        need(run.plan.fits, message)
        if rank == 0:
            print(message, flush=True)
    steps_per_epoch = len(run.train) // args.train_batch_size if run.train else 0
    run.total_steps = args.total_training_steps or steps_per_epoch * args.total_epochs
    if compile_ahead.warms(args, device) and not args.val_only:
        run.warm = compile_ahead.WarmStart(run)  # the helper compiles while the models load
    # the folder made and held to the end once the input is known good: nothing left by a refusal
    run.lock = lock_folder(args.default_local_dir) if rank == 0 else None
    return run


def plan_memory(run, world, prompt_len):
    """The memory plan (memory.plan_memory) of a run on `world` GPUs, with the compiling helper's
    memory where --warm_compile_caches would start it (planned as on a GPU for
    --gpu_memory_gib on a CPU)."""
    args, specs = run.args, run.specs
    gpu = run.device if run.device.type == "cuda" else torch.device("cuda")
    planned = run.device.type == "cuda" or args.gpu_memory_gib is not None
    helper = None
    if planned and compile_ahead.warms(args, gpu) and not args.val_only:
        config = shapes.config_of(specs[0].path)
        helper = functools.partial(compile_ahead.helper_bytes, config=config, specs=specs)
    return memory.plan_memory(args, specs, world, run.device, prompt_len, run.given, helper)


def launch(main, Args):
    """The command line: parse the flags into the script's Args, run `main`, end the process (as
    ending.run_to_end says, whichever way `main` leaves)."""
    sys.stdout, sys.stderr = Unbroken(sys.stdout), Unbroken(sys.stderr)
    try:
        args = parse(Args)
    except SystemExit as error:  # a flag error, the same on every rank: printed by rank 0
        if error.code not in (0, None):
            record_for_torchrun(error, stack=False)  # torchrun's summary of each rank says it
            if int(os.environ.get("RANK", "0")) != 0:  # after rank 0, torchrun's root cause
                time.sleep(2 if "TORCHELASTIC_RUN_ID" in os.environ else 0)
                raise SystemExit(1) from None
        raise
    run_to_end(main, args)
