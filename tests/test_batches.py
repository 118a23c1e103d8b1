"""batches.py's arithmetic by hand: truncated importance-sampling weights (--rollout_is) and their
metrics, which prompts --skip_all_equal generates again and how many prompts a --filter_groups round
asks for, and the rows --rollout_data_dir writes. (The batches a run builds are tested end to end in
tests/test_train_*.py.)
"""

import json
import math
import os

import pytest
import torch

import batches
from batches import rollout_is_metrics, rollout_is_weights
from bench.tiny import make_tiny_tokenizer
from data.dataset import Example


def close(actual, expected, atol=1e-4, rtol=0.0):
    torch.testing.assert_close(
        torch.as_tensor(actual, dtype=torch.float32),
        torch.as_tensor(expected, dtype=torch.float32),
        atol=atol,
        rtol=rtol,
    )


def read_jsonl(path):
    with open(path) as f:
        return [json.loads(line) for line in f]


# --- truncated importance sampling (--rollout_is) -------------------------------------------------


def test_rollout_is_weights_by_hand():
    # row 0: pi_old / pi_rollout = 0.5 / 0.25 = 2 and 0.2 / 0.4 = 0.5; its third token is padding
    #        (garbage)
    # row 1: 0.6 / 0.3 = 2 and 0.6 / 0.4 = 1.5; no padding
    log = torch.log
    old = log(torch.tensor([[0.5, 0.2, 0.9], [0.6, 0.6, 0.1]]))
    rollout = log(torch.tensor([[0.25, 0.4, 0.01], [0.3, 0.4, 0.1]]))
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
    # token level, truncated at 1.5: min(2, 1.5) = 1.5, 0.5, padding 0; 1.5, 1.5, 1
    weights, rho = rollout_is_weights(old, rollout, mask, "token", 1.5)
    close(weights, [[1.5, 0.5, 0.0], [1.5, 1.5, 1.0]])
    close(rho, [[2.0, 0.5, 0.0], [2.0, 1.5, 1.0]])
    # sequence level: row 0's product 2 * 0.5 = 1 (the padding's ratio 90 left out); row 1's 2 * 1.5
    # * 1 = 3, truncated at 2; the same weight on every token of a response
    weights, rho = rollout_is_weights(old, rollout, mask, "sequence", 2.0)
    close(weights, [[1.0, 1.0, 0.0], [2.0, 2.0, 2.0]])
    close(rho, [[1.0, 1.0, 0.0], [3.0, 3.0, 3.0]])
    assert not weights.requires_grad


def test_rollout_is_weights_stay_finite_and_name_the_flag():
    # log rho = 50 would overflow in fp32 after exp(); clamped to 20 first, then truncated
    weights, rho = rollout_is_weights(
        torch.tensor([[0.0, -60.0]]), torch.tensor([[-50.0, 0.0]]), torch.ones(1, 2), "token", 2.0
    )
    close(weights, [[2.0, math.exp(-20)]])
    assert torch.isfinite(rho).all() and rho[0, 0].item() == pytest.approx(math.exp(20), rel=1e-5)
    with pytest.raises(ValueError, match="--rollout_is 'geometric' is not one of token, sequence"):
        rollout_is_weights(torch.zeros(1, 1), torch.zeros(1, 1), torch.ones(1, 1), "geometric", 2.0)


