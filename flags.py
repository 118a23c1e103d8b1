"""The flags every train script shares, their sections in --help, and their checks.

A train script declares `Args(RunArgs)` with its algorithm's flags (each a `flag`: default, help,
range); `cli.parse(Args)` reads the command line into it, and `check_args` holds the shared flags
to their ranges and to each other at start-up, naming the flag and what to do.
"""

import importlib.util
import math
import operator
import os
import sys
from dataclasses import dataclass, field, fields
from pathlib import Path

import memory
import shapes


def flag(default, help, *, gt=None, ge=None, lt=None, le=None, also=(), doc=None):
    """A field of an Args dataclass: the flag's default, its --help text (a line or two; `doc`, a
    longer text with the measurements behind it, goes to docs/flags.md instead) and, for a number,
    the range `check_ranges` holds it to at start-up (gt, ge, lt, le), with `also` the values
    outside it that mean something (-1: never, off, all). A number with no bounds must still be
    finite."""
    f = field(default=default, metadata={"help": help})  # the parser takes metadata as its kwargs
    bounds = {k: v for k, v in (("gt", gt), ("ge", ge), ("lt", lt), ("le", le)) if v is not None}
    RANGES[f] = bounds, tuple(also)
    DOCS[f] = doc or help
    return f


def default(name, value):
    """RunArgs' flag `name` with another default, for a script's Args to re-declare (its help,
    range and docs kept, not copied)."""
    f = RunArgs.__dataclass_fields__[name]
    bounds, also = RANGES[f]
    return flag(value, f.metadata["help"], **bounds, also=also, doc=DOCS[f])


RANGES = {}  # each flag's (bounds, values also allowed), by its dataclass field
DOCS = {}  # each flag's text in docs/flags.md, by its dataclass field


BOUNDS = {"gt": (operator.gt, ">"), "ge": (operator.ge, ">="), "lt": (operator.lt, "<"),
          "le": (operator.le, "<=")}  # fmt: skip


