"""The run's models: what a train script declares it holds (`Model`), and loading one as the trainer
holds it: a Hugging Face causal LM (a policy) or a value model on the same body, fp32 masters, its
decoder layers compiled where the speed flags say, sharded with FSDP2.

A script lists its models in a function `models(args)` (train_grpo.py: the actor and, for a KL
term, the reference; train_ppo.py adds the critic) and hands it to `run.start`. The support code
learns which models a run has from that list and from nothing else: the memory plan counts each
one, compiling ahead runs each one's passes, the trained ones are checkpointed. A fork that adds a
model adds an entry.
"""

import contextlib
import os
import warnings
from dataclasses import dataclass

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForTokenClassification

import flags
import ops
from sharding import apply_fsdp2, rank


@dataclass(frozen=True)
class Model:
    """One model of a run, as its train script declares it.

    `phase` names its pass without gradients in the step's timings and the memory plan
    (timing_s/old_log_prob, ref, values); a trained model's update is `update_<role>`. `passes` and
    `update` name the flags of their micro-batches: sequences per micro-batch, and the token budget
    that replaces it with --use_dynamic_bsz. A trained policy's pass without gradients also gives
    the entropy (verl's actor/entropy), and `entropy` says its update's loss has an entropy term, so
    that compiling ahead compiles the graphs the step runs. Its memory switches (`param_offload`,
    `optimizer_offload`, `gradient_checkpointing`) name the flags that set them, so that the
    memory planner can read them and turn them on where the run would not fit otherwise (`on`
    reads one)."""

    role: str  # "actor", "ref", "critic": its name in checkpoints, the plan and the logs
    path: str  # a hub id or a local folder
    phase: str
    value: bool = False  # a value model (a score per token on the policy's body), not a causal LM
    trained: bool = True  # gradients and an optimizer, checkpointed
    param_offload: str | None = None  # each: the flag's name, or None where it has none
    optimizer_offload: str | None = None
    gradient_checkpointing: str | None = None
    entropy: bool = False
    passes: tuple = ("log_prob_micro_batch_size_per_gpu", "log_prob_max_token_len_per_gpu")
    update: tuple = ("ppo_micro_batch_size_per_gpu", "ppo_max_token_len_per_gpu")

    def on(self, args, switch):
        """Whether its memory `switch` ("param_offload", ...) is on in `args`."""
        name = getattr(self, switch)
        return bool(name and getattr(args, name))

    @property
    def update_phase(self):
        return f"update_{self.role}"

    def budget_flags(self):
        """The token-budget flags of its passes: the update's where it is trained, and the pass
        without gradients'."""
        return ([self.update[1]] if self.trained else []) + [self.passes[1]]

    def micro_batch_flags(self):
        return ([self.update[0]] if self.trained else []) + [self.passes[0]]


def reachable(url, timeout=5.0):
    """Whether `url`'s host answers on its port within `timeout` seconds (the name looked up and
    a connection made in a thread, which a stalled lookup cannot hold longer)."""
    import socket
    import threading
    from urllib.parse import urlparse

    where = urlparse(url)
    port = where.port or (443 if where.scheme == "https" else 80)
    answered = []

    def connect():
        with contextlib.suppress(OSError):
            socket.create_connection((where.hostname, port), timeout=timeout).close()
            answered.append(True)

    thread = threading.Thread(target=connect, daemon=True)
    thread.start()
    thread.join(timeout)
    return bool(answered)


def flag_of(args, path):
    """The flag that names the model at `path` (--model, --critic_model, ...)."""
    if path == args.model:
        return "--model"
    named = (f"--{k}" for k, v in vars(args).items() if k.endswith("model") and v == path)
    return next(named, "the model")


checked = set()  # the models check_source passed, once per process (config_of asks again)


def check_source(path, flag="--model"):
    """A model named as on the hub that cannot be had, named within seconds with the ways out,
    instead of the hub's retries (about a minute) and a traceback: not in the hub's cache with
    HF_HUB_OFFLINE=1, or not in it and the hub unreachable. Cached and the hub unreachable: the
    cached copy, offline. A local folder passes (check_paths looks inside it); a path that is no
    folder (and no hub id) is named as such."""
    if path in checked:
        return
    check_source_once(path, flag)
    checked.add(path)


