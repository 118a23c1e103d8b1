"""The command line of a train script: --help in the sections of its flags, each default once; a
flag error in a line naming the closest flags; verl's dotted keys (`section.key=value`) read as the
flags they map to, through the table docs/flags.md is written from (`VERL`, with what a script's
Args adds: `verl_table`, `verl_settled`).
"""

import argparse
import difflib
import inspect
import os
import re
import sys
import textwrap
from dataclasses import fields

from transformers import HfArgumentParser

from flags import need

ARA = "actor_rollout_ref"
# each flag's key in verl's config, the shared flags' and the two train scripts' (docs/flags.md is
# written from it, and the command line takes the keys: `verl_flags`); None: ours, verl has none.
# A note after the key says how its value reads here (`NOTES`). A script's Args may add keys for
# flags of its own (a fork's) as `VERL`, and say what verl's keys it has no flag for mean to it as
# `VERL_SETTLED`.
VERL = {
    "model": f"{ARA}.model.path",
    "train_files": "data.train_files",
    "val_files": "data.val_files",
    "train_batch_size": "data.train_batch_size",
    "max_prompt_length": "data.max_prompt_length",
    "max_response_length": "data.max_response_length",
    "filter_overlong_prompts": "data.filter_overlong_prompts",
    "truncation": "data.truncation",
    "rollout_engine": f"{ARA}.rollout.name",
    "temperature": f"{ARA}.rollout.temperature",
    "top_p": f"{ARA}.rollout.top_p",
    "top_k": f"{ARA}.rollout.top_k",
    "tensor_model_parallel_size": f"{ARA}.rollout.tensor_model_parallel_size",
    "logprob_check_prompts": None,
    "gpu_memory_utilization": f"{ARA}.rollout.gpu_memory_utilization",
    "max_num_seqs": f"{ARA}.rollout.max_num_seqs",
    "engines_per_gpu": None,
    "rollout_compile": f"{ARA}.rollout.enforce_eager (inverted)",
    "rollout_n": f"{ARA}.rollout.n",
    "ppo_mini_batch_size": f"{ARA}.actor.ppo_mini_batch_size",
    "ppo_epochs": f"{ARA}.actor.ppo_epochs",
    "ppo_micro_batch_size_per_gpu": f"{ARA}.actor.ppo_micro_batch_size_per_gpu",
    "log_prob_micro_batch_size_per_gpu": f"{ARA}.rollout/ref.log_prob_micro_batch_size_per_gpu",
    "use_dynamic_bsz": f"{ARA}.actor.use_dynamic_bsz",
    "ppo_max_token_len_per_gpu": f"{ARA}.actor.ppo_max_token_len_per_gpu",
    "log_prob_max_token_len_per_gpu": f"{ARA}.rollout/ref.log_prob_max_token_len_per_gpu",
    "print_plan": None,
    "gpu_memory_gib": None,
    "n_gpus_per_node": "trainer.n_gpus_per_node",
    "nnodes": "trainer.nnodes",
    "lr_warmup_steps": f"{ARA}.actor.optim.lr_warmup_steps",
    "lr_warmup_steps_ratio": f"{ARA}.actor.optim.lr_warmup_steps_ratio",
    "lr_scheduler_type": f"{ARA}.actor.optim.warmup_style",
    "min_lr_ratio": f"{ARA}.actor.optim.min_lr_ratio",
    "lr_decay_steps_ratio": None,
    "rollout_is": "algorithm.rollout_correction.rollout_is",
    "rollout_is_threshold": "algorithm.rollout_correction.rollout_is_threshold",
    "filter_groups": "algorithm.filter_groups.enable",
    "max_num_gen_batches": "algorithm.filter_groups.max_num_gen_batches",
    "gen_batch_size": "data.gen_batch_size",
    "filter_groups_from_step": None,
    "skip_all_equal": None,
    "skip_explore_prob": None,
    "one_step_off_policy": "recipe/one_step_off_policy (on separate GPUs there)",
    "enable_gradient_checkpointing": f"{ARA}.model.enable_gradient_checkpointing",
    "param_offload": f"{ARA}.actor.fsdp_config.param_offload",
    "optimizer_offload": f"{ARA}.actor.fsdp_config.optimizer_offload",
    "ref_param_offload": f"{ARA}.ref.fsdp_config.param_offload",
    "use_remove_padding": f"{ARA}.model.use_remove_padding",
    "use_torch_compile": f"{ARA}.actor.use_torch_compile",
    "compile_layers": None,
    "use_fused_kernels": f"{ARA}.model.use_fused_kernels",
    "compile_update": None,
    "warm_compile_caches": None,
    "custom_reward_function_path": (
        "custom_reward_function.path / reward.custom_reward_function.path"
    ),
    "custom_reward_function_name": (
        "custom_reward_function.name / reward.custom_reward_function.name"
    ),
    "reward_errors": None,
    "reward_workers": None,
    "reward_timeout": None,
    "total_epochs": "trainer.total_epochs",
    "total_training_steps": "trainer.total_training_steps",
    "save_freq": "trainer.save_freq",
    "test_freq": "trainer.test_freq",
    "val_before_train": "trainer.val_before_train",
    "val_only": "trainer.val_only",
    "stop_grace_s": None,
    "val_n": f"{ARA}.rollout.val_kwargs.n",
    "val_temperature": f"{ARA}.rollout.val_kwargs.temperature",
    "max_val_samples": None,
    "resume_mode": "trainer.resume_mode",
    "default_local_dir": "trainer.default_local_dir",
    "keep_last_checkpoints": "trainer.max_actor_ckpt_to_keep",
    "export_final": None,
    "rollout_data_dir": "trainer.rollout_data_dir",
    "validation_data_dir": "trainer.validation_data_dir",
    "logger": "trainer.logger",
    "project_name": "trainer.project_name",
    "experiment_name": "trainer.experiment_name",
    "seed": "data.seed / actor_rollout_ref.rollout.seed",
    "actor_lr": f"{ARA}.actor.optim.lr",
    "weight_decay": f"{ARA}.actor.optim.weight_decay",
    "grad_clip": f"{ARA}.actor.grad_clip",
    "clip_ratio_low": f"{ARA}.actor.clip_ratio_low",
    "clip_ratio_high": f"{ARA}.actor.clip_ratio_high",
    "clip_ratio_c": f"{ARA}.actor.clip_ratio_c",
    "loss_agg_mode": f"{ARA}.actor.loss_agg_mode",
    "norm_adv_by_std_in_grpo": "algorithm.norm_adv_by_std_in_grpo",
    "entropy_coeff": f"{ARA}.actor.entropy_coeff",
    "use_kl_loss": f"{ARA}.actor.use_kl_loss",
    "kl_loss_coef": f"{ARA}.actor.kl_loss_coef",
    "kl_loss_type": f"{ARA}.actor.kl_loss_type",
    "use_kl_in_reward": "algorithm.use_kl_in_reward",
    "kl_coef": "algorithm.kl_ctrl.kl_coef",
    "kl_penalty": "algorithm.kl_penalty",
    "kl_ctrl_type": "algorithm.kl_ctrl.type",
    "kl_target": "algorithm.kl_ctrl.target_kl",
    "kl_horizon": "algorithm.kl_ctrl.horizon",
    "gamma": "algorithm.gamma",
    "lam": "algorithm.lam",
    "critic_model": "critic.model.path",
    "critic_lr": "critic.optim.lr",
    "critic_weight_decay": "critic.optim.weight_decay",
    "critic_warmup": "trainer.critic_warmup (one less)",
    "critic_ppo_micro_batch_size_per_gpu": "critic.ppo_micro_batch_size_per_gpu",
    "critic_ppo_max_token_len_per_gpu": "critic.ppo_max_token_len_per_gpu",
    "critic_grad_clip": "critic.grad_clip",
    "cliprange_value": "critic.cliprange_value",
    "vf_coef": None,  # verl applies it to a shared actor-critic loss only
    "critic_enable_gradient_checkpointing": "critic.model.enable_gradient_checkpointing",
    "critic_param_offload": "critic.model.fsdp_config.param_offload",
    "critic_optimizer_offload": "critic.model.fsdp_config.optimizer_offload",
}


