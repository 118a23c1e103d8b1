"""A run's life around a train script's loop: the flags every script shares, start-up and resume,
the engine's start, logging, timing and performance accounting, the validate / checkpoint / SIGTERM
cadence at the end of each step, and the final export.

A train script declares `Args(RunArgs)` with its algorithm's flags, then, in `main`:

    r = run.start(args, check_args)  # process group, flags, reward, tokenizer, data, steps
    ...its models and optimizers...
    state = r.resume(models, optimizers, schedulers)  # its trainer state, {} when fresh
    engine = r.make_engine()
    r.engine_ready(engine, actor)
    source = batches.Batches(r, engine, actor, state)
    for step in range(r.step + 1, r.total_steps + 1):
        ...phases 1-6...
        if r.end_step(step, metrics, timer, batch, old_log_probs, source):  # 7
            break
    return r.finish(step, metrics, actor, source)

Nothing here knows an algorithm: what differs between scripts (their models, their trainer state) is
passed in as values.
"""

import atexit
import contextlib
import fcntl
import importlib.util
import json
import math
import operator
import os
import random
import signal
import socket
import sys
import threading
import time
import traceback
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from tqdm import tqdm
from transformers import AutoConfig, AutoTokenizer, HfArgumentParser

import memory
import reward
import sharding
from batches import batch_metrics, round_metrics, validate
from data.dataset import load_rl_dataset
from rollout import make_engine

IMPORTED = time.time()


def flag(default, help, *, gt=None, ge=None, lt=None, le=None, also=()):
    """A field of an Args dataclass: the flag's default, its --help text and, for a number, the
    range `check_ranges` holds it to at start-up (gt, ge, lt, le), with `also` the values outside
    it that mean something (-1: never, off, all). A number with no bounds must still be finite."""
    f = field(default=default, metadata={"help": help})  # the parser takes metadata as its kwargs
    bounds = {k: v for k, v in (("gt", gt), ("ge", ge), ("lt", lt), ("le", le)) if v is not None}
    RANGES[f] = bounds, tuple(also)
    return f


RANGES = {}  # each flag's (bounds, values also allowed), by its dataclass field
BOUNDS = {"gt": (operator.gt, ">"), "ge": (operator.ge, ">="), "lt": (operator.lt, "<"),
          "le": (operator.le, "<=")}  # fmt: skip


def check_ranges(args):
    """Every numeric flag within its range (`flag`'s bounds), naming the flag and the range."""
    for f in fields(args):
        value = getattr(args, f.name)
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            continue  # a switch, a string, or a number left unset (None)
        bounds, also = RANGES.get(f, ({}, ()))
        ok = math.isfinite(value) and all(BOUNDS[k][0](value, v) for k, v in bounds.items())
        allowed = " and ".join(f"{BOUNDS[k][1]} {v}" for k, v in bounds.items()) or "finite"
        allowed += "".join(f", or {v}" for v in also)
        need(
            ok or value in also, f"--{f.name} {value} must be {allowed} (--help says what it does)"
        )


