"""Your own data, in verl's schema: one parquet row per prompt with `data_source` (which reward),
`prompt` (chat messages), `reward_model.ground_truth` (what the reward compares with) and
`extra_info`. Here a made-up task, spelling a word backwards; write your rows the same way.

    python examples/quickstart/data.py --out DIR     # DIR/train.parquet, DIR/test.parquet
"""

import argparse
import os
import random

import pyarrow as pa
import pyarrow.parquet as pq

WORDS = "cat dog sun map pen cup box hat bed car bus egg ice jam key leg net owl pig rat".split()


def rows(words, split):
    return [
        {
            "data_source": "my/backwards",
            "prompt": [
                {"role": "user", "content": f"Spell '{w}' backwards. Answer with the word."}
            ],
            "ability": "spelling",
            "reward_model": {"style": "rule", "ground_truth": w[::-1]},
            "extra_info": {"split": split, "index": i},
        }
        for i, w in enumerate(words)
    ]


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True)
    out = p.parse_args().out
    os.makedirs(out, exist_ok=True)
    words = WORDS[:]
    random.Random(0).shuffle(words)
    for split, part in (("train", words[:16]), ("test", words[16:])):
        pq.write_table(
            pa.Table.from_pylist(rows(part, split)), os.path.join(out, f"{split}.parquet")
        )
    print(f"wrote {out}/train.parquet (16 prompts) and {out}/test.parquet (4)")
