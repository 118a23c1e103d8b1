"""verl's GSM8K GRPO tutorial command on one GPU, for the comparison with train_grpo.py on the same
GPU, model and data (docs/performance.md, "Against verl and TRL").

    python bench/verl_grpo.py --model DIR --data DIR --out OUT [--steps 3] [KEY=VALUE ...]

Runs `python3 -m verl.trainer.main_ppo` with the flags of verl's GRPO walkthrough (VERL_FLAGS:
256 prompts x 5, responses up to 1,024 tokens, micro-batches of 4 sequences a GPU in the update and
8 in the log-prob passes, vLLM at 0.4 of the GPU, KL loss k3 0.001, lr 1e-6), the model and data
paths and --steps in place of its epochs, no checkpoint or validation (the step's time alone), and
PyTorch's SDPA attention without packed sequences where flash-attn is not installed
(NO_FLASH_ATTN_FLAGS); more verl keys after the flags override or add to them.
Writes the command and verl's output as it came to OUT/verl.log (the raw log), and
OUT/verl_steps.jsonl: a row per step of verl's numbers as its console logger prints them
(`step:N - timing_s/step:283.1 - ...`; timing_s/step, gen, old_log_prob, ref, update_actor are
named as train_grpo.py names them) and timing_s/since_launch, the seconds from launch to the
line's arrival, so that bench/ab_table.py sets it beside a train_grpo.py run. Needs verl (0.9.1
measured), ray and vllm beside the torch they pin; not part of requirements-*.txt.
"""

import argparse
import importlib.util
import json
import os
import re
import subprocess
import sys
import time

LAUNCH = time.time()

# verl's GRPO walkthrough for Qwen2.5-0.5B-Instruct on GSM8K, one GPU, as its users run it
VERL_FLAGS = [
    "algorithm.adv_estimator=grpo",
    "algorithm.use_kl_in_reward=False",
    "data.train_batch_size=256",
    "data.max_prompt_length=512",
    "data.max_response_length=1024",
    "actor_rollout_ref.actor.optim.lr=1e-6",
    "actor_rollout_ref.actor.ppo_mini_batch_size=64",
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4",
    "actor_rollout_ref.actor.use_kl_loss=True",
    "actor_rollout_ref.actor.kl_loss_coef=0.001",
    "actor_rollout_ref.actor.kl_loss_type=low_var_kl",
    "actor_rollout_ref.rollout.name=vllm",
    "actor_rollout_ref.rollout.n=5",
    "actor_rollout_ref.rollout.tensor_model_parallel_size=1",
    "actor_rollout_ref.rollout.gpu_memory_utilization=0.4",
    "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=8",
    "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=8",
    "trainer.logger=console",
    "trainer.val_before_train=False",
    "trainer.n_gpus_per_node=1",
    "trainer.nnodes=1",
    "trainer.save_freq=-1",
    "trainer.test_freq=-1",
]

# Without flash-attn (no wheel of it for the GPU machine's torch), the model's attention is
# PyTorch's SDPA, and verl's packed sequences (use_remove_padding, on by default) would attend
# across each other there: transformers 5.19 builds no per-sequence mask for SDPA from
# position_ids. verl then runs padded micro-batches instead (slower, but each sequence attends to
# itself only).
NO_FLASH_ATTN_FLAGS = [
    "+actor_rollout_ref.model.override_config.attn_implementation=sdpa",
    "actor_rollout_ref.model.use_remove_padding=False",
]
# a console line, perhaps behind Ray's prefix for the process that printed it: "(TaskRunner
# pid=123) step:2 - timing_s/step:283.1 - critic/score/mean:np.float64(0.25)"
STEP = re.compile(r"(?:^|\s)step:(\d+) - (.*)$")
NUMBER = re.compile(r"^(?:np\.\w+\()?([-+]?(?:[0-9.]+(?:e[-+]?\d+)?|nan|inf))\)?$")


def parse_step(line):
    """(step, {name: number}) from a line of verl's console logger, or None."""
    m = STEP.search(line.rstrip("\n"))
    if m is None:
        return None
    row = {}
    for item in m.group(2).split(" - "):
        name, _, value = item.rpartition(":")
        number = NUMBER.match(value.strip())
        if name and number:
            row[name] = float(number.group(1))
    return int(m.group(1)), row


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True)
    p.add_argument("--data", required=True, help="a folder with train.parquet and test.parquet")
    p.add_argument("--out", required=True)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("overrides", nargs="*", help="more verl keys, KEY=VALUE")
    a = p.parse_args()

    data = os.path.expanduser(a.data)
    command = [sys.executable, "-m", "verl.trainer.main_ppo"] + VERL_FLAGS
    if importlib.util.find_spec("flash_attn") is None:
        command += NO_FLASH_ATTN_FLAGS
    command += [
        f"data.train_files={data}/train.parquet",
        f"data.val_files={data}/test.parquet",
        f"actor_rollout_ref.model.path={os.path.expanduser(a.model)}",
        f"trainer.total_training_steps={a.steps}",
        f"trainer.default_local_dir={os.path.join(a.out, 'checkpoints')}",
    ] + a.overrides
    os.makedirs(a.out, exist_ok=True)
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    with (
        open(os.path.join(a.out, "verl.log"), "w") as log,
        open(os.path.join(a.out, "verl_steps.jsonl"), "w") as steps,
    ):
        log.write("$ " + " ".join(command) + "\n")
        log.flush()
        proc = subprocess.Popen(
            command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env
        )
        for line in proc.stdout:
            log.write(line)
            log.flush()
            sys.stdout.write(line)
            parsed = parse_step(line)
            if parsed is not None:
                step, row = parsed
                row = {"step": step, **row, "timing_s/since_launch": time.time() - LAUNCH}
                steps.write(json.dumps(row) + "\n")
                steps.flush()
        code = proc.wait()
    sys.exit(code)


if __name__ == "__main__":
    main()