@dataclass
class RunArgs:
    """The flags every train script shares: model and data, the engine, micro-batches, the learning
    rate's schedule, memory, speed, reward and trainer. A script's Args adds its algorithm's flags
    and may re-declare a field here to change its default (its reference run's)."""

    model: str = flag("Qwen/Qwen2.5-0.5B-Instruct", "hub id or local folder")
    train_files: str = flag("~/data/gsm8k/train.parquet", "parquet, comma-separated")
    val_files: str = flag("~/data/gsm8k/test.parquet", "parquet, comma-separated")
    train_batch_size: int = flag(256, "prompts per step (all ranks)", ge=1)
    max_prompt_length: int = flag(512, "tokens, after the chat template", ge=1)
    max_response_length: int = flag(1024, "tokens generated at most", ge=1)
    filter_overlong_prompts: bool = flag(False, "drop prompts over max_prompt_length")
    truncation: str = flag("error", "overlong prompts when not filtered: error|left|right")
    # rollout
    rollout_engine: str = flag("vllm", "vllm | hf (transformers generate)")
    temperature: float = flag(1.0, "sampling temperature", gt=0)
    top_p: float = flag(1.0, "nucleus sampling", gt=0, le=1)
    top_k: int = flag(-1, "-1 = off", ge=1, also=(-1,))
    tensor_model_parallel_size: int = flag(1, "GPUs per vLLM replica", ge=1)
    logprob_check_prompts: int = flag(
        8,
        "prompts per GPU per step whose engine log-probs are checked (rollout/logprob_gap_mean); "
        "-1: all",
        ge=0,
        also=(-1,),
    )
    gpu_memory_utilization: float | None = flag(
        None,
        "vLLM's share of GPU memory while awake; default: what the memory planner leaves it, at "
        "most 0.6",
        gt=0,
        le=1,
    )
    max_num_seqs: int = flag(
        1024,
        "sequences vLLM decodes at once; the rest of a step's batch waits for free slots",
        ge=1,
    )
    engines_per_gpu: int = flag(
        1,
        "vLLM engines per GPU, each in a process of its own decoding a share of the sequences: a "
        "small model's generation is bound by vLLM's host work, which K processes share "
        "(docs/benchmarks.md)",
        ge=1,
    )
    rollout_compile: bool = flag(
        False,
        "run vLLM's model through torch.compile (vLLM's default); off: CUDA graphs of vLLM's "
        "uncompiled forward for every decoding batch, which on an H200 was ready 31 s sooner and "
        "generated faster (docs/benchmarks.md)",
    )
    # samples and mini-batches (a script re-declares rollout_n for its reference run)
    rollout_n: int = flag(5, "responses per prompt (GRPO's group size)", ge=1)
    ppo_mini_batch_size: int = flag(64, "prompts per optimizer step (x rollout_n inside)", ge=1)
    ppo_epochs: int = flag(1, "passes over each batch", ge=1)
    # micro-batches: each pass's size, by count or (--use_dynamic_bsz) by token budget
    ppo_micro_batch_size_per_gpu: int = flag(4, "sequences per forward/backward", ge=1)
    log_prob_micro_batch_size_per_gpu: int = flag(8, "sequences per log-prob forward", ge=1)
    use_dynamic_bsz: bool | None = flag(
        None,
        "micro-batches by token budget (the *_max_token_len_per_gpu flags) instead of sequence "
        "count; default: on a GPU unless a *_micro_batch_size_per_gpu flag is given",
    )
    ppo_max_token_len_per_gpu: int | None = flag(
        None, "tokens per forward/backward; default: the memory planner's (16384 on a CPU)", ge=1
    )
    log_prob_max_token_len_per_gpu: int | None = flag(
        None, "tokens per log-prob forward; default: the memory planner's (16384 on a CPU)", ge=1
    )
    print_plan: bool = flag(
        False, "print the memory plan (each phase's predicted peak, the budgets) and exit"
    )
    gpu_memory_gib: float | None = flag(
        None, "plan for a GPU of this many GiB instead of the visible one", gt=0
    )
    # the learning rate's schedule
    lr_warmup_steps: int = flag(-1, "-1: use lr_warmup_steps_ratio", ge=0, also=(-1,))
    lr_warmup_steps_ratio: float = flag(0.0, "warmup as a fraction of all steps", ge=0, le=1)
    lr_scheduler_type: str = flag("constant", "constant | cosine (after warmup)")
    min_lr_ratio: float = flag(
        0.0, "cosine: the rate it decays to, as a fraction of --actor_lr", ge=0, le=1
    )
    lr_decay_steps_ratio: float = flag(
        1.0,
        "cosine: decay over this last fraction of all steps and hold the rate before it "
        "(warmup-stable-decay); 1: decay from the end of warmup (verl's cosine)",
        gt=0,
        le=1,
    )
    # the engine's sampling distribution against the trainer's
    rollout_is: str | None = flag(
        None,
        "token | sequence: weight each token's loss by pi_old / pi_rollout, the trainer's over the "
        "engine's probability of the sampled tokens, truncated at --rollout_is_threshold "
        "(truncated importance sampling, verl's algorithm.rollout_correction.rollout_is): corrects "
        "for the engine's numerics and, with GRPO's --one_step_off_policy, for the update between "
        "the weights that sampled and the trainer's. Asks the engine for the log-probs of every "
        "response. With --top_p or --top_k on, the engine's are of the truncated distribution, so "
        "the weights sit below 1",
    )
    rollout_is_threshold: float = flag(2.0, "rollout_is: the weights' upper bound", ge=1)
    # a step's batch (batches.py): DAPO's dynamic sampling, GRESO's skip, one-step off-policy
    filter_groups: bool = flag(
        False, "DAPO dynamic sampling: drop all-equal groups (--rollout_n > 1)"
    )
    max_num_gen_batches: int = flag(
        10, "filter_groups: generation rounds per step at most; 0: no limit (verl's meaning)", ge=0
    )
    gen_batch_size: int = flag(
        0,
        "filter_groups: prompts a generation round takes at most (DAPO: 3 x train_batch_size); "
        "0: train_batch_size",
        ge=0,
    )
    filter_groups_from_step: int = flag(
        1,
        "filter_groups: the first step that filters; the steps before it train on one batch as "
        "generated (while the reward is still 0 almost everywhere, too few groups vary to fill a "
        "batch)",
        ge=1,
    )
    skip_all_equal: bool = flag(
        False,
        "filter_groups: GRESO's selective rollout: on filtering steps, skip before generating a "
        "prompt whose latest group scored all-equal (the filter would likely drop its group again)",
    )
    skip_explore_prob: float = flag(
        0.5,
        "skip_all_equal: a prompt whose last z groups in a row scored all-equal is generated "
        "anyway with probability P**z",
        gt=0,
        le=1,
    )
    one_step_off_policy: bool = flag(
        False,
        "generate the next step's batch in a second thread while this step trains, with the "
        "weights from before this step's update (one-step off-policy, as verl's recipe of that "
        "name). The engine stays awake: give it less memory (--gpu_memory_utilization 0.3 on an "
        "H200). Measured on one H200 with a 0.5B model: steps 7-13% shorter (the two share the GPU "
        "and the Python interpreter, so each ran slower), and in one learning run lower accuracy "
        "by step and by minute (docs/benchmarks.md)",
    )
    # memory
    enable_gradient_checkpointing: bool = flag(False, "recompute activations")
    param_offload: bool = flag(False, "actor params, grads and optimizer on CPU")
    optimizer_offload: bool = flag(False, "optimizer state on CPU between steps")
    ref_param_offload: bool = flag(False, "reference model params on CPU")
    use_remove_padding: bool = flag(True, "pack sequences instead of padding")
    # speed
    use_torch_compile: bool | None = flag(
        None,
        "torch.compile the log-prob and entropy math over the vocabulary, in every pass, its "
        "gradient written by hand (default: on GPU)",
    )
    compile_layers: bool | None = flag(
        None, "torch.compile each decoder layer, in the passes without gradients (default: on GPU)"
    )
    use_fused_kernels: bool = flag(
        False,
        "the update's log-probs and entropy from the output layer chunk by chunk, never the whole "
        "(tokens, vocabulary) logits: less memory for one more matmul of the output layer (verl's "
        "flag; here for the passes with a gradient only)",
    )
    compile_update: bool | None = flag(
        None,
        "compile the decoder layers in the updates (the actor's, and PPO's critic's; forward and "
        "backward) too, where --compile_layers compiles (--use_torch_compile already covers the "
        "actor's log-prob math): pays off with large micro-batches (--ppo_max_token_len_per_gpu "
        "49152 on an H200), costs compiling in step 1 (about 30 s for GRPO's actor on a fresh "
        "H200, docs/benchmarks.md); default: on with token budgets on a GPU",
    )
    warm_compile_caches: bool | None = flag(
        None,
        "with the in-process engine: a helper process compiles the step's passes on one-layer "
        "copies of the models while the models load, the engine starts and the first step runs "
        "eager (at token budgets planned for eager passes); the trainer then loads them from "
        "torch's compile caches (docs/performance.md); default: on a GPU with the in-process "
        "engine where the passes compile",
    )
    # reward
    custom_reward_function_path: str | None = flag(None, "a .py file")
    custom_reward_function_name: str = flag("compute_score", "function in that file")
    reward_errors: str = flag(
        "raise",
        "raise | zero: a reward call that fails or times out scores 0, counted in reward/errors",
    )
    reward_workers: int = flag(
        0,
        "processes per GPU process that call the reward function in parallel (0: in the "
        "trainer's own process)",
        ge=0,
    )
    reward_timeout: float | None = flag(
        None,
        "seconds a reward call may take before it fails as a reward error; calls then run "
        "in worker processes (at least one, --reward_workers)",
        gt=0,
    )
    # trainer
    total_epochs: int = flag(15, "passes over the training prompts", ge=1)
    total_training_steps: int | None = flag(None, "overrides total_epochs", ge=1)
    save_freq: int = flag(
        -1, "checkpoint every N steps, the last, on a stop (-1: never)", ge=1, also=(-1,)
    )
    test_freq: int = flag(10, "validate every N steps (-1: never)", ge=1, also=(-1,))
    # verl's default is True; its GSM8K tutorials (PPO and GRPO) pass False, and so do we
    val_before_train: bool = flag(False, "validate before the first step")
    val_only: bool = flag(False, "only evaluate --model (or the checkpoint) and exit")
    stop_grace_s: float = flag(
        25.0,
        "after a SIGTERM, the seconds the step in progress has to reach its checkpoint; past them "
        "the run ends at once, naming the phase it is in (torchrun and Slurm kill 30 s after their "
        "SIGTERM)",
        gt=0,
    )
    val_n: int = flag(1, "val_only: samples per prompt for pass@k (T=val_temperature)", ge=1)
    val_temperature: float = flag(1.0, "val_only: temperature of the pass@k samples", ge=0)
    max_val_samples: int | None = flag(None, "validate on the first N prompts", ge=1)
    resume_mode: str = flag("auto", "auto | disable | a global_step_N folder")
    default_local_dir: str | None = flag(None, "default checkpoints/PROJECT/EXPERIMENT")
    keep_last_checkpoints: int = flag(2, "checkpoints kept on disk", ge=1)
    export_final: bool = flag(True, "write the final policy as a HF folder")
    rollout_data_dir: str | None = flag(
        None, "write the responses each step trains on (text, score) to DIR/STEP.jsonl"
    )
    validation_data_dir: str | None = flag(
        None,
        "write each validation's responses to DIR/STEP.jsonl (DIR/STEP_nN.jsonl for --val_n N)",
    )
    logger: str = flag("console,jsonl", "comma list of console, jsonl, wandb, tensorboard")
    project_name: str = flag("grpo_gsm8k", "for wandb / tensorboard / folders")
    experiment_name: str = flag("qwen2.5_0.5b", "for wandb / tensorboard / folders")
    seed: int = flag(1, "model init and data order; sampling uses seed + group", ge=0)