def given_flags():
    """The flags named on the command line (a default left alone is not among them), verl's keys
    as the flags they map to (`parse` keeps the command line it read)."""
    argv = PARSED_ARGV if PARSED_ARGV is not None else sys.argv[1:]
    return {a[2:].split("=")[0].replace("-", "_") for a in argv if a.startswith("--")}


PARSED_ARGV = None  # the command line as `parse` read it, verl's keys as flags


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


def help_text(f):
    """A flag's --help: its text (a `%` kept as one) and its default, once."""
    text = f.metadata["help"].replace("%", "%%")
    if "default:" in text or "default " in text or f.default is None:  # said, or unset
        return text
    default = str(f.default).lower() if isinstance(f.default, bool) else f.default
    return f"{text} (default: {default})"


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Each flag once, as `--name VALUE` (the parser also takes --name-with-dashes)."""

    def __init__(self, prog):
        super().__init__(prog, max_help_position=38, width=100)

    def _split_lines(self, text, width):  # `seq-mean-token-sum` kept whole
        return textwrap.wrap(" ".join(text.split()), width, break_on_hyphens=False)

    def _format_action_invocation(self, action):
        if not action.option_strings:
            return super()._format_action_invocation(action)
        name = action.option_strings[-1] if action.option_strings[0] == "-h" else (
            action.option_strings[0])  # fmt: skip
        if action.nargs == 0:
            return name
        return f"{name} {self._format_args(action, action.dest.upper())}"


class Parser(HfArgumentParser):
    """The command line of a train script: flags by section in --help, each default once; a flag
    error in a line (no usage block, no traceback)."""

    def error(self, message):  # raised, not printed: `run.launch` has rank 0 say it
        raise SystemExit(f"{self.prog}: {message} (--help lists the flags)")


def sections(Args):
    """--help's sections, {first flag: title}: in RunArgs and each script's Args, a comment right
    above a field the class declares first (not one it re-declares) names a section from there on,
    its title the comment up to its first ":" or " (". Read from the classes' source."""
    titles, declared = {}, set()
    for cls in reversed(Args.__mro__):
        own = set(vars(cls).get("__annotations__", {}))
        if not own:
            continue
        comment = []
        for line in inspect.getsource(cls).splitlines():
            if re.match(r"    # ", line):
                comment.append(line.strip()[2:])
                continue
            field_name = re.match(r"    (\w+): ", line)
            if field_name and comment and field_name[1] not in declared:
                titles[field_name[1]] = re.split(r":| \(", " ".join(comment))[0]
            comment = []
        declared |= own
    return titles