def check_source_once(path, flag):
    import huggingface_hub
    from huggingface_hub import constants
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    if os.path.isdir(os.path.expanduser(path)):
        return
    try:
        pathlike = path.startswith(("/", ".", "~")) or validate_repo_id(path)
    except HFValidationError:
        pathlike = True
    flags.need(
        not pathlike,
        f"{flag} {path}: no such folder; give a model's folder (config.json, the weights, the "
        "tokenizer's files) or a hub id such as Qwen/Qwen2.5-0.5B-Instruct",
    )
    cached = huggingface_hub.try_to_load_from_cache(path, "config.json")
    ways = (
        f"give a local folder ({flag} /path/to/model), or download it where there is a network "
        f"(hf download {path}), copy the hub's cache ({constants.HF_HUB_CACHE}) here "
        "and set HF_HUB_OFFLINE=1"
    )
    if constants.HF_HUB_OFFLINE:
        flags.need(
            isinstance(cached, str),
            f"{flag} {path} is not a local folder and not in the hub's cache, and HF_HUB_OFFLINE=1 "
            f"keeps the hub out: {ways}",
        )
        return
    if reachable(constants.ENDPOINT):
        if not isinstance(cached, str):  # the hub answers: does it have the model for us?
            try:
                huggingface_hub.hf_hub_download(path, "config.json", etag_timeout=10)
            except Exception as error:  # not found, private, gated, or the hub failing
                flags.need(
                    False,
                    f"{flag} {path}: the hub ({constants.ENDPOINT}) did not give its config.json "
                    f"({first_line(error)}). Check the name; for a private or gated "
                    "model, accept its terms on the hub and log in (hf auth login, or "
                    f"HF_TOKEN=...); or {ways}",
                )
        return
    flags.need(
        isinstance(cached, str),
        f"{flag} {path}: the hub ({constants.ENDPOINT}) cannot be reached and no copy is cached: "
        f"{ways}",
    )
    print(f"the hub ({constants.ENDPOINT}) cannot be reached: {path} from its cache", flush=True)
    os.environ["HF_HUB_OFFLINE"] = "1"  # this process's loaders, and the processes it starts
    constants.HF_HUB_OFFLINE = True


def attention(args):
    """Variable-length attention for packed sequences, transformers' sdpa for padded ones."""
    return ops.PACKED_ATTENTION if args.use_remove_padding else "sdpa"


def few_layers(config, layers):
    """`config` cut to its first `layers` decoder layers (the compiling helper's copies)."""
    config.num_hidden_layers = layers
    if getattr(config, "layer_types", None):
        config.layer_types = config.layer_types[:layers]
    return config


def first_line(error):
    """`error` as `Type: the first line of its message`, for a message of one line."""
    text = str(error).strip()
    return f"{type(error).__name__}: {text.splitlines()[0] if text else ''}"


@contextlib.contextmanager
def quiet_transformers():
    """transformers' warnings held back: its load report of a value model's head, which it
    initialises afresh ("MISSING ... Consider training on your downstream task"), `load` says in
    a line of its own."""
    from transformers.utils import logging as hf_logging

    level = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        yield
    finally:
        hf_logging.set_verbosity(level)


def load(spec, device, args, trainable=None, layers=None):
    """`spec`'s model with fp32 masters, sharded with FSDP2 (bf16 compute on a GPU); `trainable`
    (default: `spec.trained`) false loads it frozen. A policy is a causal LM; a value model is
    AutoModelForTokenClassification with one label on the same body, as verl builds its critic (the
    body under `.model`, a new linear `.score` head), its dropout off (transformers' default for the
    head is 0.1; verl sets 0 too), so values are deterministic. `layers`: instead, a randomly
    initialised copy with that many decoder layers."""
    trainable = spec.trained if trainable is None else trainable
    kw = dict(dtype=torch.float32, attn_implementation=attention(args))
    try:
        if spec.value:
            config = AutoConfig.from_pretrained(spec.path, num_labels=1)
            # an attribute: from_pretrained drops a keyword its config class lacks
            config.classifier_dropout = 0.0
            cls = AutoModelForTokenClassification
            # FSDP2 warns that its output is a view, which an in-place op would cut off from the
            # backward's gathers: the value pass reads it out of place (passes.forward_values)
            warnings.filterwarnings(
                "ignore", r"FSDP2-wrapped module \(FSDP\w+ForTokenClassification\) returned a view"
            )
        else:
            config, cls = AutoConfig.from_pretrained(spec.path), AutoModelForCausalLM
        if layers is None:  # a value model's new head: transformers' report of it, in a line
            with quiet_transformers() if spec.value else contextlib.nullcontext():
                model, info = cls.from_pretrained(
                    spec.path, config=config, output_loading_info=True, **kw
                )
            new = sorted(info["missing_keys"])
            if spec.value and new and rank() == 0:
                print(
                    f"the {spec.role}: {spec.path} with {', '.join(new)} initialised afresh (a "
                    "value head on the model's body; a resumed run's checkpoint holds its own)",
                    flush=True,
                )
        else:
            model = cls.from_config(few_layers(config, layers), **kw)
    except torch.OutOfMemoryError:
        raise
    except Exception as error:  # a damaged or missing file: the library's message names neither
        flag = " (--model)" if spec.path == args.model else ""
        flags.need(
            False,
            f"the {spec.role} model {spec.path}{flag} cannot be loaded: {first_line(error)}. "
            "Its files may be damaged or incomplete: download or export it again, or give "
            "another folder",
        )
    offload = spec.on(args, "param_offload")
    if device.type == "cuda" and not offload:
        model.to(device)
    if args.use_remove_padding:
        ops.probe_flash_varlen(device)
    if ops.gpu_default(args.compile_layers, device):
        ops.compile_layers(model, with_grad=trainable and args.compile_update)
    apply_fsdp2(
        model,
        param_dtype=torch.bfloat16 if device.type == "cuda" else torch.float32,
        gradient_checkpointing=trainable and spec.on(args, "gradient_checkpointing"),
        cpu_offload=offload,
    )
    if not trainable:
        # Frozen: it only runs under torch.no_grad (`passes.batched`) and no optimizer holds it. Its
        # parameters keep requires_grad=True, as the actor's: compiled layers guard on that flag,
        # and flipping it would compile every layer again for this model (14 s of the first step on
        # an H200).
        model.eval()
    return model