def need(ok, msg):
    """Stop at start-up, naming the script and the flag, when `ok` is false."""
    if not ok:
        raise SystemExit(f"{os.path.basename(sys.argv[0])}: {msg}")


def check_args(args, world_size):
    """Fail at start-up on the shared flags, naming them, before anything heavy loads; then fill the
    derived defaults. A train script's check_args calls this, then checks its own flags."""
    for name in ("rollout_data_dir", "validation_data_dir"):
        path = getattr(args, name)
        need(
            not path or not os.path.exists(path) or os.path.isdir(path),
            f"--{name} {path} is a file, not a folder: give a folder for the .jsonl files, or "
            f"leave the flag out",
        )
    need(
        args.train_batch_size % world_size == 0,
        f"--train_batch_size {args.train_batch_size} must be divisible by the number of GPUs "
        f"{world_size}",
    )
    need(args.max_num_seqs >= 1, f"--max_num_seqs {args.max_num_seqs} must be at least 1")
    need(
        args.tensor_model_parallel_size >= 1 and world_size % args.tensor_model_parallel_size == 0,
        f"--tensor_model_parallel_size {args.tensor_model_parallel_size} must divide the number of "
        f"GPUs {world_size}",
    )
    longest = args.max_prompt_length + args.max_response_length
    budgets = ["ppo_max_token_len_per_gpu", "log_prob_max_token_len_per_gpu"]
    budgets += ["critic_ppo_max_token_len_per_gpu"] if hasattr(args, "critic_model") else []
    for name in budgets:
        need(
            not args.use_dynamic_bsz or (getattr(args, name) or longest) >= longest,
            f"--{name} {getattr(args, name)} must hold the longest sequence, --max_prompt_length + "
            f"--max_response_length = {longest}",
        )
    need(
        not args.compile_update or args.compile_layers is not False,
        "--compile_update compiles the update's decoder layers, which --compile_layers false "
        "leaves eager; drop one",
    )
    need(args.truncation in ("error", "left", "right"), "--truncation must be error, left or right")
    need(
        args.lr_scheduler_type in ("constant", "cosine"),
        "--lr_scheduler_type must be constant or cosine",
    )
    need(0 <= args.min_lr_ratio <= 1, f"--min_lr_ratio {args.min_lr_ratio} must be in [0, 1]")
    need(
        0 < args.lr_decay_steps_ratio <= 1,
        f"--lr_decay_steps_ratio {args.lr_decay_steps_ratio} must be in (0, 1]",
    )
    need(
        (args.min_lr_ratio == 0 and args.lr_decay_steps_ratio == 1)
        or args.lr_scheduler_type == "cosine",
        "--min_lr_ratio and --lr_decay_steps_ratio shape the cosine schedule: add "
        "--lr_scheduler_type cosine",
    )
    need(args.reward_errors in ("raise", "zero"), "--reward_errors must be raise or zero")
    need(args.rollout_engine in ("vllm", "hf"), "--rollout_engine must be vllm or hf")
    need(
        args.rollout_is in (None, "token", "sequence"),
        f"--rollout_is {args.rollout_is!r} must be token or sequence (or left out: no correction)",
    )
    need(
        args.rollout_is_threshold >= 1,
        f"--rollout_is_threshold {args.rollout_is_threshold} must be at least 1: "
        "below it the weights of tokens both engine and trainer agree on would be cut",
    )
    need(args.engines_per_gpu >= 1, f"--engines_per_gpu {args.engines_per_gpu} must be at least 1")
    need(
        args.engines_per_gpu == 1
        or (args.rollout_engine == "vllm" and args.tensor_model_parallel_size == 1),
        "--engines_per_gpu above 1 needs --rollout_engine vllm and --tensor_model_parallel_size 1",
    )
    need(
        args.resume_mode in ("auto", "disable") or os.path.isdir(args.resume_mode),
        f"--resume_mode must be auto, disable or an existing global_step_N folder, got "
        f"{args.resume_mode!r}",
    )
    for kind in (k.strip() for k in args.logger.strip("[]").split(",") if k.strip()):
        need(
            kind in ("console", "jsonl", "wandb", "tensorboard"),
            f"--logger {kind!r}: choose from console, jsonl, wandb, tensorboard",
        )
        module = {"wandb": "wandb", "tensorboard": "tensorboard"}.get(kind)
        need(
            module is None or importlib.util.find_spec(module) is not None,
            f"--logger {kind} needs the {module} package: pip install {module}",
        )
    B, mini = args.train_batch_size, args.ppo_mini_batch_size
    need(mini <= B, f"--ppo_mini_batch_size {mini} must not exceed --train_batch_size {B}")
    need(
        mini * args.rollout_n % world_size == 0,
        f"--ppo_mini_batch_size x --rollout_n ({mini * args.rollout_n}) must be divisible by the "
        f"number of GPUs {world_size}",
    )
    check_batch_args(args, world_size)
    check_ranges(args)  # after the checks above, whose messages say more where they apply
    # param_offload already steps the optimizer on the CPU
    args.optimizer_offload &= not args.param_offload
    args.default_local_dir = args.default_local_dir or os.path.join(
        "checkpoints", args.project_name, args.experiment_name
    )


def check_batch_args(args, world_size):
    """The flags of a step's batch (batches.py): dynamic sampling, the skip, off-policy rollouts."""
    G = args.gen_batch_size
    need(
        not args.filter_groups or args.rollout_n > 1,
        "--filter_groups needs --rollout_n > 1: it drops groups whose responses all scored alike",
    )
    need(
        G in (0, args.train_batch_size) or args.filter_groups,
        "--gen_batch_size only applies with --filter_groups: without it a step trains on every "
        "prompt it generates",
    )
    need(
        args.filter_groups_from_step == 1 or args.filter_groups,
        "--filter_groups_from_step only applies with --filter_groups",
    )
    need(
        args.filter_groups_from_step >= 1,
        f"--filter_groups_from_step {args.filter_groups_from_step} must be >= 1",
    )
    need(
        not args.skip_all_equal or args.filter_groups,
        "--skip_all_equal only applies with --filter_groups: it skips the prompts the filter would "
        "drop",
    )
    need(
        0 < args.skip_explore_prob <= 1,
        f"--skip_explore_prob {args.skip_explore_prob} must be in (0, 1]: at 0 a prompt once "
        "all-equal would never be generated again",
    )
    need(
        G >= 0 and G % world_size == 0,
        f"--gen_batch_size {G} must be 0 or a multiple of the number of GPUs {world_size}",
    )
    need(
        not args.one_step_off_policy or args.tensor_model_parallel_size == 1,
        "--one_step_off_policy needs --tensor_model_parallel_size 1: the engine's tensor-parallel "
        "collectives would run beside the trainer's in another thread, in no fixed order between "
        "ranks",
    )


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


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


PHASES = []  # the main thread's phases in progress, outermost first: what a stuck run is doing