def parser(Args):
    """The script's parser: HfArgumentParser for the types, its --help in `sections`."""
    script = os.path.basename(sys.argv[0]) or "train.py"
    doc = (sys.modules["__main__"].__doc__ or "").strip().split("\n\n")[0]
    p = Parser(
        Args,
        prog=script,
        usage=f"torchrun --nproc_per_node=N {script} [--flag value ...]  (or python {script} ...)",
        description=doc,
        epilog="docs/flags.md has each flag's verl key; verl's dotted keys "
        "(data.train_batch_size=4) are taken as well.",
        formatter_class=HelpFormatter,
    )
    titles = sections(Args)
    options = p._action_groups[1]  # argparse's "options", where every flag starts
    group = options
    for f in fields(Args):
        if f.name in titles:
            group = p.add_argument_group(titles[f.name])
        for action in [a for a in p._actions if a.dest == f.name]:
            if action.option_strings[0].startswith("--no_"):  # --no_X: the same as --X false
                action.help = argparse.SUPPRESS
            else:
                action.help = help_text(f)
            if action.nargs == "?" and action.const is True:  # --flag, --flag true|false
                action.metavar = "true|false"
            elif f.type in (bool | None, "bool | None"):  # left to start-up unless given
                action.metavar = "true|false"
            elif action.nargs != 0:
                action.metavar = {int: "N", float: "X"}.get(action.type, "VALUE")
            if group is not options:
                options._group_actions.remove(action)
                group._group_actions.append(action)
    return p


