"""train_grpo.py's dynamic sampling end to end on CPU (`--filter_groups`,
`--filter_groups_from_step`, `--gen_batch_size`, `--skip_all_equal`), two ranks under torchrun with
gloo (its arithmetic by hand: tests/test_batches.py).

The same fixture as tests/test_train_grpo.py (24 GSM8K-shaped prompts, the tiny random Qwen2), with
a 0/1 reward by a checksum of the response, so that a group of 2 responses ties about half the time.
"""

import pytest

import train_grpo
from data import dataset
from tests import test_train_grpo
from tests.test_train_grpo import flags, launch, metrics_by_step

assets = test_train_grpo.assets  # the same fixture: parquet files, tiny model, reward file


BINARY_REWARD = '''
import zlib


def compute_score(data_source, solution_str, ground_truth, extra_info=None, **kwargs):
    """1 or 0 by a checksum of the response: the two responses of a group tie about half the
    time."""
    return float(zlib.crc32(solution_str.encode()) % 2)
'''


# the filter with GRESO's skipping; explore 1e-9: a prompt whose last group was all-equal is never
# generated again
SKIPPING = (
    "--filter_groups",
    "--skip_all_equal",
    "--skip_explore_prob",
    "1e-9",
    "--max_num_gen_batches",
    "0",
    "--val_before_train",
    "false",
    "--test_freq",
    "-1",
    "--export_final",
    "false",
)


@pytest.fixture(scope="module")
def skipping_run(assets, tmp_path_factory):
    """Two steps of a run with --skip_all_equal, its first epoch (24 prompts), with the binary
    reward that also writes down each response's train prompt (extra_info's index) and score.
    Nothing is skipped yet (no prompt has been seen), so these steps filter as --filter_groups alone
    does: test_filter_groups_* checks them, and test_skip_all_equal_* resumes the run into its
    second epoch (one launch less)."""
    tmp = tmp_path_factory.mktemp("skipping")
    log, reward, out = tmp / "scored.txt", tmp / "logged.py", tmp / "run"
    reward.write_text(
        BINARY_REWARD
        + f"""

_score = compute_score


def compute_score(data_source, solution_str, ground_truth, extra_info=None, **kwargs):
    score = _score(data_source, solution_str, ground_truth, extra_info)
    with open({str(log)!r}, "a") as f:
        f.write(f"{{extra_info['index']}} {{score}}\\n")
    return score
"""
    )
    # 0 (--max_num_gen_batches): as many rounds as it takes (verl's meaning)
    proc = launch(
        flags(
            assets, out, "hf", 2, "disable", *SKIPPING, "--custom_reward_function_path", str(reward)
        )
    )
    assert proc.returncode == 0, proc.output[-6000:]
    return dict(out=out, log=log, reward=reward)


def test_filter_groups_trains_only_on_groups_with_signal(assets, skipping_run, tmp_path):
    m = metrics_by_step(skipping_run["out"])
    for step in (1, 2):
        # the filter's steps, as without --skip_all_equal
        assert m[step]["rollout/skipped_prompts"] == 0
        # groups of 2 responses scored 0 or 1: a kept group holds one of each, so the batch's mean
        # is 1/2
        assert m[step]["critic/score/mean"] == 0.5
        # the first round generates the whole batch of 4 prompts, later ones what is still missing
        # (at least 2, one per rank); the step kept 4 groups with signal, and needed a second round
        # only if the first held an all-equal group
        rounds, prompts = m[step]["rollout/gen_rounds"], m[step]["rollout/gen_prompts"]
        share = m[step]["rollout/all_equal_groups"]
        assert 4 + 2 * (rounds - 1) <= prompts <= 4 * rounds
        assert (rounds > 1) / prompts <= share <= 1 - 4 / prompts
        # a 0/1 reward: an all-equal group scored all 0 or all 1
        assert m[step]["rollout/solve_none"] + m[step]["rollout/solve_all"] == pytest.approx(share)
        # the generation rate counts every round's tokens, the dropped groups' too: 8 responses of
        # at most 16 tokens a round, of which the 8 kept ones are response_length/mean long on
        # average
        generated = m[step]["perf/gen_tokens_per_s"] * m[step]["timing_s/gen"]
        kept = m[step]["response_length/mean"] * 8
        assert kept * (1 - 1e-6) <= generated <= prompts * 2 * 16 * (1 + 1e-6)
        assert rounds == 1 or generated > kept
    # the filter dropped groups and generated more
    assert max(m[s]["rollout/gen_rounds"] for s in (1, 2)) > 1
    # the step that needed a second round stops at a limit of one, and says which flag to change
    # (the filter alone, without --skip_all_equal)
    (tmp_path / "binary.py").write_text(BINARY_REWARD)
    filtered = (
        "--filter_groups",
        "--custom_reward_function_path",
        str(tmp_path / "binary.py"),
        "--val_before_train",
        "false",
        "--test_freq",
        "-1",
        "--export_final",
        "false",
    )
    proc = launch(
        flags(
            assets,
            tmp_path / "limited",
            "hf",
            2,
            "disable",
            *filtered,
            "--max_num_gen_batches",
            "1",
        )
    )
    assert (
        proc.returncode != 0 and "after 1 generation rounds (--max_num_gen_batches)" in proc.output
    )