class Timer:
    """`with timer("gen"):` adds the seconds spent inside to metrics["timing_s/gen"] (nestable), and
    on a GPU the phase's peak memory to metrics["perf/max_memory_allocated_gb/gen"] (innermost
    phases only).

    torch counts a sleeping engine's pool as allocated though the engine has released its memory, so
    a phase that starts and ends with the engine asleep subtracts it: the peak is what the GPU
    held."""

    # --warm_compile_caches' eager first step: each phase starts with the memory torch's allocator
    # caches given back, so that one phase's large blocks are not split by the next one's tensors
    release_cache = False

    def __init__(self, metrics, device, engine=None):
        self.metrics, self.device, self.engine = metrics, device, engine
        self.inner_done = False  # a phase nested in the current one has recorded its peak

    @contextlib.contextmanager
    def __call__(self, name):
        sync(self.device)
        cuda = self.device.type == "cuda"
        if cuda and Timer.release_cache:
            torch.cuda.empty_cache()
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        unbacked = self.engine.unbacked_bytes() if self.engine is not None else 0
        self.inner_done = False
        main = threading.current_thread() is threading.main_thread()
        PHASES.append(name) if main else None
        t0 = time.perf_counter()
        try:
            yield
        finally:
            PHASES.pop() if main else None
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

    def __init__(self, args, out_dir, flags=None):
        """`flags`: the run's flags for wandb's config (`Run.flags`; default: asdict(args))."""
        self.kinds = {k.strip() for k in args.logger.strip("[]").split(",") if k.strip()}
        self.on = sharding.rank() == 0
        self.path, self.wandb, self.tb = os.path.join(out_dir, "metrics.jsonl"), None, None
        if not self.on:
            return
        os.makedirs(out_dir, exist_ok=True)
        if "wandb" in self.kinds:
            import wandb

            self.wandb = wandb.init(  # its files (an offline run's too) beside metrics.jsonl
                project=args.project_name,
                name=args.experiment_name,
                config=flags or asdict(args),
                dir=out_dir,
            )
        if "tensorboard" in self.kinds:
            from torch.utils.tensorboard import SummaryWriter

            self.tb = SummaryWriter(os.path.join(out_dir, "tensorboard"))

    def resume(self, step, last_row=None):
        """metrics.jsonl as the run goes on from `step` (rank 0; `repair_metrics`)."""
        if self.on and "jsonl" in self.kinds:
            repair_metrics(self.path, step, last_row)

    def log(self, metrics, step):
        if not self.on:
            return
        if "console" in self.kinds:
            tqdm.write(
                f"step:{step} - "
                + " - ".join(
                    f"{k}:{v:.4g}" if isinstance(v, float) else f"{k}:{v}"
                    for k, v in sorted(metrics.items())
                )
            )
        if "jsonl" in self.kinds:
            with open(self.path, "a") as f:
                f.write(json.dumps({"step": step, **metrics}) + "\n")
        if self.wandb:
            self.wandb.log(metrics, step=step)
        if self.tb:
            for k, v in metrics.items():
                self.tb.add_scalar(k, v, step)

    def close(self):
        """Finish the wandb run and write tensorboard's pending events: a finished run ends without
        the interpreter's exit hooks (the end of this file)."""
        if self.wandb:
            self.wandb.finish()
        if self.tb:
            self.tb.close()


def repair_metrics(path, step, last_row=None):
    """Make metrics.jsonl hold one row per step up to `step`, where a run goes on from (0: afresh).

    Afresh, an earlier run's file is kept as metrics.jsonl.N (the first free N), not erased.
    Resumed, the rows after `step` go (the run trains those steps again), so does a torn last row (a
    crash in the middle of writing it), and `last_row`, the row the checkpoint of `step` kept, is
    written again when the crash came between the checkpoint and its row. A row that cannot be read
    elsewhere in the file stops the run, naming the file and the line."""
    if not os.path.exists(path):
        rows = []
    elif step == 0:
        if os.path.getsize(path):
            n = next(i for i in range(1, 10**6) if not os.path.exists(f"{path}.{i}"))
            os.replace(path, f"{path}.{n}")
            print(f"{path} held an earlier run's metrics: kept as {path}.{n}", flush=True)
        return
    else:
        with open(path) as f:
            lines = f.read().splitlines()
        rows = []
        for i, line in enumerate(lines, 1):
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as e:
                if i < len(lines):
                    need(
                        False, f"{path} line {i} is not a JSON row ({e}): mend or delete that line"
                    )
                print(f"{path}: dropped its torn last line {i} (a crash while it was written)")
        rows = [row for row in rows if row["step"] <= step]
    if last_row is not None and not any(row["step"] == step for row in rows):
        rows.append(last_row)
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path + ".tmp", "w") as f:
        f.writelines(json.dumps(row) + "\n" for row in rows)
    os.replace(path + ".tmp", path)


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
    for phase, name, passes in (
        ("old_log_prob", "old_log_prob", 1),
        ("ref", "ref", 1),
        ("update_actor", "actor", 3 * epochs),
    ):
        if f"timing_s/{phase}" in t:
            rate = passes * forward / t[f"timing_s/{phase}"]
            out |= {f"perf/tflops/{name}": rate / 1e12, f"perf/mfu/{name}": rate / peak_flops}
    if "timing_s/update_weights" in t:
        out["perf/weight_sync_gb_s"] = push_bytes / t["timing_s/update_weights"] / 1e9
    return out


def cache_hits():
    """How many of the graphs compiled so far were loaded from torch's compile caches on disk (by
    AOTAutograd's cache, which holds a graph's forward and backward), as "N of M graphs"."""
    from torch._dynamo.utils import counters

    c = counters["aot_autograd"]
    hits = c["autograd_cache_hit"]
    return f"{hits} of {hits + c['autograd_cache_miss'] + c['autograd_cache_bypass']} graphs"


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
    a, b = (
        torch.randn(n, n, device=device, dtype=dtype),
        torch.randn(n, n, device=device, dtype=dtype),
    )
    for _ in range(3):
        a @ b
    sync(device)
    t, iters = time.perf_counter(), 20
    for _ in range(iters):
        a @ b
    sync(device)
    return 2 * n**3 * iters / (time.perf_counter() - t)


# --- a run: start-up, resume, the engine, the end of each step, the end ---------------------------