def with_args(table, Args, name):
    """`table` updated with the dict the script's Args (or a class it derives from) declares as
    `name`."""
    table = dict(table)
    for cls in reversed(Args.__mro__):
        table.update(vars(cls).get(name, {}))
    return table


def verl_table(Args):
    """{flag: verl's key}: `VERL`, and what the script's Args adds as its `VERL`."""
    return with_args(VERL, Args, "VERL")


def verl_settled(Args):
    """verl's keys with no flag here, {key: (values that ask for what this script does, or None
    for any; why)}: the shared ones (`VERL_SETTLED`) and the script's Args' `VERL_SETTLED`. A key
    ending in "." stands for all of a section's keys."""
    return with_args(VERL_SETTLED, Args, "VERL_SETTLED")


# how a value reads here, by the note after a key in the tables: verl's enforce_eager is the
# opposite of --rollout_compile; its trainer.critic_warmup=N updates the actor from step N (steps
# count from 1), --critic_warmup N after N critic-only steps
NOTES = {
    "(inverted)": lambda v: "false" if v.lower() in ("true", "1", "yes") else "true",
    "(one less)": lambda v: str(max(int(v) - 1, 0)) if v.isdigit() else v,
}


def verl_keys(Args):
    """verl's config keys (`verl_table`) -> (flag, how its value reads: a function or None): "a/b"
    in a key and " / " between keys name alternatives; a note after the key (`NOTES`) says how
    the value reads."""
    out = {}
    for name, keys in verl_table(Args).items():
        for key in (keys or "").split(" / "):
            key, _, note = key.partition(" ")
            parts = [part.split("/") for part in key.split(".")]
            expanded = [""]
            for alternatives in parts:
                expanded = [f"{e}.{a}" if e else a for e in expanded for a in alternatives]
            for k in expanded:
                if "." in k:
                    out[k] = (name, NOTES.get(note))
    return out


# verl's keys with no flag here that a pasted command line may hold: what they mean here
VERL_ELSEWHERE = {
    "data.return_raw_chat": "prompts are tokenized here",
}

# verl's keys for a choice that has one answer here: the values that ask for it (None: any) are
# left out with a note, another is refused; both say why
VERL_SETTLED = {
    "actor_rollout_ref.actor.strategy": (("fsdp", "fsdp2"), "training is FSDP2 here"),
    "actor_rollout_ref.rollout.mode": (
        ("sync", "async"),
        "the engine runs in the trainer's own process",
    ),
    "actor_rollout_ref.rollout.free_cache_engine": (
        ("true",),
        "the engine always frees its memory while the trainer trains",
    ),
    "reward_model.enable": (
        ("false",),
        "rewards come from rules or --custom_reward_function_path (no reward model)",
    ),
    "reward_model.reward_manager": (("naive",), "rewards are scored one response at a time"),
    "data.dataloader_num_workers": (None, "the data is read once, at start-up"),
    "trainer.device": (("cuda",), "the device is what torch finds: a GPU where one is visible"),
}
NULLS = ("null", "none", "~")  # Hydra's null: the key's default


def settled_as(key, settled):
    """The entry of `settled` (`verl_settled`) for `key`: its own, or its section's."""
    if key in settled:
        return settled[key]
    sections = [k for k in settled if k.endswith(".") and key.startswith(k)]
    return settled[max(sections, key=len)] if sections else None


