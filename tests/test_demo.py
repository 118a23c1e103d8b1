"""demo.py's pieces: the arithmetic data in verl's schema, its scorer on hand-worked responses, the
sloppy teacher, a warm start that saves a loadable model, and `demo.py --quick` end to end (two GRPO
steps). Whether the full demo learns is measured by running it, not here: it takes minutes."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

import demo
import reward
from bench.tiny import make_tiny_tokenizer
from data import arith
from data.dataset import load_rl_dataset
from data.gsm8k import SCHEMA
from tests.tiny_model import free_port

ROOT = Path(__file__).resolve().parents[1]


def test_arith_parquet_has_verls_schema_and_a_held_out_test_split(tmp_path):
    paths = arith.main(tmp_path)
    train, test = pq.read_table(paths["train"]), pq.read_table(paths["test"])
    assert train.schema.equals(SCHEMA) and test.schema.equals(SCHEMA)
    # a, b in 10..99: 9 x 9 = 81 tens-digit pairs; 45 of the 100 ones-digit pairs carry
    # (u1 + u2 >= 10: 1 for u1=1, 2 for u1=2, ..., 9 for u1=9 -> 45): 81 * 45 = 3645
    assert (train.num_rows, test.num_rows) == (3645 - 500, 500)
    rows = train.to_pylist() + test.to_pylist()
    questions = [r["extra_info"]["question"] for r in rows]
    assert len(set(questions)) == 3645  # no problem in both splits
    row = train.to_pylist()[0]
    a, b = map(int, row["extra_info"]["question"].split("+"))
    assert row["data_source"] == "arith" and row["reward_model"]["ground_truth"] == str(a + b)
    assert row["prompt"] == [{"role": "user", "content": f"{a}+{b}=? {arith.INSTRUCTION}"}]
    assert all(int(q[1]) + int(q[4]) >= 10 for q in questions)  # every ones column carries
    # the trainer's loader takes it: <|im_start|>user\n (6 tokens) + 31
    # + <|im_end|>\n<|im_start|>assistant\n (13)
    data = load_rl_dataset([paths["train"]], make_tiny_tokenizer(), max_prompt_length=64)
    assert len(data) == 3145 and {len(e.prompt_ids) for e in data.examples} == {50}


@pytest.mark.parametrize(
    "response, strict, flexible",
    [
        ("85", 1.0, 1.0),
        ("85<|im_end|>", 1.0, 1.0),  # as decoded with special tokens: the first number is still 85
        ("85, because 7+8=15", 1.0, 1.0),  # first number 85
        ("75", 0.0, 0.0),  # the forgotten carry
        ("the sum is 85", 1.0, 1.0),  # first number is 85: words before it do not matter
        ("47+38 = 85", 0.0, 1.0),  # first number 47; 85 appears later
        ("850", 0.0, 0.0),  # a whole number, not a prefix
        ("-85", 0.0, 0.0),
        ("", 0.0, 0.0),
    ],
)
def test_arith_score_by_hand(response, strict, flexible):
    assert reward.compute_score("arith", response, "85") == strict
    assert reward.compute_score("arith", response, "85", method="flexible") == flexible


def test_sloppy_teacher_drops_the_ones_carry():
    class Always:
        def __init__(self, x):
            self.x = x

        def random(self):
            return self.x

    # 0.5 < 0.7: forgets; 4+3 tens, 5 ones
    assert demo.sloppy_answer(47, 38, 0.7, Always(0.5)) == 75
    assert demo.sloppy_answer(47, 38, 0.7, Always(0.9)) == 85  # 0.9 >= 0.7: carries
    assert demo.sloppy_answer(95, 17, 1.0, Always(0.0)) == 102  # 9+1 tens, 2 ones, no carry


def test_warm_start_lowers_the_loss_and_saves_a_loadable_model(tmp_path):
    tokenizer = make_tiny_tokenizer()
    model = demo.build_model(demo.CONFIG["model"], tokenizer, seed=0)
    rows = arith.make_splits()["train"]
    losses = demo.warm_start(
        model, tokenizer, rows, steps=10, batch_size=16, lr=3e-3, forget_carry=0.7, seed=0
    )
    assert losses[-1] < losses[0]
    model.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path)
    for (name, p), q in zip(model.state_dict().items(), loaded.state_dict().values()):
        assert torch.equal(p, q), name
    tok = AutoTokenizer.from_pretrained(tmp_path)
    ids = tok.apply_chat_template(
        [rows[0]["prompt"]], add_generation_prompt=True, return_tensors="pt", return_dict=True
    )["input_ids"]
    out = loaded.generate(ids, max_new_tokens=4, do_sample=False)
    assert out.shape[1] > ids.shape[1]


def test_quick_demo_runs_the_trainer_end_to_end(tmp_path):
    # for the trainer's world-of-one process group
    env = {
        **os.environ,
        "MASTER_PORT": str(free_port()),
    }
    proc = subprocess.run(
        [sys.executable, "demo.py", "--quick", "--out", str(tmp_path)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-6000:]
    with open(tmp_path / "arith" / "metrics.jsonl") as f:
        rows = [json.loads(line) for line in f]
    assert [r["step"] for r in rows] == [0, 1, 2]
    assert "val-core/arith/reward/mean@1" in rows[0] and "val-core/arith/reward/mean@1" in rows[2]
    assert all(0.0 <= r["critic/score/mean"] <= 1.0 for r in rows[1:])
    assert (tmp_path / "arith" / "hf_model" / "config.json").is_file()
