"""Write docs/flags.md, every flag of both train scripts with its defaults, its --help and verl's key,
from the scripts' Args: `python docs/flags.py`. tests/test_docs.py fails when a flag has no entry
in VERL below or the file is not what this writes."""

import dataclasses
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

ARA = "actor_rollout_ref"
# each flag's verl config key; None: ours, verl has none
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
    "custom_reward_function_path": "reward.custom_reward_function.path",
    "custom_reward_function_name": "reward.custom_reward_function.name",
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
    "critic_warmup": "trainer.critic_warmup",
    "critic_ppo_micro_batch_size_per_gpu": "critic.ppo_micro_batch_size_per_gpu",
    "critic_ppo_max_token_len_per_gpu": "critic.ppo_max_token_len_per_gpu",
    "critic_grad_clip": "critic.grad_clip",
    "cliprange_value": "critic.cliprange_value",
    "vf_coef": None,  # verl applies it to a shared actor-critic loss only
    "critic_enable_gradient_checkpointing": "critic.model.enable_gradient_checkpointing",
    "critic_param_offload": "critic.model.fsdp_config.param_offload",
    "critic_optimizer_offload": "critic.model.fsdp_config.optimizer_offload",
}


def rows():
    """(flag, GRPO default, PPO default, help, verl key) for every flag of either script."""
    import train_grpo
    import train_ppo

    def defaults(Args):
        return {f.name: (f.default, f.metadata.get("help", "")) for f in dataclasses.fields(Args)}

    grpo, ppo = defaults(train_grpo.Args), defaults(train_ppo.Args)
    for name in dict.fromkeys([*grpo, *ppo]):
        help = (grpo.get(name) or ppo.get(name))[1]
        g = repr(grpo[name][0]) if name in grpo else "-"
        p = repr(ppo[name][0]) if name in ppo else "-"
        yield name, g, p, help, VERL.get(name, "MISSING")


def markdown():
    lines = [
        "# Every flag",
        "",
        "Written by `python docs/flags.py` from the train scripts' `Args` (tests/test_docs.py checks",
        "that it is current). Defaults as declared; `None` means chosen at start-up (the --help text",
        "says how). Booleans take `--flag` or `--flag true|false`. A verl key of `-` is ours: verl",
        "has no such setting.",
        "",
        "| flag | GRPO default | PPO default | what it does | verl's key |",
        "|---|---|---|---|---|",
    ]
    for name, g, p, help, key in rows():
        help = help.replace("|", "\\|")
        lines.append(f"| `--{name}` | `{g}` | `{p}` | {help} | {f'`{key}`' if key else '-'} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    with open(os.path.join(ROOT, "docs", "flags.md"), "w") as f:
        f.write(markdown())
