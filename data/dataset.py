"""Load verl-format parquet files into tokenized prompts for training and validation, and the order
in which training draws them (a seeded shuffle per epoch, `PromptOrder` its cursor, which
checkpoints keep).

Each row needs (other columns are ignored):
    data_source   str                                  picks the scorer in reward.py
    prompt        [{"role": str, "content": str}, ...]  chat messages, rendered with the tokenizer's
                                                        template
    reward_model  {"ground_truth": str, ...}           int / float ground truths become str(x): 72
                                                       -> "72"
    extra_info    dict (optional)                      passed to the reward function as is
"""

from dataclasses import dataclass, field
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import torch

from flags import BadInput

REQUIRED = ("data_source", "reward_model")


@dataclass
class Example:
    prompt_ids: list  # list[int], the chat-templated prompt ending in the assistant header
    data_source: str
    ground_truth: str
    extra_info: dict | None
    row: int  # index within its file, for error messages and logs
    file: str


@dataclass
class RLDataset:
    examples: list = field(default_factory=list)  # list[Example]
    n_filtered: int = 0  # prompts dropped for being longer than max_prompt_length

    def __len__(self):
        return len(self.examples)

    def __getitem__(self, i):
        return self.examples[i]


def _messages(prompt, where):
    if not isinstance(prompt, list) or not prompt:
        raise BadInput(
            f"{where}: prompt must be a non-empty list of {{'role': str, 'content': str}} "
            f"messages, got {type(prompt).__name__} {str(prompt)[:100]!r}"
        )
    for m in prompt:
        if (
            not isinstance(m, dict)
            or not isinstance(m.get("role"), str)
            or not isinstance(m.get("content"), str)
        ):
            raise BadInput(
                f"{where}: every prompt message must be {{'role': str, 'content': str}}, got {m!r}"
            )
    # parquet structs give each message every field of every row (a missing one as None): drop those
    return [{k: v for k, v in m.items() if v is not None} for m in prompt]


def _ground_truth(reward_model, where):
    if not isinstance(reward_model, dict) or "ground_truth" not in reward_model:
        raise BadInput(
            f"{where}: reward_model must be a dict with a 'ground_truth', got {reward_model!r}"
        )
    truth = reward_model["ground_truth"]
    if isinstance(truth, (int, float)) and not isinstance(truth, bool):
        return str(truth)  # a number written as one; str() so rule-based scorers compare strings
    if not isinstance(truth, str):
        raise BadInput(
            f"{where}: reward_model.ground_truth must be a str (or a number), got "
            f"{type(truth).__name__} {truth!r} (a row without one reads as None); "
            "rewrite the file with string ground truths"
        )
    return truth


def _read(path, prompt_key):
    """The validated rows of one file: [(row, messages, data_source, ground_truth, extra_info),
    ...]."""
    if not path.is_file():
        raise BadInput(f"data file {path} does not exist; make it with e.g. python data/gsm8k.py")
    try:
        columns = pq.read_schema(path).names
    except (pa.ArrowException, OSError) as e:  # a CSV, an empty or a truncated file
        raise BadInput(
            f"{path} is not a readable parquet file ({e}); give parquet in verl's format, "
            "e.g. made by data/gsm8k.py"
        ) from e
    for name in (*REQUIRED, prompt_key):
        if name not in columns:
            raise BadInput(
                f"{path}: no column {name!r} (it has {columns}); the file must be in verl's format "
                "(data_source, prompt, reward_model, extra_info), see data/gsm8k.py"
            )
    wanted = [*REQUIRED, prompt_key] + (["extra_info"] if "extra_info" in columns else [])
    try:
        table = pq.read_table(path, columns=wanted)
    except (pa.ArrowException, OSError) as e:  # its schema reads, its data does not
        raise BadInput(f"{path}: its rows cannot be read ({e}); write the file again") from e
    data = {name: table.column(name).to_pylist() for name in wanted}
    rows = []
    for i in range(table.num_rows):
        where = f"{path} row {i}"
        source = data["data_source"][i]
        if not isinstance(source, str):
            raise BadInput(f"{where}: data_source must be a str, got {source!r}")
        info = data["extra_info"][i] if "extra_info" in data else None
        rows.append(
            (
                i,
                _messages(data[prompt_key][i], where),
                source,
                _ground_truth(data["reward_model"][i], where),
                info,
            )
        )
    return rows