class Run:
    """What a run holds beside the script's models: the process group and device, the reward
    function, tokenizer and data, the number of steps, the engine, the logger, the SIGTERM watch and
    the progress bar. `start` makes one; the script calls its methods in the order of the module's
    docstring."""

    def __init__(self, args, rank, world, device, reward_fn, tokenizer, train, val, total_steps):
        self.args, self.rank, self.world, self.device = args, rank, world, device
        self.reward_fn, self.tokenizer, self.train, self.val, self.total_steps = (
            reward_fn,
            tokenizer,
            train,
            val,
            total_steps,
        )
        self.step, self.models, self.optimizers, self.schedulers = 0, {}, {}, {}
        self.state, self.last_row = {}, None
        self.plan = None  # the memory plan (memory.plan) on a GPU
        self.engine, self.logger, self.stop, self.bar, self.stopping = None, None, None, None, False
        self.warming, self.warm = None, False  # --warm_compile_caches' helper, and whether it runs
        self.eager_step, self.compile_passes = False, None  # see `make_engine`

    def warm_compile_caches(self, update_actor, update_critic=None):
        """--warm_compile_caches: start the helper process (sharding.warm_compile_caches), one per
        machine, with the in-process engine (a pool's engines start beside the trainer, which
        compiles meanwhile: `make_engine`). `update_actor` and `update_critic` are the train
        script's own. The first step runs eager while the helper compiles (`make_engine`)."""
        args, device = self.args, self.device
        if not warm_compile_caches(args, device) or args.val_only:
            return
        need(
            args.engines_per_gpu == 1,
            "--warm_compile_caches is for the in-process engine: with --engines_per_gpu above 1 "
            "the passes compile while the engines start; drop it",
        )
        need(
            sharding.compiles(args, device),
            "--warm_compile_caches compiles the step's passes ahead, and none compiles here: add "
            "--compile_layers true or --use_torch_compile true, or drop it",
        )
        self.warm = True
        if int(os.environ["LOCAL_RANK"]) == 0:
            ctx = torch.multiprocessing.get_context("spawn")
            self.engine_started = ctx.Event()
            launched = time.time() - seconds_since_launch()
            self.warming = ctx.Process(
                target=sharding.warm_compile_caches,
                name="warm_compile_caches",
                args=(args, device, update_actor, update_critic, launched, self.engine_started),
            )
            self.warming.start()
            atexit.register(self.warming.kill)  # the run ended before it did

    def resume(self, models, optimizers, schedulers):
        """Load the checkpoint --resume_mode names (auto: the newest under --default_local_dir) into
        the models, optimizers and schedulers (dicts by role: "actor", "critic"), kept for the
        checkpoints to come. Returns its trainer state ({} when starting afresh), or None when that
        run has already finished its steps."""
        args = self.args
        self.models, self.optimizers, self.schedulers = models, optimizers, schedulers
        # --resume_mode auto: the newest checkpoint that can be read, saying which could not
        if args.resume_mode == "auto":
            steps = reversed(sharding.list_checkpoints(args.default_local_dir))
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
                state = sharding.load_checkpoint(resume, models, optimizers, schedulers)
                break
            except sharding.CheckpointError as e:
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
        offload = {"actor": args.optimizer_offload}
        offload["critic"] = getattr(args, "critic_optimizer_offload", False)
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
        if self.step >= self.total_steps and not args.val_only:
            if self.rank == 0:
                path = os.path.join(args.default_local_dir, "metrics.jsonl")
                repair_metrics(path, self.step, self.last_row)
            final = os.path.join(args.default_local_dir, "hf_model")
            if args.export_final and not os.path.isdir(final):  # a crash before it was written
                sharding.export_hf(final, models["actor"], self.tokenizer)
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
        ignored = {
            "resume_mode",
            "total_training_steps",
            "total_epochs",
        }  # how far to go, from where
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

    def make_engine(self, compile_passes):
        """The rollout engine (--rollout_engine, --engines_per_gpu), with dummy weights until
        `engine_ready`. `compile_passes(tokens)` compiles a step's passes on a made-up batch
        (sharding.compile_ahead with the script's models and updates): a pool's engines start in
        their own processes, so it runs meanwhile where the speed flags compile. With
        --warm_compile_caches the first step runs eager instead, at token budgets planned for
        eager passes, while the helper compiles; after it the trainer loads the helper's graphs
        (`after_eager_step`)."""
        args, device = self.args, self.device
        self.models_loaded = seconds_since_launch()
        engine = make_engine(
            args.rollout_engine,
            args.model,
            engines_per_gpu=args.engines_per_gpu,
            tensor_parallel_size=args.tensor_model_parallel_size,
            gpu_memory_utilization=args.gpu_memory_utilization,
            max_num_seqs=args.max_num_seqs,
            torch_compile=args.rollout_compile,
            seed=args.seed,
            max_model_len=args.max_prompt_length + args.max_response_length,
            dtype="bfloat16" if device.type == "cuda" else "float32",
            enforce_eager=device.type != "cuda",
            load_format="dummy",
        )
        self.compile_ahead = (
            not engine.in_process and not args.val_only and sharding.compiles(args, device)
        )
        if self.compile_ahead:  # compile_ahead's batch fills the largest token budget
            compile_passes(None)
        if self.warm:
            if self.warming is not None:  # the helper may end once it has compiled
                self.engine_started.set()
            self.eager_step, self.compile_passes = True, compile_passes
            self.eager_budgets()
            torch.compiler.set_stance("force_eager")  # every torch.compile'd function runs eager
            sharding.compile_logits_math(False)
        return engine

    def eager_budgets(self):
        """--warm_compile_caches' first step: the token budgets of a plan for eager passes (whose
        activations and logits take more memory than the compiled ones'), where the flags did not
        set them, kept until `after_eager_step` restores the compiled ones."""
        args = self.args
        names = budget_flags(args)
        self.compiled_budgets = {name: getattr(args, name) for name in names.values()}
        self.compiled_plan, self.compiled_fused = self.plan, args.use_fused_kernels
        actor = self.models.get("actor")
        if self.device.type == "cuda" and actor is not None and sharding.plain_output_layer(actor):
            # the eager update's output layer chunk by chunk (sharding.fused_log_probs): eager
            # (K, V) fp32 logits of unequal micro-batches split torch's cached segments until one
            # no longer fits (an H200 ran out of memory so at 36,864-token micro-batches)
            args.use_fused_kernels = True
        Timer.release_cache = self.device.type == "cuda"
        if self.plan is not None and args.use_dynamic_bsz:
            given = {k: getattr(args, v) for k, v in names.items() if v in given_flags()}
            # the helper may still be compiling on the first GPU: its models, batch and context
            gpu = self.plan.gpu - helper_bytes(args, AutoConfig.from_pretrained(args.model))
            eager = memory_plan(args, self.world, gpu, self.prompt_len, given, compiled=False)
            if eager.fits:
                for key, name in names.items():
                    setattr(args, name, min(getattr(args, name), eager.budgets[key]))
                self.plan = eager
        if self.rank == 0:
            budgets = " ".join(f"--{name} {getattr(args, name)}" for name in names.values())
            fused = " --use_fused_kernels true" if args.use_fused_kernels else ""
            print(
                f"the first step runs eager while the helper compiles, with {budgets}{fused}",
                flush=True,
            )

    def flags(self):
        """The run's flags as the command line made them, for checkpoints and loggers: during
        --warm_compile_caches' eager first step, without that step's own budgets and output layer
        (`eager_budgets`)."""
        flags = asdict(self.args)
        if self.eager_step:
            flags |= self.compiled_budgets | {"use_fused_kernels": self.compiled_fused}
        return flags

    def after_eager_step(self):
        """After --warm_compile_caches' eager first step: wait for the helper, then compile the
        step's passes on the helper's made-up batch, which loads its graphs from the compile
        caches, with the compiled passes' token budgets back."""
        args = self.args
        self.eager_step = False
        self.join_helper()
        torch.compiler.set_stance("default")
        sharding.compile_logits_math(sharding.gpu_default(args.use_torch_compile, self.device))
        for name, budget in self.compiled_budgets.items():
            setattr(args, name, budget)
        self.plan, args.use_fused_kernels = self.compiled_plan, self.compiled_fused
        Timer.release_cache = False
        started = seconds_since_launch()
        self.compile_passes(
            sharding.small_batch_tokens(args, AutoConfig.from_pretrained(args.model))
        )
        if self.rank == 0:
            print(
                f"compiled the passes in {seconds_since_launch() - started:.1f} s, "
                f"{cache_hits()} from the helper's compile caches",
                flush=True,
            )

    def join_helper(self):
        """Wait for this machine's --warm_compile_caches helper to end; every rank waits."""
        if self.warming is not None:
            waited = seconds_since_launch()
            self.warming.join()
            atexit.unregister(self.warming.kill)
            print(
                f"waited {seconds_since_launch() - waited:.1f} s for the compiling helper"
                if self.warming.exitcode == 0
                else f"the compiling helper process failed (exit code {self.warming.exitcode}, its "
                "error above): the passes compile here",
                flush=True,
            )
        if dist.is_initialized():
            dist.barrier()

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
                + (f"passes compiled ahead at {compiled:.1f} s, " if self.compile_ahead else "")
                + f"engine ready at {seconds_since_launch():.1f} s",
                flush=True,
            )
        self.engine = engine
        self.logger = Logger(args, args.default_local_dir, self.flags())
        self.logger.resume(self.step, self.last_row)
        if args.val_only:
            return
        if args.val_before_train and self.val is not None and self.step == 0:
            self.logger.log(self.validate(), self.step)
        self.peak_flops = measure_peak_flops(device) * self.world
        self.push_bytes = sum(p.numel() for p in actor.parameters()) * push_dtype.itemsize
        self.config = actor.config
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

    def validate(self, step=None, **kw):
        return validate(
            self.engine,
            self.val,
            self.args,
            self.tokenizer,
            self.reward_fn,
            self.step if step is None else step,
            **kw,
        )

    def validate_only(self):
        """--val_only: greedy mean@1 of the loaded policy and, with --val_n, sampled pass@k; logged
        as step N."""
        metrics = self.validate()
        if self.args.val_n > 1:
            metrics |= self.validate(n=self.args.val_n, temperature=self.args.val_temperature)
        self.logger.log(metrics, self.step)
        self.logger.close()
        return metrics

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
        memory = max([v for k, v in t.items() if k.startswith("perf/max_memory")], default=0.0)
        metrics |= batch_metrics(batch, old_log_probs, gen_seconds) | round_metrics(batch) | t
        metrics |= {
            "perf/throughput": tokens / t["timing_s/step"] / self.world,
            "perf/max_memory_allocated_gb": memory,
            "training/global_step": step,
            "training/epoch": batch.epoch,
            "timing_s/since_launch": seconds_since_launch(),
        }
        if self.plan is not None:  # the memory planner's prediction beside each measured peak
            metrics |= {
                f"perf/planned_memory_gb/{phase}": peak / 2**30
                for phase, (peak, _) in self.plan.phases.items()
            }
        perf = (self.config, tokens / n_seqs, tokens, responses, self.peak_flops, args.ppo_epochs)
        metrics |= phase_perf(t, *perf, self.push_bytes)
        if source.overlap:  # the generation's own time, beside the previous step's training
            metrics["timing_s/gen_background"] = batch.seconds
        last_step = step == self.total_steps
        stopping = not last_step and self.stop.agreed(device)  # checkpointed at once, not validated
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
            stopping = not last_step and self.stop.agreed(device)
        if args.save_freq > 0 and (step % args.save_freq == 0 or last_step or stopping):
            with Timer(metrics, device)("save_checkpoint"):
                sharding.save_checkpoint(
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
            stopping = stopping or (not last_step and self.stop.agreed(device))
        self.logger.log(metrics, step)
        self.bar.update(1)
        self.stopping = stopping
        if self.eager_step and not (stopping or last_step):
            self.after_eager_step()
        return stopping

    def finish(self, step, metrics, actor, source):
        """After the loop: the last batch in flight ended, then either the stop's message (a
        SIGTERM) or the final policy exported as a Hugging Face folder (--export_final); the logs
        closed."""
        args = self.args
        self.bar.close()
        source.close()
        self.stop.finished.set()
        if self.stopping:
            if self.rank == 0:
                how = (
                    f"checkpointed in {args.default_local_dir}; the same command with "
                    "--resume_mode auto continues from there"
                    if args.save_freq > 0
                    else f"not checkpointed (--save_freq {args.save_freq}: never)"
                )
                print(
                    f"stopped by SIGTERM after step {step} of {self.total_steps}, {how}", flush=True
                )
        elif args.export_final:
            path = sharding.export_hf(
                os.path.join(args.default_local_dir, "hf_model"), actor, self.tokenizer
            )
            if self.rank == 0:
                print(
                    f"done: {step} steps; metrics {self.logger.path}; checkpoints "
                    f"{args.default_local_dir}; final policy (Hugging Face format) {path}",
                    flush=True,
                )
        self.logger.close()
        return metrics


def check_paths(args):
    """Folders and models that cannot serve, named before anything loads."""
    here = os.path.abspath(args.default_local_dir)
    blocked = next((p for p in [here, *Path(here).parents] if os.path.isfile(p)), None)
    need(
        blocked is None,
        f"--default_local_dir {args.default_local_dir}: {blocked} is a file, not a folder; give a "
        "folder for the checkpoints and metrics",
    )
    model = os.path.expanduser(args.model)
    if os.path.isdir(model):  # a local folder, not a hub id
        files = set(os.listdir(model))
        need(
            "config.json" in files,
            f"--model {args.model} has no config.json: give a Hugging Face model folder "
            "(config.json, the weights, the tokenizer's files) or a hub id",
        )
        need(
            bool(files & {"tokenizer.json", "tokenizer_config.json", "tokenizer.model"}),
            f"--model {args.model} has no tokenizer files (tokenizer.json, tokenizer_config.json): "
            "save the tokenizer beside the model",
        )


def given_flags():
    """The flags named on the command line (a default left alone is not among them)."""
    return {a[2:].split("=")[0].replace("-", "_") for a in sys.argv[1:] if a.startswith("--")}


def plan_memory(args, world, device, prompt_len):
    """Fill the speed and memory flags left to their defaults: on a GPU (or for --gpu_memory_gib),
    micro-batches by the token budgets the memory planner picks, the update compiled, the engine's
    share of what the trainer leaves; on a CPU, the small fixed ones. Returns the plan (None on a
    CPU without --gpu_memory_gib). A flag given on the command line always wins, and a per-sequence
    micro-batch size given there keeps verl's meaning (no token budgets)."""
    gpu = device.type == "cuda"
    planning = gpu or args.print_plan or args.gpu_memory_gib is not None
    critic = hasattr(args, "critic_model")
    per_sequence = {"ppo_micro_batch_size_per_gpu", "log_prob_micro_batch_size_per_gpu"}
    per_sequence |= {"critic_ppo_micro_batch_size_per_gpu"} if critic else set()
    if args.use_dynamic_bsz is None:
        args.use_dynamic_bsz = planning and not (per_sequence & given_flags())
    if args.compile_update is None:
        args.compile_update = planning and args.use_dynamic_bsz and args.compile_layers is not False
    args.compile_update = bool(args.compile_update)
    memory_bytes = None
    if args.gpu_memory_gib:
        memory_bytes = int(args.gpu_memory_gib * 2**30)
    elif gpu:
        memory_bytes = torch.cuda.get_device_properties(device).total_memory
    names = budget_flags(args)
    plan = None
    if memory_bytes:
        given = {k: getattr(args, v) for k, v in names.items() if getattr(args, v)}
        plan = memory_plan(args, world, memory_bytes, prompt_len, given)
    if plan is not None:
        for key, name in names.items():
            setattr(args, name, getattr(args, name) or plan.budgets[key])
        if args.gpu_memory_utilization is None:
            args.gpu_memory_utilization = math.floor(plan.engine_share * 100) / 100
    for name in names.values():  # a CPU's, or the per-sequence micro-batches' unused ones
        setattr(args, name, getattr(args, name) or 16384)
    if args.gpu_memory_utilization is None:
        args.gpu_memory_utilization = 0.6
    return plan


def helper_bytes(args, config):
    """--warm_compile_caches' helper process on a GPU, at most: its one-layer models (fp32 weights
    and gradients, a bf16 copy gathered; the reference's without gradients), the logits of its
    made-up batch (`sharding.small_batch_tokens`) and their gradient in bf16, a quarter more for
    the rest, and 2 GiB for CUDA's context and the compiler (Qwen2.5-0.5B, GRPO's tutorial:
    15.7 GiB, its embeddings tied)."""
    shape = memory.Shape.of(config)
    params = shape.root_params + shape.layer_params
    models = params * 10 + (params * 6 if args.use_kl_loss or args.use_kl_in_reward else 0)
    if hasattr(args, "critic_model"):  # the critic's one layer and its embeddings
        models += (shape.layer_params + shape.vocab * shape.hidden) * 10
    tokens = sharding.small_batch_tokens(args, config)
    response = tokens * args.max_response_length / (8 + args.max_response_length)
    logits = response * shape.vocab * 2 * 2
    return int(1.25 * (models + logits)) + 2 * 2**30


def warm_compile_caches(args, device):
    """--warm_compile_caches as given, or (unset) on where it runs: on a GPU, with the in-process
    engine, where the step's passes compile."""
    if args.warm_compile_caches is not None:
        return args.warm_compile_caches
    return device.type == "cuda" and args.engines_per_gpu == 1 and sharding.compiles(args, device)


def budget_flags(args):
    """The token-budget flags of this script, by the memory plan's name for each."""
    names = {"update": "ppo_max_token_len_per_gpu", "log_prob": "log_prob_max_token_len_per_gpu"}
    return names | (
        {"critic": "critic_ppo_max_token_len_per_gpu"} if hasattr(args, "critic_model") else {}
    )


def memory_plan(args, world, memory_bytes, prompt_len, budgets, compiled=True):
    """memory.plan for this run's flags on a GPU of `memory_bytes`, the `budgets` given (the rest
    chosen); `compiled` False plans every pass eager (--warm_compile_caches' first step)."""
    critic = hasattr(args, "critic_model")
    return memory.plan(
        memory.Shape.of(AutoConfig.from_pretrained(args.model)),
        memory_bytes,
        world=world,
        prompt_len=prompt_len,
        response_len=args.max_response_length,
        batch_seqs=args.train_batch_size * args.rollout_n // world,
        mini_batch_seqs=args.ppo_mini_batch_size * args.rollout_n // world,
        critic=critic,
        reference=args.use_kl_loss or args.use_kl_in_reward,
        gradient_checkpointing=args.enable_gradient_checkpointing,
        critic_gradient_checkpointing=getattr(args, "critic_enable_gradient_checkpointing", 0),
        fused_kernels=args.use_fused_kernels,
        compiled_log_probs=compiled and args.use_torch_compile is not False,
        compile_update=compiled and args.compile_update,
        param_offload=args.param_offload,
        optimizer_offload=args.optimizer_offload,
        ref_param_offload=args.ref_param_offload,
        critic_param_offload=getattr(args, "critic_param_offload", False),
        critic_optimizer_offload=getattr(args, "critic_optimizer_offload", False),
        engine_share=args.gpu_memory_utilization,
        budgets=budgets,
    )


def plan_message(plan, args):
    """The plan's table and the flags it set, or what to change when it does not fit."""
    lines = [plan.table()]
    if plan.fits:
        chosen = [
            f"--{k} {getattr(args, k)}"
            for k in (
                "use_dynamic_bsz",
                "ppo_max_token_len_per_gpu",
                "log_prob_max_token_len_per_gpu",
                "critic_ppo_max_token_len_per_gpu",
                "compile_update",
                "gpu_memory_utilization",
            )
            if hasattr(args, k)
        ]
        lines.append("  with " + " ".join(chosen))
    else:
        lines.append("  to fit, try: " + "; ".join(memory.advice(args)))
    return "\n".join(lines)


def start(args, check_args):
    """Start a run: the process group, the flags checked (the script's `check_args`), the reward
    function, seeds, tokenizer, data and the number of steps. Refuses a fresh run (--resume_mode
    disable) in a folder that holds another run's checkpoints."""
    rank, world, device = init_distributed()
    check_args(args, world)
    if args.print_plan:  # the model's config only: no weights, no data
        plan = plan_memory(args, world, device, args.max_prompt_length)
        if plan is None:
            need(False, "--print_plan: no GPU is visible; say which with --gpu_memory_gib G")
        if rank == 0:
            print(plan_message(plan, args), flush=True)
        raise SystemExit(0)
    check_paths(args)
    lock = lock_folder(args.default_local_dir) if rank == 0 else None
    if args.resume_mode == "disable" and sharding.list_checkpoints(args.default_local_dir):
        # a fresh run there would interleave its checkpoints with the old ones (and prune its own)
        need(
            False,
            f"{args.default_local_dir} holds checkpoints of an earlier run; continue it with "
            "--resume_mode auto, or choose another --default_local_dir / --experiment_name, or "
            "delete them",
        )
    workers = max(args.reward_workers, 1 if args.reward_timeout else 0)
    reward_fn = reward.RewardFunction(
        args.custom_reward_function_path,
        args.custom_reward_function_name,
        workers,
        args.reward_timeout,
    )
    if sharding.gpu_default(args.use_torch_compile, device):
        sharding.compile_logits_math()
    # same init on every rank
    random.seed(args.seed)
    np.random.seed(args.seed)
    torch.manual_seed(args.seed)
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    data_kw = dict(
        tokenizer=tokenizer,
        max_prompt_length=args.max_prompt_length,
        filter_overlong_prompts=args.filter_overlong_prompts,
        truncation=args.truncation,
    )
    val = (
        load_rl_dataset(args.val_files.split(","), **data_kw)
        if args.test_freq > 0 or args.val_only
        else None
    )
    train = None if args.val_only else load_rl_dataset(args.train_files.split(","), **data_kw)
    G = args.gen_batch_size or args.train_batch_size  # prompts per generation round
    if train is not None and len(train) < max(args.train_batch_size, G):
        flag = "--gen_batch_size" if G > args.train_batch_size else "--train_batch_size"
        need(
            False,
            f"{args.train_files} holds {len(train)} usable prompts, fewer than {flag} "
            f"{max(args.train_batch_size, G)}",
        )
    # the memory plan, before any weights load: the prompts' mean length from the data
    prompts = train or val
    mean_prompt = np.mean([len(e.prompt_ids) for e in prompts.examples]) if prompts else 0
    prompt_len = int(mean_prompt) or args.max_prompt_length
    plan = plan_memory(args, world, device, prompt_len)
    if plan is not None:
        need(plan.fits, plan_message(plan, args))
        if rank == 0:
            print(plan_message(plan, args), flush=True)
    steps_per_epoch = len(train) // args.train_batch_size if train else 0
    total_steps = args.total_training_steps or steps_per_epoch * args.total_epochs
    run = Run(args, rank, world, device, reward_fn, tokenizer, train, val, total_steps)
    run.lock = lock  # held until the run ends
    run.plan, run.prompt_len = plan, prompt_len  # the eager first step plans again with them
    return run


# --- the end: a SIGTERM's deadline, a failed rank ends every rank ---------------------------------


class StopRequest:
    """SIGTERM, the notice a batch scheduler or `timeout` gives before it kills a job, noted instead
    of obeyed: the train loop asks `agreed` after each step's update, again after its validation and
    after its checkpoint, and when any rank was signalled all of them checkpoint that step and stop,
    so `--resume_mode auto` continues where the run stopped rather than from the last `--save_freq`
    checkpoint. A run still short of that stop `grace` seconds after the first SIGTERM (a phase
    stuck: a reward call that never returns, a rank waiting for one that hangs) ends at once,
    saying where it was (`where()`), before torchrun's kill 30 s after its own SIGTERM
    (`--shutdown-timeout` from torch 2.12) would end it without a word. Every later SIGTERM is
    noted the same way (`timeout` signals the workers and torchrun, which signals them again);
    Ctrl-C (SIGINT) still stops at once."""

    def __init__(self, grace=None, where=None):
        self.signalled, self.grace, self.where = False, grace, where
        self.finished = threading.Event()  # the run has stopped: the deadline stands down
        # where Python runs signal handlers
        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, self._note)

    def _note(self, signum, frame):
        if not self.signalled and self.grace is not None:
            threading.Thread(target=self._deadline, daemon=True, name="sigterm_deadline").start()
        self.signalled = True

    def _deadline(self):
        if self.finished.wait(self.grace):
            return
        where = self.where() if self.where else "a phase"
        why = (
            f"a SIGTERM came {self.grace:g} s ago (--stop_grace_s) and the run is still in {where}"
        )
        print(
            f"[rank {sharding.rank()}] {why}: ending now, without checkpointing this step; the "
            "same command with --resume_mode auto continues from the last checkpoint",
            file=sys.stderr,
            flush=True,
        )
        tell_peers(f"rank {sharding.rank()} ended: {why}")  # ranks waiting for this one end too
        reward.close_all()
        os._exit(128 + signal.SIGTERM)

    def agreed(self, device) -> bool:
        """Whether any rank has been signalled (a collective: every rank calls it at the same
        point)."""
        flag = torch.tensor([float(self.signalled)], device=device)
        if dist.is_initialized():
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())


