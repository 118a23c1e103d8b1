"""Write a synthetic arithmetic task as parquet in verl's format: python data/arith.py
[--local_save_dir DIR]

Every two-digit addition whose ones column carries ("47+38", 8 + 7 >= 10): 81 x 45 = 3,645 problems,
shuffled with a seed and split into a train and a held-out test set. The demo (demo.py) trains on
it because a model that forgets the carry gives one specific wrong answer (47+38 -> 75), so what
RL has to fix is easy to see. Rows have the columns and types of data/gsm8k.py:

    column        type                                          example
    data_source   string                                        "arith"
    prompt        list<struct<role: string, content: string>>   [{"role": "user", "content":
                                                                "47+38=? " + INSTR}]
    ability       string                                        "math"
    reward_model  struct<style: string, ground_truth: string>   {"style": "rule", "ground_truth":
                                                                "85"}
    extra_info    struct<split: string, index: int64,           {"split": "train", "index": 0,
                         answer: string, question: string>       "answer": "85", "question":
                                                                 "47+38"}

INSTR is INSTRUCTION below; reward.py scores a response 1.0 when its first number is ground_truth.
"""

import argparse
import random

try:
    from data.gsm8k import write_parquet
except ImportError:  # run as a script: python data/arith.py puts data/ itself on sys.path
    from gsm8k import write_parquet

DATA_SOURCE = "arith"
INSTRUCTION = "Answer with the number."


def problems():
    """All (a, b) with 10 <= a, b <= 99 whose ones digits carry, in a fixed order."""
    return [(a, b) for a in range(10, 100) for b in range(10, 100) if a % 10 + b % 10 >= 10]


def make_row(a, b, split, idx):
    question = f"{a}+{b}"
    return {
        "data_source": DATA_SOURCE,
        "prompt": [{"role": "user", "content": f"{question}=? {INSTRUCTION}"}],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": str(a + b)},
        "extra_info": {"split": split, "index": idx, "answer": str(a + b), "question": question},
    }


def make_splits(n_test=500, seed=0):
    """{"train": rows, "test": rows}: a seeded shuffle of problems(), the first n_test held out."""
    pairs = problems()
    random.Random(seed).shuffle(pairs)
    splits = {"test": pairs[:n_test], "train": pairs[n_test:]}
    return {s: [make_row(a, b, s, i) for i, (a, b) in enumerate(p)] for s, p in splits.items()}


def main(local_save_dir="~/data/arith", n_test=500, seed=0):
    rows = make_splits(n_test, seed)
    paths = write_parquet(rows, local_save_dir)
    for split, path in paths.items():
        print(f"wrote {len(rows[split]):,} rows to {path}")
    return paths


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--local_save_dir", default="~/data/arith", help="where train/test.parquet are written"
    )
    parser.add_argument("--n_test", type=int, default=500, help="problems held out for validation")
    parser.add_argument(
        "--seed", type=int, default=0, help="seed of the shuffle that splits train / test"
    )
    args = parser.parse_args()
    main(args.local_save_dir, args.n_test, args.seed)