def check_ranges(args, names=None):
    """Every numeric flag (or those `names`) within its range (`flag`'s bounds), naming the flag
    and the range."""
    for f in fields(args):
        if names is not None and f.name not in names:
            continue
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
    and may re-declare a field here to change its default (its reference run's). A comment right
    above a field names the section of --help that starts there (`cli.sections`)."""

    # model and data
    model: str = flag("Qwen/Qwen2.5-0.5B-Instruct", "hub id or local folder")
    train_files: str = flag("~/data/gsm8k/train.parquet", "parquet, comma-separated")
    val_files: str = flag("~/data/gsm8k/test.parquet", "parquet, comma-separated")
    train_batch_size: int = flag(256, "prompts per step (all ranks)", ge=1)
    max_prompt_length: int = flag(512, "tokens, after the chat template", ge=1)
    max_response_length: int = flag(1024, "tokens generated at most", ge=1)
    filter_overlong_prompts: bool = flag(False, "drop prompts over max_prompt_length")
    truncation: str = flag("error", "overlong prompts when not filtered: error|left|right")
    # generation: the engine and its sampling
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
        "vLLM engines per GPU, each in a process of its own with a share of the sequences",
        doc=(
            "vLLM engines per GPU, each in a process of its own decoding a share of the "
            "sequences: a small model's generation is bound by vLLM's host work, which K "
            "processes share (docs/benchmarks.md)"
        ),
        ge=1,
    )
    rollout_compile: bool = flag(
        False,
        "torch.compile vLLM's model (vLLM's default); off: CUDA graphs only, ready sooner",
        doc=(
            "run vLLM's model through torch.compile (vLLM's default); off: CUDA graphs of vLLM's "
            "uncompiled forward for every decoding batch, which on an H200 was ready 31 s sooner "
            "and generated faster (docs/benchmarks.md)"
        ),
    )
    # samples and mini-batches (a script re-declares rollout_n for its reference run)
    rollout_n: int = flag(5, "responses per prompt (GRPO's group size)", ge=1)
    ppo_mini_batch_size: int = flag(64, "prompts per optimizer step (x rollout_n inside)", ge=1)
    ppo_epochs: int = flag(1, "passes over each batch", ge=1)
    # micro-batches and the memory plan: each pass's size, by count or (--use_dynamic_bsz) by
    # token budget
    ppo_micro_batch_size_per_gpu: int = flag(4, "sequences per forward/backward", ge=1)
    log_prob_micro_batch_size_per_gpu: int = flag(8, "sequences per log-prob forward", ge=1)
    use_dynamic_bsz: bool | None = flag(
        None,
        "micro-batches by token budget; default: on a GPU, unless a *_micro_batch_size_per_gpu "
        "is given",
        doc=(
            "micro-batches by token budget (the *_max_token_len_per_gpu flags) instead of "
            "sequence count; default: on a GPU unless a *_micro_batch_size_per_gpu flag is given"
        ),
    )
    ppo_max_token_len_per_gpu: int | None = flag(
        None, "tokens per forward/backward; default: the memory planner's (16384 on a CPU)", ge=1
    )
    log_prob_max_token_len_per_gpu: int | None = flag(
        None, "tokens per log-prob forward; default: the memory planner's (16384 on a CPU)", ge=1
    )
    print_plan: bool = flag(
        False,
        "print the memory plan and exit: 0 when the run fits, 1 when it does not",
        doc="print the memory plan (each phase's predicted peak, where it goes, the budgets) and "
        "exit: 0 when the run fits, 1 when it does not",
    )
    gpu_memory_gib: float | None = flag(
        None,
        "plan for a GPU of this many GiB and, on a larger one, run as on it",
        gt=0,
        doc="plan for a GPU of this many GiB and, on a larger one, run as on it (torch's "
        "allocations and the engine's share capped to it); what other processes hold on the GPU "
        "counts against it, the compiling helper's and any other user's alike",
    )
    n_gpus_per_node: int | None = flag(
        None,
        "GPUs per machine (default: the launched processes); --print_plan plans for them",
        ge=1,
    )
    nnodes: int | None = flag(
        None, "machines (default: torchrun's); --print_plan plans for them", ge=1
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
        "cosine: decay over this last fraction of the steps (warmup-stable-decay)",
        gt=0,
        le=1,
        doc="cosine: decay over this last fraction of all steps and hold the rate before it "
        "(warmup-stable-decay); 1: decay from the end of warmup (verl's cosine)",
    )
    # the engine's sampling distribution against the trainer's
    rollout_is: str | None = flag(
        None,
        "token | sequence: truncated importance weights pi_old / pi_rollout on the loss",
        doc=(
            "token | sequence: weight each token's loss by pi_old / pi_rollout, the trainer's "
            "over the engine's probability of the sampled tokens, truncated at "
            "--rollout_is_threshold (truncated importance sampling, verl's "
            "algorithm.rollout_correction.rollout_is): corrects for the engine's numerics and, "
            "with GRPO's --one_step_off_policy, for the update between the weights that sampled "
            "and the trainer's. Asks the engine for the log-probs of every response. With --top_p "
            "or --top_k on, the engine's are of the truncated distribution, so the weights sit "
            "below 1"
        ),
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
        "generated",
        doc=(
            "filter_groups: the first step that filters; the steps before it train on one batch "
            "as generated (while the reward is still 0 almost everywhere, too few groups vary to "
            "fill a batch)"
        ),
        ge=1,
    )
    skip_all_equal: bool = flag(
        False,
        "filter_groups: GRESO's selective rollout, skipping a prompt whose latest group scored "
        "all-equal",
        doc=(
            "filter_groups: GRESO's selective rollout: on filtering steps, skip before generating "
            "a prompt whose latest group scored all-equal (the filter would likely drop its group "
            "again)"
        ),
    )
    skip_explore_prob: float = flag(
        0.5,
        "skip_all_equal: a prompt all-equal z times in a row is generated with probability P**z",
        gt=0,
        le=1,
        doc="skip_all_equal: a prompt whose last z groups in a row scored all-equal is generated "
        "anyway with probability P**z",
    )
    one_step_off_policy: bool = flag(
        False,
        "generate the next step's batch while this one trains; give the engine less memory",
        doc=(
            "generate the next step's batch in a second thread while this step trains, with the "
            "weights from before this step's update (one-step off-policy, as verl's recipe of "
            "that name). The engine stays awake: give it less memory (--gpu_memory_utilization "
            "0.3 on an H200). Measured on one H200 with a 0.5B model: steps 7-13% shorter (the "
            "two share the GPU and the Python interpreter, so each ran slower), and in one "
            "learning run lower accuracy by step and by minute (docs/benchmarks.md)"
        ),
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
        "torch.compile the log-prob math over the vocabulary (default: on GPU)",
        doc="torch.compile the log-prob and entropy math over the vocabulary, in every pass, its "
        "gradient written by hand (default: on GPU)",
    )
    compile_layers: bool | None = flag(
        None, "torch.compile each decoder layer, in the passes without gradients (default: on GPU)"
    )
    use_fused_kernels: bool = flag(
        False,
        "every pass's log-probs and entropy from the output layer chunk by chunk, never the "
        "whole logits: less memory",
        doc=(
            "every pass's log-probs and entropy (the old and reference passes and the update) from "
            "the output layer chunk by chunk, never the whole (tokens, vocabulary) logits: less "
            "memory for one more matmul of the output layer in the update (verl's flag)"
        ),
    )
    compile_update: bool | None = flag(
        None,
        "compile the decoder layers in the updates too; default: on a GPU with token budgets",
        doc=(
            "compile the decoder layers in the updates (the actor's, and PPO's critic's; forward "
            "and backward) too, where --compile_layers compiles (--use_torch_compile already "
            "covers the actor's log-prob math): pays off with large micro-batches "
            "(--ppo_max_token_len_per_gpu 49152 on an H200), costs compiling in step 1 (about 30 "
            "s for GRPO's actor on a fresh H200, docs/benchmarks.md); default: on with token "
            "budgets on a GPU"
        ),
    )
    warm_compile_caches: bool | None = flag(
        None,
        "a helper process compiles the passes while step 1 runs eager; default: on a GPU",
        doc=(
            "with the in-process engine: a helper process compiles the step's passes on one-layer "
            "copies of the models while the models load, the engine starts and the first step "
            "runs eager (at token budgets planned for eager passes); the trainer then loads them "
            "from torch's compile caches (docs/performance.md); default: on a GPU with the "
            "in-process engine where the passes compile"
        ),
    )
    # rewards
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
        "seconds a reward call may take before it is a reward error (in worker processes)",
        gt=0,
        doc="seconds a reward call may take before it fails as a reward error; calls then run "
        "in worker processes (at least one, --reward_workers)",
    )
    # steps, validation, checkpoints, stopping and logging
    total_epochs: int = flag(15, "passes over the training prompts", ge=1)
    total_training_steps: int | None = flag(None, "overrides total_epochs", ge=1)
    save_freq: int = flag(
        -1,
        "checkpoint every N steps and the last (-1: none of them); a SIGTERM's stop is always "
        "checkpointed",
        ge=1,
        also=(-1,),
    )
    test_freq: int = flag(10, "validate every N steps (-1: never)", ge=1, also=(-1,))
    val_before_train: bool = flag(
        False,
        "validate before the first step",
        doc="validate before the first step (verl's default is True; its GSM8K tutorials, PPO and "
        "GRPO, pass False, and so do we)",
    )
    val_only: bool = flag(
        False, "only evaluate --model (or the checkpoint) and exit; the scores go to val_only.jsonl"
    )
    stop_grace_s: float = flag(
        25.0,
        "seconds after a SIGTERM for the step in progress to reach its checkpoint",
        doc=(
            "after a SIGTERM, the seconds the step in progress has to reach its checkpoint; past "
            "them the run ends at once, naming the phase it is in (torchrun and Slurm kill 30 s "
            "after their SIGTERM)"
        ),
        gt=0,
    )
    val_n: int = flag(
        1, "above 1: each validation also samples this many per prompt, for pass@k", ge=1
    )
    val_temperature: float = flag(1.0, "temperature of --val_n's samples", ge=0)
    max_val_samples: int | None = flag(None, "validate on the first N prompts", ge=1)
    resume_mode: str = flag("auto", "auto | disable | a global_step_N folder")
    default_local_dir: str | None = flag(None, "default: checkpoints/PROJECT/EXPERIMENT")
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
    project_name: str = flag("grpo", "for wandb / tensorboard / folders")
    experiment_name: str | None = flag(
        None, "for wandb / tensorboard / folders; default: the model's and the data's names"
    )
    seed: int = flag(1, "model init and data order; sampling uses seed + group", ge=0)


class BadInput(ValueError):
    """Input the run cannot use (a data file or row, a reward function), named with what to do: the
    command line prints the message alone, as it does a flag's (`need`), without a traceback."""


def need(ok, msg):
    """Stop at start-up, naming the script and the flag, when `ok` is false."""
    if not ok:
        raise SystemExit(f"{os.path.basename(sys.argv[0])}: {msg}")


def folder_problem(folder):
    """Why `folder` cannot be made or written to (a file at it or above it, or a folder this user
    cannot write), or None."""
    here = Path(os.path.abspath(folder))
    existing = next(p for p in [here, *here.parents] if p.exists())
    if existing.is_file():
        return f"{existing} is a file, not a folder"
    if not os.access(existing, os.W_OK | os.X_OK):
        return f"{existing} cannot be written to"
    return None


def loggers(args):
    """--logger's kinds, in order: `console,jsonl` or verl's list, `[console,wandb]`."""
    return list(dict.fromkeys(k.strip() for k in args.logger.strip("[]").split(",") if k.strip()))


def check_args(args, world_size):
    """Fail at start-up on the shared flags, naming them, before anything heavy loads; then fill the
    derived defaults. A train script's check_args calls this, then checks its own flags."""
    for name in ("rollout_data_dir", "validation_data_dir"):
        path = getattr(args, name)
        problem = path and folder_problem(path)
        need(
            not problem,
            f"--{name} {path}: {problem}; give a folder for the .jsonl files, or leave the "
            "flag out",
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
        args.resume_mode in ("auto", "disable")
        or os.path.exists(os.path.join(args.resume_mode, "COMPLETE")),
        f"--resume_mode {args.resume_mode} is not a checkpoint: give auto, disable or a "
        "global_step_N folder a run wrote whole (with its COMPLETE marker)",
    )
    need(
        args.custom_reward_function_name == "compute_score" or args.custom_reward_function_path,
        f"--custom_reward_function_name {args.custom_reward_function_name} needs "
        "--custom_reward_function_path, the file that defines it",
    )
    for kind in loggers(args):
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
    check_ranges(args, ("train_batch_size", "ppo_mini_batch_size", "rollout_n"))  # compared next
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
    args.experiment_name = args.experiment_name or run_name(args.model, args.train_files)
    args.default_local_dir = args.default_local_dir or os.path.join(
        "checkpoints", args.project_name, args.experiment_name
    )


# folder names that say what a folder holds, not which one it is: a run's name skips them
GENERIC = {"model", "models", "hf_model", "huggingface", "actor", "policy", "final", "checkpoint",
           "weights", "data", "dataset", "datasets", "parquet"}  # fmt: skip


def run_name(model, train_files):
    """A run's default name, after its model and its data: `Qwen/Qwen2.5-0.5B-Instruct` on
    `~/data/gsm8k/train.parquet` -> qwen2.5-0.5b-instruct_gsm8k (a file's folder names the data
    set, as verl's preprocessing writes it; a file alone in a generic folder, its own name). A
    generic folder name (`GENERIC`: a run's hf_model, verl's actor/huggingface, a quick start's
    model and data) gives way to the folder above it, short of the home folder: /runs/a/hf_model on
    /work/mine/data/train.parquet -> a_mine."""

    def named(path):
        path = Path(os.path.abspath(os.path.expanduser(path)))
        which = path
        while which.name.lower() in GENERIC and which.parent not in (Path.home(), Path("/")):
            which = which.parent  # not up to the home folder or /: ~/data stays data
        return which.name if which.name.lower() not in GENERIC else path.name

    first = os.path.expanduser(train_files.split(",")[0])
    stem = Path(first).stem
    data = stem if stem not in ("train", "training") else named(os.path.dirname(first))
    hub_id = not os.path.exists(os.path.expanduser(model))
    model = os.path.basename(os.path.normpath(model)) if hub_id else named(model)
    return f"{model.lower()}_{data}".replace(" ", "_")


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


def check_paths(args):
    """Folders and models that cannot serve, named before anything loads."""
    problem = folder_problem(args.default_local_dir)
    need(
        problem is None,
        f"--default_local_dir {args.default_local_dir}: {problem}; give a folder for the "
        "checkpoints and metrics that this user can write",
    )
    read = [] if args.val_only else ["train_files"]
    read += ["val_files"] if args.test_freq > 0 or args.val_only else []
    for name in read:  # the training data first: the file a user typed, not a default beside it
        for path in getattr(args, name).split(","):
            make = (
                "make it with python data/gsm8k.py --local_save_dir DIR"
                if "gsm8k" in path
                else "give parquet in verl's format (data_source, prompt, reward_model), as "
                "examples/quickstart/data.py writes it"
            )
            need(os.path.isfile(os.path.expanduser(path)), f"--{name} {path}: no such file; {make}")
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
    config = shapes.config_of(args.model)
    positions = getattr(config, "max_position_embeddings", None)
    rope = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    stretched = rope.get("rope_type", "default") != "default"  # YaRN and the like reach further
    longest = args.max_prompt_length + args.max_response_length
    need(
        not positions or longest <= positions or stretched,
        f"--max_prompt_length + --max_response_length = {longest} tokens, more than --model "
        f"{args.model} holds ({positions} positions): lower them",
    )


def check_budgets(args, specs):
    """Every token budget of the run's passes holds the longest sequence."""
    longest = args.max_prompt_length + args.max_response_length
    for name in memory.budget_flags(specs):
        need(
            not args.use_dynamic_bsz or (getattr(args, name) or longest) >= longest,
            f"--{name} {getattr(args, name)} must hold the longest sequence, --max_prompt_length + "
            f"--max_response_length = {longest}",
        )