FAILED = "run/failed"  # the key in the process group's store that the first failed rank writes
# how long a rank that ends for another's failure waits before it exits: torchrun names the failure
# it saw first, by the whole second, so the failed rank's comes first in its summary
AFTER_PEER_FAILURE_S = 2.0
_finished = threading.Event()  # this process's run ended: its peers' watch stands down


def watch_peers(interval=1.0):
    """End this process within `interval` + AFTER_PEER_FAILURE_S seconds of another rank's failure
    (`fail`). Without it the others wait for the failed rank in a collective that never completes:
    NCCL until its 10-minute timeout, gloo wherever its peers' sockets stay open."""
    store = dist.distributed_c10d._get_default_store()

    def watch():
        while not _finished.wait(interval):
            try:
                failed = store.check([FAILED])
            except Exception:  # the store's host has ended (the launcher or rank 0): so do we
                failed = not _finished.is_set()
            if failed and not _finished.is_set():
                try:
                    why = store.get(FAILED).decode()
                except Exception:
                    why = "the process group's store is gone: another process has ended"
                print(f"[rank {dist.get_rank()}] stopping: {why}", file=sys.stderr, flush=True)
                reward.close_all()
                time.sleep(AFTER_PEER_FAILURE_S)
                os._exit(1)

    threading.Thread(target=watch, daemon=True, name="watch_peers").start()