def test_filter_groups_from_step_trains_on_one_batch_before_it(assets, tmp_path):
    (tmp_path / "binary.py").write_text(BINARY_REWARD)
    out = tmp_path / "run"
    proc = launch(
        flags(
            assets,
            out,
            "hf",
            3,
            "disable",
            "--filter_groups",
            "--filter_groups_from_step",
            "3",
            "--gen_batch_size",
            "8",
            "--max_num_gen_batches",
            "0",
            "--custom_reward_function_path",
            str(tmp_path / "binary.py"),
            "--val_before_train",
            "false",
            "--test_freq",
            "-1",
            "--export_final",
            "false",
            "--save_freq",
            "-1",
        )
    )
    assert proc.returncode == 0, proc.output[-6000:]
    m = metrics_by_step(out)
    for step in (1, 2):  # one batch of 4 prompts, out of a round of 8, all-equal groups kept
        assert m[step]["rollout/gen_rounds"] == 1 and m[step]["rollout/gen_prompts"] == 4
    # a filtering step would have dropped it
    assert any(m[s]["rollout/all_equal_groups"] > 0 for s in (1, 2))
    # from step 3 on it filters: a first round of 8 prompts, and only groups with signal kept
    assert m[3]["rollout/gen_prompts"] >= 8 and m[3]["critic/score/mean"] == 0.5
    # --save_freq -1: no checkpoint, not even the last (verl's -1)
    assert not list(out.glob("global_step_*"))


def test_skip_all_equal_generates_again_only_prompts_that_had_signal(assets, skipping_run):
    out, log = skipping_run["out"], skipping_run["log"]  # epoch 1 (24 prompts): nothing to skip yet
    # resumed: the streaks come from the checkpoint
    proc = launch(
        flags(
            assets,
            out,
            "hf",
            4,
            "auto",
            *SKIPPING,
            "--custom_reward_function_path",
            str(skipping_run["reward"]),
        )
    )
    assert proc.returncode == 0, proc.output[-6000:]
    m = metrics_by_step(out)
    assert m[1]["rollout/skipped_prompts"] == 0
    assert m[4]["training/epoch"] >= 1 and m[4]["rollout/skipped_prompts"] > 0
    # each prompt's visits in order: one prompt is scored by one rank, its 2 responses one after the
    # other
    visits = {}
    for line in log.read_text().split("\n")[:-1]:
        index, score = line.split()
        visits.setdefault(int(index), []).append(float(score))
    visits = {i: [tuple(s[k : k + 2]) for k in range(0, len(s), 2)] for i, s in visits.items()}
    again = [v for v in visits.values() if len(v) > 1]
    assert again, "no prompt was generated twice: the run did not reach its second epoch"
    # a prompt was generated again only if its previous group had signal (one 0 and one 1)
    assert all(a != b for v in again for a, b in v[:-1]), again
    # and epoch 1 left prompts that were all-equal, which epoch 2 skipped
    assert any(a == b for v in visits.values() for a, b in v[:1])


def test_gen_batch_size_generates_rounds_of_at_most_that_many_prompts(assets, tmp_path):
    # the binary reward, also writing down which train prompt (extra_info's index) each response
    # answers
    def reward_file(name):
        log = tmp_path / f"{name}.prompts"
        (tmp_path / f"{name}.py").write_text(
            BINARY_REWARD
            + f"""

_score = compute_score


def compute_score(data_source, solution_str, ground_truth, extra_info=None, **kwargs):
    with open({str(log)!r}, "a") as f:
        f.write(str(extra_info["index"]) + "\\n")
    return _score(data_source, solution_str, ground_truth, extra_info)
"""
        )
        return tmp_path / f"{name}.py", log

    quiet = ("--val_before_train", "false", "--test_freq", "-1", "--export_final", "false")
    out = tmp_path / "run"
    # 2 steps of 4 prompts, no filter: prompts 0-7 of the epoch's order
    first, first_log = reward_file("first")
    proc = launch(
        flags(assets, out, "hf", 2, "disable", "--custom_reward_function_path", str(first), *quiet)
    )
    assert proc.returncode == 0, proc.output[-6000:]
    # resumed with the filter, rounds that look at 6 prompts
    second, second_log = reward_file("second")
    proc = launch(
        flags(
            assets,
            out,
            "hf",
            4,
            "auto",
            "--custom_reward_function_path",
            str(second),
            "--filter_groups",
            "--gen_batch_size",
            "6",
            "--max_num_gen_batches",
            "0",
            *quiet,
        )
    )
    assert proc.returncode == 0, proc.output[-6000:]
    m = metrics_by_step(out)
    order = dataset.epoch_order(24, 0, train_grpo.Args.seed)  # the epoch's shuffle
    first_prompts = [int(x) for x in first_log.read_text().split()]
    assert sorted(first_prompts) == sorted(order[:8] * 2)  # 2 responses per prompt
    prompts = [int(x) for x in second_log.read_text().split()]
    generated = [int(m[s]["rollout/gen_prompts"]) for s in (3, 4)]
    assert len(prompts) == sum(generated) * 2  # 2 responses per prompt generated
    # the first round after the resume looks at the next 6 prompts of the epoch, and generates them
    # all
    assert sorted(prompts[:12]) == sorted(order[8:14] * 2)
    # every round goes on where the last one stopped: the prompts generated are the epoch's next
    # ones, a of them: all, or, once fewer than 6 were left (24 - 8 - a < 6), those and the next
    # epoch's first ones
    second_epoch = dataset.epoch_order(24, 1, train_grpo.Args.seed)
    total = sum(generated)
    assert any(
        sorted(prompts) == sorted((order[8 : 8 + a] + second_epoch[: total - a]) * 2)
        for a in range(min(16, total) + 1)
        if a == total or a >= 11
    ), prompts
    for step, g in zip((3, 4), generated):
        assert m[step]["critic/score/mean"] == 0.5  # the kept groups: one 0 and one 1 each
        # a step's first round generates all 6 prompts it looks at; it kept 4 groups with signal in
        # all
        assert 6 <= g <= 6 * m[step]["rollout/gen_rounds"]
        assert m[step]["rollout/all_equal_groups"] <= 1 - 4 / g
