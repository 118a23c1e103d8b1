"""verl's GSM8K GRPO tutorial shape with TRL's GRPOTrainer, for the comparison with train_grpo.py
on the same GPU, model and data (docs/performance.md, "Against verl and TRL").

    python bench/trl_grpo.py --model DIR --train_files DIR/train.parquet --out OUT [--steps 5]

The defaults are the tutorial's shape (256 prompts x 5, responses up to 1,024 tokens); a smaller one
checks the plumbing on a CPU, without vLLM (transformers generates), e.g.
`--prompts 4 --n 4 --max_completion_length 16 --use_vllm false --steps 2`.
Writes OUT/trl_steps.jsonl, a row per GRPO step (one generation round and its four optimizer
steps): its seconds and the seconds since launch at its end, as train_grpo.py logs
timing_s/step and timing_s/since_launch. Needs trl (1.16.0 measured) and vllm beside the torch both
pin; not part of requirements-*.txt.

The two tools' settings side by side: docs/performance.md, "Against verl and TRL".
"""

import argparse
import json
import os
import sys
import time

LAUNCH = time.time()
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True)
    p.add_argument("--train_files", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--steps", type=int, default=5, help="GRPO steps (generation rounds)")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--prompts", type=int, default=256, help="prompts a step")
    p.add_argument("--n", type=int, default=5, help="responses a prompt")
    p.add_argument("--max_completion_length", type=int, default=1024)
    p.add_argument("--use_vllm", type=lambda v: v.lower() == "true", default=True)
    a = p.parse_args()
    # four optimizer steps a step, as verl's mini-batches of 64 prompts; 16 responses a forward
    responses = a.prompts * a.n
    if responses % 4:
        p.error(
            f"--prompts {a.prompts} x --n {a.n}: four optimizer steps a step need a multiple of 4"
        )
    micro = next(m for m in (16, 8, 4, 2, 1) if (responses // 4) % m == 0)

    import pyarrow.parquet as pq
    import torch
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    sys.path.insert(0, ROOT)
    import reward

    rows = pq.read_table(os.path.expanduser(a.train_files)).to_pylist()
    data = Dataset.from_list(
        [{"prompt": r["prompt"], "ground_truth": r["reward_model"]["ground_truth"]} for r in rows]
    )

    def gsm8k_strict(completions, ground_truth, **kwargs):
        texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
        return [reward.gsm8k_score(t, g) for t, g in zip(texts, ground_truth)]

    os.makedirs(a.out, exist_ok=True)
    log = open(os.path.join(a.out, "trl_steps.jsonl"), "w")

    class StepTimes(TrainerCallback):
        """A row per generation round: TRL's steps are optimizer steps, four to a round."""

        def __init__(self):
            self.start = time.time()

        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step % 4 == 0:
                now = time.time()
                row = {"step": state.global_step // 4, "timing_s/step": now - self.start,
                       "timing_s/since_launch": now - LAUNCH}  # fmt: skip
                log.write(json.dumps(row) + "\n")
                log.flush()
                print(row, flush=True)
                self.start = now

    config = GRPOConfig(
        output_dir=a.out,
        max_steps=4 * a.steps,
        learning_rate=1e-6,
        weight_decay=0.01,
        max_grad_norm=1.0,
        lr_scheduler_type="constant",
        per_device_train_batch_size=micro,
        gradient_accumulation_steps=responses // 4 // micro,
        generation_batch_size=responses,
        num_generations=a.n,
        max_completion_length=a.max_completion_length,
        temperature=1.0,
        beta=0.001,
        epsilon=0.2,
        loss_type="dapo",
        scale_rewards="group",
        use_vllm=a.use_vllm,
        vllm_mode="colocate",
        vllm_enable_sleep_mode=True,
        vllm_gpu_memory_utilization=0.4,
        bf16=torch.cuda.is_available(),
        use_cpu=not torch.cuda.is_available(),
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        seed=a.seed,
    )
    trainer = GRPOTrainer(
        model=a.model,
        reward_funcs=gsm8k_strict,
        args=config,
        train_dataset=data,
        callbacks=[StepTimes()],
    )
    trainer.train()
    log.close()


if __name__ == "__main__":
    main()