def tell_peers(message):
    """Write why this rank ends into the store, for the others' `watch_peers`; returns the message
    the store holds, another rank's when that one ended first (or None without a store)."""
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return None
    try:
        store = dist.distributed_c10d._get_default_store()
        return store.compare_set(FAILED, "", message[:4000]).decode()
    except Exception:
        return None


def fail(error):
    """This rank failed: show its error, tell the other ranks through the store (`watch_peers`),
    record it for torchrun's summary, end the process at once. Never a barrier: the other ranks may
    be waiting in another collective for this one. A rank that fails because another one did first
    (gloo's "Connection closed by peer") says so in a line and leaves torchrun's summary to that
    rank's error."""
    rank = dist.get_rank()
    why = str(error.code) if isinstance(error, SystemExit) else f"{type(error).__name__}: {error}"
    mine = f"rank {rank} failed: {why}"
    first = tell_peers(mine)
    if first is not None and first != mine[:4000]:
        print(f"[rank {rank}] stopping: {first}", file=sys.stderr, flush=True)
        time.sleep(AFTER_PEER_FAILURE_S)
    else:
        if isinstance(error, SystemExit):  # a refused flag or file (`need`): the message says it
            print(why, file=sys.stderr)
        else:
            text = "".join(traceback.format_exception(error))
            print(f"[rank {rank}] {text}", file=sys.stderr, end="")
        with contextlib.suppress(Exception):
            from torch.distributed.elastic.multiprocessing.errors import ErrorHandler

            ErrorHandler().record_exception(error)
    sys.stdout.flush()
    sys.stderr.flush()
    reward.close_all()
    os._exit(1)