def test_rollout_is_metrics_by_hand():
    # weights (after truncation at 1.5) on the 5 unmasked tokens: 1.5, 0.5, 1.5, 1.5, 1.0
    # -> mean 6 / 5 = 1.2; 3 of the 5 had rho above 1.5 (2, 2, 1.6: the 1.5 on row 1 was truncated
    # from 1.6)
    weights = torch.tensor([[1.5, 0.5, 0.0], [1.5, 1.5, 1.0]])
    rho = torch.tensor([[2.0, 0.5, 7.0], [2.0, 1.6, 1.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
    m = rollout_is_metrics(weights, rho, mask, 1.5, "cpu")
    assert m == pytest.approx(
        {
            "rollout_corr/rollout_is_mean": 1.2,
            "rollout_corr/rollout_is_min": 0.5,
            "rollout_corr/rollout_is_max": 1.5,
            "rollout_corr/rollout_is_ratio_fraction_high": 0.6,
        }
    )


# --- dynamic sampling (--filter_groups, --skip_all_equal) -----------------------------------------


def test_selective_rollout_by_hand():
    # streaks [1, 1, 1, 0], explore 0.5: Random(0) draws 0.844, 0.758, 0.421 for the first three
    # (kept below 0.5); the fourth is kept without a draw
    assert batches.selective_rollout([0, 1, 2, 3], [1, 1, 1, 0], 0.5, 0, 1) == [2, 3]
    # the same on 2 ranks; on 3 the kept ones are cut to a multiple of 3: none
    assert batches.selective_rollout([0, 1, 2, 3], [1, 1, 1, 0], 0.5, 0, 2) == [2, 3]
    assert batches.selective_rollout([0, 1, 2, 3], [1, 1, 1, 0], 0.5, 0, 3) == []
    # streak 2 at explore 0.5: a draw below 0.25 keeps it; 0.844, 0.758, 0.421 skip all three
    assert batches.selective_rollout([0, 1, 2, 3], [2, 2, 2, 0], 0.5, 0, 1) == [3]
    # no streak, or explore 1: every prompt, in its order
    assert batches.selective_rollout([5, 3, 9, 1], [0] * 10, 0.01, 7, 2) == [5, 3, 9, 1]
    assert batches.selective_rollout([5, 3, 9, 1], [3] * 10, 1.0, 7, 2) == [5, 3, 9, 1]
    # over many prompts the kept share is explore**streak
    many = range(20000)
    assert len(batches.selective_rollout(many, [1] * 20000, 0.5, 1, 1)) == pytest.approx(
        10000, rel=0.03
    )
    assert len(batches.selective_rollout(many, [2] * 20000, 0.5, 1, 1)) == pytest.approx(
        5000, rel=0.05
    )


def test_round_size_by_hand():
    # nothing kept yet: the whole batch
    assert batches.round_size(256, 0, 0, 256, 1) == 256
    assert batches.round_size(200, 0, 256, 256, 1) == 256
    # 26 missing after 230 of 512 kept: 26 / (230 / 512) * 1.2 = 69.46 -> 70; on 4 ranks 72
    assert batches.round_size(26, 230, 512, 256, 1) == 70
    assert batches.round_size(26, 230, 512, 256, 4) == 72
    # 141 missing after 115 of 256: 141 / 0.449 * 1.2 = 376.7, more than the batch holds
    assert batches.round_size(141, 115, 256, 256, 1) == 256
    assert batches.round_size(141, 115, 256, 768, 8) == 384
    # exact arithmetic at the boundary: 5 / (5 / 10) * 1.2 = 12 exactly, not 13
    assert batches.round_size(5, 5, 10, 64, 1) == 12


# --- generations written to disk ------------------------------------------------------------------


def test_generation_rows_by_hand(tmp_path):
    tok = make_tiny_tokenizer()
    example = Example(tok.encode("What is 2 plus 3?"), "my_source", "5", None, 0, "f.parquet")
    groups = [
        dict(
            example=example,
            texts=["5", "6"],
            scores=[1.0, 0.0],
            flexible=[float("nan")] * 2,
            extras={"acc": [1.0, 0.0]},
        )
    ]
    rows = batches.generation_rows(groups, tok, step=7)
    assert rows == [
        {
            "input": "What is 2 plus 3?",
            "output": "5",
            "gts": "5",
            "score": 1.0,
            "step": 7,
            "acc": 1.0,
        },
        {
            "input": "What is 2 plus 3?",
            "output": "6",
            "gts": "5",
            "score": 0.0,
            "step": 7,
            "acc": 0.0,
        },
    ]
    groups[0]["flexible"] = [1.0, 0.0]  # a data source with a flexible scorer
    assert [r["score_flexible"] for r in batches.generation_rows(groups, tok, 7)] == [1.0, 0.0]
    batches.dump_generations(tmp_path / "d", "7", rows)
    assert (
        os.listdir(tmp_path / "d") == ["7.jsonl"] and read_jsonl(tmp_path / "d" / "7.jsonl") == rows
    )