def verl_flags(Args, argv):
    """verl's `section.key=value` arguments (Hydra's, as in verl's tutorials) as this script's
    flags; a key with no counterpart is named. Hydra's `+` prefixes are taken, `null` leaves the
    default."""
    keys, settled = verl_keys(Args), verl_settled(Args)
    names = {f.name for f in fields(Args)}
    out, script, unknown = [], os.path.basename(sys.argv[0]), []
    for arg in argv:
        m = re.fullmatch(r"\+{0,2}([A-Za-z_]\w*(?:\.\w+)+)=(.*)", arg)
        if m is None:
            out.append(arg)
            continue
        key, value = m.groups()
        value = value.replace("'", "").replace('"', "").strip()  # Hydra's quotes
        if value.startswith("[") and value.endswith("]"):  # a list: [a,b] reads as a,b
            value = ",".join(v.strip() for v in value[1:-1].split(","))
        ours = key in keys and keys[key][0] in names
        entry = None if ours else settled_as(key, settled)
        if entry:  # what the script says verl's key means to it
            values, why = entry
            need(values is None or value.lower() in values, f"verl's {key}={value}: {why}")
            print(f"{script}: verl's {key}={value}: {why}: left out", file=sys.stderr)
            continue
        if key in keys and not ours:  # another script's flag (PPO's critic_*, gamma, ...)
            print(f"{script}: verl's {key} has no meaning here: left out", file=sys.stderr)
            continue
        if key not in keys and value.lower() in NULLS:  # asks for nothing: verl's default
            print(f"{script}: verl's {key}={value}: no counterpart here, left out", file=sys.stderr)
            continue
        if key not in keys:
            near = [  # whole keys alike, and their last parts too (not model.path for model.x)
                k
                for k in difflib.get_close_matches(key, list(keys), n=5, cutoff=0.75)
                if difflib.SequenceMatcher(None, key.split(".")[-1], k.split(".")[-1]).ratio()
                >= 0.6
            ][:2]
            hint = f" (did you mean {' or '.join(near)}?)" if near else ""
            unknown.append(f"verl's {key}: {VERL_ELSEWHERE.get(key, 'no counterpart here')}{hint}")
            continue
        name, reads = keys[key]
        if value.lower() in NULLS:
            continue  # the default
        out += [f"--{name}", reads(value) if reads else value]
    need(not unknown, "; ".join(unknown) + " (docs/flags.md maps verl's keys to flags)")
    return out


def check_flag_names(Args, argv):
    """Every --flag of the command line is one of Args', or the error names the closest ones."""
    names = [f.name for f in fields(Args)]
    for arg in argv:
        if not arg.startswith("--") or arg in ("--help",):
            continue
        name = arg[2:].split("=")[0].replace("-", "_")
        near = [] if name in names else difflib.get_close_matches(name, names, n=3, cutoff=0.6)
        near = near or [n for n in names if n.endswith("_" + name)]  # --lr: --actor_lr, ...
        hint = f"; did you mean {' or '.join('--' + n for n in near)}?" if near else ""
        need(name in names, f"unknown flag {arg.split('=')[0]}{hint} (--help lists the flags)")


def parse(Args, argv=None):
    """The command line (default: sys.argv) read into the script's `Args`: verl's dotted keys
    taken (`verl_flags`), an unknown flag or a word that is no flag's value named in a line."""
    global PARSED_ARGV
    argv = verl_flags(Args, list(sys.argv[1:] if argv is None else argv))
    check_flag_names(Args, argv)
    PARSED_ARGV = argv
    parsed, rest = parser(Args).parse_args_into_dataclasses(
        bare_switches(Args, argv), return_remaining_strings=True
    )
    need(not rest, f"not a flag or a flag's value: {' '.join(rest)} (--help lists the flags)")
    return parsed