def bare_switches(Args, argv=None):
    """The command line with `true` after a bare switch whose default is None (chosen at start-up:
    --use_dynamic_bsz, --compile_update, ...), so it reads as the plain switches do."""
    argv = list(sys.argv[1:] if argv is None else argv)
    tristate = {f"--{f.name}" for f in fields(Args) if f.type in (bool | None, "bool | None")}
    out = []
    for i, arg in enumerate(argv):
        out.append(arg)
        following = argv[i + 1] if i + 1 < len(argv) else "--"
        if arg in tristate and following.startswith("--"):
            out.append("true")
    return out


def launch(main, Args):
    """The command line: parse the flags into the script's Args, run `main`, end the process."""
    (parsed,) = HfArgumentParser(Args).parse_args_into_dataclasses(bare_switches(Args))
    try:
        main(parsed)
    except BaseException as error:
        if isinstance(error, SystemExit) and error.code in (0, None):  # --print_plan: done
            _finished.set()
        elif dist.is_initialized() and dist.get_world_size() > 1:
            fail(error)  # ends the process
        reward.close_all()
        raise
    _finished.set()
    reward.close_all()
    if dist.is_initialized():
        dist.barrier()
    # A finished run has written everything (metrics, checkpoints, the export) and closed its
    # loggers. It ends without the interpreter's teardown, which shuts vLLM's engine down and
    # collects what it held: 4-6 s per process on CPU, for nothing. An EnginePool's engines exit
    # when their pipes close.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