def load_rl_dataset(
    files,
    tokenizer,
    max_prompt_length,
    filter_overlong_prompts=True,
    truncation="error",
    prompt_key="prompt",
):
    """Read, validate and tokenize parquet file(s) into an RLDataset.

    Prompts longer than max_prompt_length tokens are dropped and counted in n_filtered when
    filter_overlong_prompts; else truncation says what happens: "error" raises, "left" keeps the
    last max_prompt_length tokens (the question's end and the assistant header), "right" keeps the
    first.
    """
    assert truncation in ("error", "left", "right"), (
        f"truncation must be error, left or right, not {truncation!r}"
    )
    dataset = RLDataset()
    files = [files] if isinstance(files, (str, Path)) else list(files)
    for path in files:
        path = Path(path).expanduser()
        rows = _read(path, prompt_key)
        if not rows:
            continue
        try:
            texts = tokenizer.apply_chat_template(
                [r[1] for r in rows], add_generation_prompt=True, tokenize=False
            )
        # transformers raises ValueError when the tokenizer has no chat_template
        except ValueError as e:
            raise BadInput(f"{path}: cannot apply the tokenizer's chat template: {e}") from e
        # one batched call, encoded in Rust (GSM8K's 7.5k prompts take a second or two)
        all_ids = tokenizer(texts, add_special_tokens=False)["input_ids"]
        for (i, _, source, truth, info), ids in zip(rows, all_ids):
            if len(ids) > max_prompt_length:
                if filter_overlong_prompts:
                    dataset.n_filtered += 1
                    continue
                if truncation == "error":
                    raise BadInput(
                        f"{path} row {i}: prompt has {len(ids)} tokens > max_prompt_length="
                        f"{max_prompt_length}; pass --filter_overlong_prompts to drop such "
                        "prompts, --truncation left/right to cut them, or raise --max_prompt_length"
                    )
                ids = ids[-max_prompt_length:] if truncation == "left" else ids[:max_prompt_length]
            dataset.examples.append(Example(list(ids), source, truth, info, i, str(path)))
    if not dataset.examples and not dataset.n_filtered:
        names = ", ".join(map(str, files))
        raise BadInput(f"{names} holds no rows: give files with prompts in verl's format")
    if not dataset.examples:
        raise BadInput(
            f"no prompts left in {files} ({dataset.n_filtered} longer than max_prompt_length="
            f"{max_prompt_length} were dropped); raise --max_prompt_length or check the files"
        )
    return dataset


# --- the order of the training prompts ------------------------------------------------------------


def epoch_order(n_examples, epoch, seed):
    """The training prompts' order in an epoch: a seeded shuffle, a new one each epoch."""
    return torch.randperm(
        n_examples, generator=torch.Generator().manual_seed(seed + epoch)
    ).tolist()


def batch_order(n_examples, batch_size, epoch, seed):
    """The prompts of each step of an epoch when each step takes one batch: last partial batch
    dropped (verl). PromptOrder walks the same order, a round at a time."""
    perm = epoch_order(n_examples, epoch, seed)
    return [perm[i : i + batch_size] for i in range(0, n_examples - batch_size + 1, batch_size)]


class PromptOrder:
    """A cursor over the epochs' orders. A generation round looks at the next m prompts (`peek`),
    then moves past the ones it used (`advance`). When fewer than m remain, the epoch ends and they
    are dropped, as verl drops the last partial batch. (epoch, offset) is the position a checkpoint
    keeps. Example: 10 prompts, rounds that look at 4 and use 4, 3, 2: offsets 4, 7, then a new
    epoch (3 left < 4), whose first 2 prompts the third round uses."""

    def __init__(self, n_examples, seed, epoch=0, offset=0):
        self.n, self.seed, self.epoch, self.offset = n_examples, seed, epoch, offset

    def peek(self, m):
        if self.offset + m > self.n:
            self.epoch, self.offset = self.epoch + 1, 0
        return epoch_order(self.n, self.epoch, self.seed)[self.offset : self.offset + m]

    def advance(self, k):
        self.offset += k
