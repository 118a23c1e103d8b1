"""reward.py: GSM8K scoring against a hand-worked table and verl's reference, dispatch, custom
rewards, validation metrics (mean@k, pass@k, extras) by hand."""

import os
import random
import re
import time

import pytest

import reward
from flags import BadInput
from reward import compute_score, gsm8k_extract, gsm8k_score, load_reward_function, score_batch

GSM8K = "openai/gsm8k"

# (response, ground_truth, strict, flexible)
TABLE = [
    ("3 + 4 = 7\n#### 7", "7", 1.0, 1.0),
    ("#### 1,000", "1000", 1.0, 1.0),  # strict drops the comma: "1,000" -> "1000"
    ("#### 1,000", "1,000", 0.0, 0.0),  # ground truths are written without commas
    ("#### -5", "-5", 1.0, 1.0),
    ("#### 2.5", "2.5", 1.0, 1.0),
    ("#### 72.0", "72", 0.0, 0.0),  # answers compare as strings: "72.0" != "72"
    ("#### 3\nno, wait:\n#### 4", "4", 1.0, 1.0),  # several markers: the last one wins
    ("#### 3\nno, wait:\n#### 4", "3", 0.0, 0.0),
    ("The answer is 42", "42", 0.0, 1.0),  # no marker: strict 0, flexible takes the last number
    ("", "42", 0.0, 0.0),
    ("no numbers here", "42", 0.0, 0.0),
    ("The answer is \\boxed{42}", "42", 0.0, 1.0),
    ("####5", "5", 0.0, 1.0),  # strict needs "#### " with the space
    ("#### $18", "18", 0.0, 1.0),  # strict's number must follow "#### " directly; "$" is not in it
    ("She makes $18 a day.\n#### 18", "18", 1.0, 1.0),
    ("#### 1,000.", "1000", 0.0, 1.0),  # strict keeps the dot: "1000." != "1000"; flexible drops it
    ("The change is -3.", "-3", 0.0, 1.0),  # flexible: "-3." -> "-3"
    ("#### 7 ...", "7", 1.0, 1.0),  # flexible skips "..." (no digit) and takes "7"
    ("#### 18\nSo she has 3 apples left.", "18", 1.0, 0.0),  # flexible takes the last number, 3
    # the 300-character window: "#### 42\n" is 8 chars, so 8 + 292 = 300 chars are all kept ...
    ("#### 42\n" + "x" * 292, "42", 1.0, 1.0),
    # ... and at 301 chars the first "#" is clipped: "### 42" is no marker, but 42 is still a number
    ("#### 42\n" + "x" * 293, "42", 0.0, 1.0),
    # marker 408 chars from the end: nothing left to find
    (
        "#### 42\n" + "x" * 400,
        "42",
        0.0,
        0.0,
    ),
]


@pytest.mark.parametrize("response, truth, strict, flexible", TABLE)
def test_gsm8k_table(response, truth, strict, flexible):
    assert gsm8k_score(response, truth) == strict
    assert gsm8k_score(response, truth, method="strict") == strict
    assert gsm8k_score(response, truth, method="flexible") == flexible


def test_gsm8k_extract():
    assert gsm8k_extract("#### 1,234,567") == "1234567"
    assert gsm8k_extract("#### 1,000.", method="flexible") == "1000"
    assert gsm8k_extract("no marker 12") is None
    assert gsm8k_extract("no number at all", method="flexible") is None
    assert gsm8k_extract("x = -0.5", method="flexible") == "-0.5"


def _verl_strict(solution_str):
    """verl's extract_solution(method="strict"), verl/utils/reward_score/gsm8k.py, as the
    reference."""
    if len(solution_str) > 300:
        solution_str = solution_str[-300:]
    solutions = re.findall("#### (\\-?[0-9\\.\\,]+)", solution_str)
    return solutions[-1].replace(",", "").replace("$", "") if solutions else None


def test_strict_matches_verl_on_random_strings():
    rng = random.Random(0)
    pieces = ["#### ", "####", "#", " ", "-", "1", "23", ".", ",", "$", "x", "\n", "\\boxed{", "}"]
    for response in [r for r, *_ in TABLE] + [
        "".join(rng.choices(pieces, k=rng.randint(0, 200))) for _ in range(2000)
    ]:
        assert gsm8k_extract(response) == _verl_strict(response), response


def test_compute_score_dispatch():
    assert compute_score(GSM8K, "#### 18", "18") == 1.0
    assert compute_score(GSM8K, "#### 17", "18") == 0.0
    assert compute_score(GSM8K, "so 18", "18", extra_info={"index": 0}) == 0.0
    assert compute_score(GSM8K, "so 18", "18", method="flexible") == 1.0
    with pytest.raises(NotImplementedError) as e:
        compute_score("my/data", "#### 18", "18")
    assert "'my/data'" in str(e.value) and GSM8K in str(e.value)
    assert "--custom_reward_function_path" in str(e.value)


def test_scorers_register_one_line(monkeypatch):
    monkeypatch.setitem(
        reward.SCORERS,
        "echo",
        lambda solution_str, ground_truth, method: float(solution_str == "hi"),
    )
    assert compute_score("echo", "hi", "") == 1.0


# --- custom reward functions ---
GOOD = """
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    return float(solution_str.strip() == ground_truth)

def with_extras(data_source, solution_str, ground_truth, extra_info=None, **kwargs):
    acc = float(solution_str.strip() == ground_truth)
    out = {"score": acc + 0.5, "acc": acc, "pred": solution_str.strip()}
    if data_source == "b":
        out["only_b"] = 1.0
    return out

def fails(data_source, solution_str, ground_truth, extra_info=None):
    if data_source == "bad":
        raise KeyError("boom")
    return 1.0

def returns(data_source, solution_str, ground_truth, extra_info):
    return eval(solution_str)

def by_kwargs(**kwargs):
    return 1.0

def too_few(solution_str, ground_truth):
    return 1.0

NOT_A_FUNCTION = 3
"""


@pytest.fixture
def reward_file(tmp_path):
    path = tmp_path / "my_reward.py"
    path.write_text(GOOD)
    return path


def test_default_is_compute_score():
    assert load_reward_function() is compute_score
    assert load_reward_function(None) is compute_score


def test_custom_float_and_dict(reward_file):
    fn = load_reward_function(reward_file)
    scores, extras, n_errors = score_batch(fn, ["a", "a"], ["7 ", "8"], ["7", "7"], [None, None])
    assert scores == [1.0, 0.0] and extras == {} and n_errors == 0

    fn = load_reward_function(str(reward_file), "with_extras")
    scores, extras, n_errors = score_batch(fn, ["a", "b"], ["7", "8"], ["7", "7"], [None, {"i": 1}])
    assert scores == [1.5, 0.5]
    # "pred" is a string, not averaged: dropped. "only_b" is missing for sample 0: 0.0 there
    assert extras == {"acc": [1.0, 0.0], "only_b": [0.0, 1.0]}
    assert n_errors == 0

    assert (
        load_reward_function(reward_file, "by_kwargs")(
            data_source="", solution_str="", ground_truth=""
        )
        == 1.0
    )


def test_custom_file_errors(tmp_path, reward_file):
    """What the user gave and cannot be used is BadInput (the command line prints it alone); an
    error inside their module keeps its traceback, which points into their file."""
    with pytest.raises(BadInput, match="nope.py"):
        load_reward_function(tmp_path / "nope.py")
    (tmp_path / "reward.txt").write_text(GOOD)
    with pytest.raises(BadInput, match="not a .py"):
        load_reward_function(tmp_path / "reward.txt")
    (tmp_path / "broken.py").write_text("import os\nx = 1 / 0\n")
    with pytest.raises(ImportError, match="ZeroDivisionError"):
        load_reward_function(tmp_path / "broken.py")
    with pytest.raises(BadInput) as e:
        load_reward_function(reward_file, "score_it")
    assert (
        "'score_it' (--custom_reward_function_name)" in str(e.value)
        and "'with_extras'" in str(e.value)
        and "'too_few'" in str(e.value)
    )
    with pytest.raises(BadInput, match="not a function"):
        load_reward_function(reward_file, "NOT_A_FUNCTION")
    with pytest.raises(BadInput, match="too_few"):
        load_reward_function(reward_file, "too_few")


def test_score_batch_errors(reward_file):
    fn = load_reward_function(reward_file, "fails")
    response = "The answer is" + " x" * 300
    with pytest.raises(RuntimeError) as e:
        score_batch(fn, ["ok", "bad"], ["fine", response], ["1", "1"], [None, None])
    message = str(e.value)
    assert "sample 1" in message and "'bad'" in message and repr(response[:200]) in message
    assert isinstance(e.value.__cause__, KeyError)

    scores, _, n_errors = score_batch(
        fn, ["bad", "ok", "bad"], ["r"] * 3, ["1"] * 3, [None] * 3, reward_errors="zero"
    )
    assert scores == [0.0, 1.0, 0.0] and n_errors == 2


@pytest.mark.parametrize(
    "returned",
    ["None", "'1.0'", "float('nan')", "{'acc': 1.0}", "{'score': None}", "10**400", "1e39"],
)
def test_score_batch_bad_return(reward_file, returned):
    fn = load_reward_function(reward_file, "returns")
    with pytest.raises(RuntimeError, match="sample 0.*must return a number"):
        score_batch(fn, ["a"], [returned], ["1"], [None])
    scores, extras, n_errors = score_batch(
        fn, ["a", "a"], [returned, "True"], ["1", "1"], [None, None], reward_errors="zero"
    )
    assert scores == [0.0, 1.0] and extras == {} and n_errors == 1


def test_score_batch_builtin():
    scores, _, n_errors = score_batch(
        compute_score, [GSM8K] * 2, ["#### 18", "18"], ["18", "18"], [None] * 2
    )
    assert scores == [1.0, 0.0] and n_errors == 0
    scores, _, _ = score_batch(
        compute_score, [GSM8K] * 2, ["#### 18", "18"], ["18", "18"], [None] * 2, method="flexible"
    )
    assert scores == [1.0, 1.0]


def test_score_batch_accepts_numpy_scalars():
    np = pytest.importorskip("numpy")
    scores, extras, _ = score_batch(
        lambda **kw: {"score": np.float32(0.5), "acc": np.int64(1)}, ["a"], ["r"], ["1"], [None]
    )
    assert scores == [0.5] and extras == {"acc": [1.0]}


def test_pass_at_k_by_hand():
    """Three problems, 4 samples each, with 1, 2 and 0 correct. pass@1 = (1/4 + 2/4 + 0) / 3 = 0.25;
    pass@2 = mean(1 - C(3,2)/C(4,2), 1 - C(2,2)/C(4,2), 0) = (1/2 + 5/6 + 0) / 3 = 4/9;
    pass@4 = (1 + 1 + 0) / 3 = 2/3, the share with any correct."""
    import numpy as np

    correct = np.array([[1, 0, 0, 0], [0, 1, 0, 1], [0, 0, 0, 0]]) > 0
    assert reward.pass_at_k(correct, 1) == pytest.approx(0.25)
    assert reward.pass_at_k(correct, 2) == pytest.approx(4 / 9)
    assert reward.pass_at_k(correct, 4) == pytest.approx(2 / 3)
    assert reward.pass_ks(1) == [] and reward.pass_ks(4) == [1, 2, 4]
    assert reward.pass_ks(5) == [1, 2, 4, 5] and reward.pass_ks(16) == [1, 2, 4, 8, 16]


# (response, ground_truth, score): 1 strict, 0.5 the right last number in another format, else 0
PARTIAL = [
    ("3 + 4 = 7\n#### 7", "7", 1.0),
    ("The answer is \\boxed{7}", "7", 0.5),  # right, not in the asked-for format
    # strict right, the last number wrong: still 1
    (
        "#### 18\nSo she has 3 apples left.",
        "18",
        1.0,
    ),
    ("#### 17\nno: 18", "18", 0.5),  # the marker's number wrong, the last number right
    ("#### 17", "18", 0.0),
    ("The answer is \\boxed{17}", "18", 0.0),
]


@pytest.mark.parametrize("response, truth, score", PARTIAL)
def test_gsm8k_partial_credit_table(response, truth, score):
    out = reward.gsm8k_partial_credit(GSM8K, response, truth)
    assert out == {"score": score, "acc": gsm8k_score(response, truth)}
    assert reward.gsm8k_partial_credit(GSM8K, response, truth, partial=0.2)["score"] == (
        score if score != 0.5 else 0.2
    )


def test_gsm8k_partial_credit_as_a_custom_reward_file():
    """The documented use: reward.py itself as the custom reward file. Other data sources score as
    built in."""
    fn = load_reward_function(reward.__file__, "gsm8k_partial_credit")
    scores, extras, n_errors = score_batch(
        fn,
        [GSM8K, GSM8K, "arith"],
        ["\\boxed{7}", "#### 7", "85, since"],
        ["7", "7", "85"],
        [None] * 3,
    )
    assert scores == [0.5, 1.0, 1.0] and n_errors == 0
    assert extras == {"acc": [0.0, 1.0, 0.0]}  # arith returns a float: no "acc", counted 0


def test_validation_metrics_by_hand():
    nan = float("nan")
    # no flexible scorer
    rows = [
        (
            "a",
            {
                "reward": [1.0, 0.0],
                "reward_flexible": [1.0, 1.0],
                "acc": [1.0, 0.0],
                "fmt": [0.5, 0.5],
            },
            [3, 5],
        ),
        # the reward returned no extras
        (
            "a",
            {"reward": [0.0, 0.0], "reward_flexible": [0.0, 1.0]},
            [4, 4],
        ),
        ("b", {"reward": [1.0, 1.0], "reward_flexible": [nan, nan]}, [2, 2]),
    ]
    assert reward.validation_metrics(rows, 2) == {
        # pass@1 = mean over problems of (right / 2); pass@2: any right
        "val-core/a/reward/mean@2": 0.25,
        "val-core/a/reward/pass@1": 0.25,
        "val-core/a/reward/pass@2": 0.5,
        "val-core/a/reward_flexible/mean@2": 0.75,
        "val-core/a/reward_flexible/pass@1": 0.75,
        "val-core/a/reward_flexible/pass@2": 1.0,
        # "acc" (verl's core score) with pass@k; other extras as val-aux means; a missing extra
        # counts 0
        "val-core/a/acc/mean@2": 0.25,
        "val-core/a/acc/pass@1": 0.25,
        "val-core/a/acc/pass@2": 0.5,
        "val-aux/a/fmt/mean@2": 0.25,
        "val-aux/a/response_length/mean": 4.0,
        "val-core/b/reward/mean@2": 1.0,
        "val-core/b/reward/pass@1": 1.0,
        "val-core/b/reward/pass@2": 1.0,
        "val-aux/b/response_length/mean": 2.0,
    }


# --- reward workers: in parallel, with a time limit ----------------------------------------------

STALLING = """
import os, sys, time
def compute_score(data_source, solution_str, ground_truth, extra_info=None, **kwargs):
    print("a print in the reward function")  # must not reach the outcomes' pipe
    if solution_str == "spin":
        while True:  # pure Python, never returns
            pass
    if solution_str == "sleep":
        time.sleep(3600)
    if solution_str == "exit":
        os._exit(3)
    if solution_str == "raise":
        raise ValueError("no answer")
    if solution_str == "sys.exit":
        sys.exit(0)
    if solution_str == "interrupt":
        raise KeyboardInterrupt
    if solution_str == "slow":
        time.sleep(1.0)
    if solution_str == "pid":
        return {"score": 1.0, "pid": os.getpid()}
    if solution_str == "stdin":  # a subprocess that reads its input would wait for it
        return float(sys.stdin.read() == "")
    if solution_str == "sandbox":  # a process of its own, then a stall
        import subprocess
        child = subprocess.Popen(["sleep", "300"])
        open(ground_truth, "w").write(str(child.pid))
        time.sleep(3600)
    return float(solution_str == ground_truth)
"""


@pytest.fixture
def stalling(tmp_path):
    path = tmp_path / "stalling.py"
    path.write_text(STALLING)
    return path


def alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie (killed, not yet reaped by its parent) counts as gone
        return open(f"/proc/{pid}/stat").read().split()[2] != "Z"
    except FileNotFoundError:
        return False


def test_reward_workers_score_in_parallel_as_in_process(stalling):
    responses, truths = ["7", "8", "x", "7"], ["7", "7", "x", "1"]
    here = score_batch(reward.RewardFunction(stalling), ["a"] * 4, responses, truths, [None] * 4)
    fn = reward.RewardFunction(stalling, workers=4)
    try:
        assert score_batch(fn, ["a"] * 4, responses, truths, [None] * 4) == here
        # 4 calls of 1 s each in 4 workers: about 1 s, not 4
        start = time.monotonic()
        scores, _, _ = score_batch(fn, ["a"] * 4, ["slow"] * 4, ["slow"] * 4, [None] * 4)
        assert scores == [1.0] * 4 and time.monotonic() - start < 3.0
        _, extras, _ = score_batch(fn, ["a"] * 8, ["pid"] * 8, ["1"] * 8, [None] * 8)
        assert {int(p) for p in extras["pid"]} <= {p.pid for p in fn.workers}
    finally:
        fn.close()


def test_a_reward_call_that_stalls_dies_or_raises_is_a_reward_error(stalling, capfd):
    fn = reward.RewardFunction(stalling, workers=2, timeout=1.0)
    try:
        start = time.monotonic()
        responses = ["7", "spin", "exit", "raise", "sleep", "7"]
        scores, _, n_errors = score_batch(
            fn, ["gsm"] * 6, responses, ["7"] * 6, [None] * 6, reward_errors="zero"
        )
        assert scores == [1.0, 0.0, 0.0, 0.0, 0.0, 1.0] and n_errors == 4
        assert time.monotonic() - start < 8.0  # two stalls of 1 s each in parallel workers
        err = capfd.readouterr().err
        label = f"reward function compute_score in {stalling}"
        assert f"{label} did not return within --reward_timeout 1.0 s on sample 1" in err
        assert f"{label} ended its worker process (exit code 3) on sample 2" in err
        assert f"{label} raised ValueError: no answer on sample 3" in err
        assert "(data_source='gsm', response starts 'sleep'); scored 0.0" in err
        assert "a print in the reward function" in err  # the function's prints: on stderr
        # the workers that stalled or died were replaced: the next batch scores as before
        assert score_batch(fn, ["gsm"] * 2, ["7", "8"], ["7", "7"], [None] * 2)[0] == [1.0, 0.0]
        with pytest.raises(RuntimeError) as e:
            score_batch(fn, ["gsm", "math"], ["7", "sleep"], ["7", "7"], [None] * 2)
        assert "did not return within --reward_timeout 1.0 s on sample 1 (data_source='math'" in (
            str(e.value)
        ) and "Pass --reward_errors zero" in str(e.value)
        # an error in a worker names the line of the function that raised it
        with pytest.raises(RuntimeError) as e:
            score_batch(fn, ["gsm"], ["raise"], ["7"], [None])
        assert "(in the worker) Traceback" in str(e.value) and f'File "{stalling}"' in str(e.value)
        pids = [p.pid for p in fn.workers]
    finally:
        fn.close()
    assert not any(alive(p) for p in pids)


def test_a_worker_reads_no_calls_as_input_and_a_timeout_ends_what_it_started(stalling, tmp_path):
    """In a worker the function's stdin is empty (the calls come on another pipe, which user code
    reading its input would otherwise wait on); a call that times out ends with the processes it
    started, which would otherwise outlive it and the run."""
    fn = reward.RewardFunction(stalling, workers=1, timeout=2.0)
    pid_file = tmp_path / "sandbox.pid"
    try:
        assert score_batch(fn, ["a"], ["stdin"], ["7"], [None])[0] == [1.0]
        scores, _, n_errors = score_batch(
            fn, ["a"], ["sandbox"], [str(pid_file)], [None], reward_errors="zero"
        )
        assert scores == [0.0] and n_errors == 1
        sandbox = int(pid_file.read_text())
        deadline = time.monotonic() + 5
        while alive(sandbox) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not alive(sandbox)
    finally:
        fn.close()


def test_a_calls_time_limit_leaves_out_the_workers_import(tmp_path):
    """A reward file that takes 1.5 s to import, calls limited to 1 s: every call after a timeout
    is timed from when the worker that replaced the stalled one has imported it, not from when
    it started (which made every later call time out as well)."""
    path = tmp_path / "slow_import.py"
    path.write_text("import time\ntime.sleep(1.5)\n" + STALLING)
    fn = reward.RewardFunction(path, workers=1, timeout=1.0)
    try:
        for responses in (["7"], ["sleep", "7", "7"]):
            scores, _, n_errors = score_batch(
                fn, ["a"] * len(responses), responses, ["7"] * len(responses),
                [None] * len(responses), reward_errors="zero",
            )  # fmt: skip
            assert n_errors == responses.count("sleep") and scores[-1] == 1.0
    finally:
        fn.close()


def test_a_worker_that_cannot_import_the_file_is_an_error_of_each_sample(tmp_path):
    """A reward file that imports in the trainer and fails in its workers (here: the second import
    of all raises): each sample is an error of a worker that ended, and the batch ends."""
    path = tmp_path / "imports_once.py"
    path.write_text(
        "import os\nMARK = __file__ + '.imported'\n"
        "if os.path.exists(MARK):\n    raise ImportError('only once')\n"
        "open(MARK, 'w').close()\n" + STALLING
    )
    fn = reward.RewardFunction(path, workers=1, timeout=5.0)
    try:
        scores, _, n_errors = score_batch(
            fn, ["a"] * 2, ["7", "7"], ["7", "7"], [None] * 2, reward_errors="zero"
        )
        assert scores == [0.0, 0.0] and n_errors == 2
    finally:
        fn.close()


@pytest.mark.parametrize("workers", [0, 2])
def test_a_reward_that_leaves_is_a_reward_error_and_raise_mode_stops_at_the_first(
    stalling, capfd, workers
):
    """sys.exit() in the function (in this process or a worker), a KeyboardInterrupt raised inside
    a worker: errors of their samples, named, never the end of the run. With --reward_errors raise
    the first failure stops the batch: the stalls after it are never waited for."""
    fn = reward.RewardFunction(stalling, workers=workers, timeout=1.0 if workers else None)
    try:
        responses = ["7", "sys.exit"] + (["interrupt"] if workers else [])
        n = len(responses)
        scores, _, n_errors = score_batch(
            fn, ["gsm"] * n, responses, ["7"] * n, [None] * n, reward_errors="zero"
        )
        assert scores == [1.0] + [0.0] * (n - 1) and n_errors == n - 1
        err = capfd.readouterr().err
        label = f"reward function compute_score in {stalling}"
        assert f"{label} called sys.exit(0) on sample 1" in err
        if workers:
            assert f"{label} raised KeyboardInterrupt:  on sample 2" in err
        stalls = ["slow"] * 6 if not workers else ["sleep"] * 8
        start = time.monotonic()
        with pytest.raises(RuntimeError, match="on sample 0"):
            score_batch(fn, ["gsm"] * 9, ["raise" if not workers else "sleep", *stalls],
                        ["7"] * 9, [None] * 9)  # fmt: skip
        # in this process: no call after the raising one; in workers: one timeout, not four
        assert time.monotonic() - start < (0.5 if not workers else 3.0)
        assert score_batch(fn, ["gsm"] * 2, ["7", "8"], ["7", "7"], [None] * 2)[0] == [1.0, 0.0]
    finally:
        fn.close()


GROUP_SIGNALLED = """
import signal, sys
sys.path.insert(0, {root!r})
import reward
signal.signal(signal.SIGTERM, lambda *a: print("noted", flush=True))  # as the trainer does
fn = reward.RewardFunction({path!r}, workers=2)
print(" ".join(str(p.pid) for p in fn.workers), flush=True)
sys.stdin.readline()
print(reward.score_batch(fn, ["a"] * 2, ["7", "8"], ["7", "7"], [None] * 2)[0], flush=True)
"""


def test_reward_workers_outlive_a_sigterm_to_the_process_group(stalling):
    """`timeout`, torchrun and Slurm signal the trainer's whole process group: the workers are in
    a session of their own, so the SIGTERM is the trainer's to handle; they score on."""
    import pathlib
    import signal
    import subprocess
    import sys

    code = GROUP_SIGNALLED.format(
        root=str(pathlib.Path(reward.__file__).parent), path=str(stalling)
    )
    trainer = subprocess.Popen(
        [sys.executable, "-c", code],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,  # a group of its own to signal, as `timeout` makes
    )
    try:
        pids = [int(p) for p in trainer.stdout.readline().split()]
        os.killpg(trainer.pid, signal.SIGTERM)
        assert trainer.stdout.readline() == "noted\n"
        time.sleep(0.5)
        assert all(alive(p) for p in pids)
        trainer.stdin.write("go\n")
        trainer.stdin.flush()
        assert trainer.stdout.readline() == "[1.0, 0.0]\n"
    finally:
        trainer.kill()
        trainer.wait()
    deadline = time.monotonic() + 5
    while any(alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(alive(p) for p in pids)


KILLED_PARENT = """
import sys, threading, time
sys.path.insert(0, {root!r})
import reward
fn = reward.RewardFunction({path!r}, workers=2, timeout=60)
late = []  # a worker started from another thread: the kernel's signal does not cover it
threading.Thread(target=lambda: late.append(reward.RewardFunction({path!r}, workers=1))).start()
time.sleep(2)
print(" ".join(str(p.pid) for p in fn.workers + late[0].workers), flush=True)
fn.call_all([dict(data_source="a", solution_str="spin", ground_truth="", extra_info=None)])
"""


def test_reward_workers_die_with_a_killed_trainer(stalling):
    """kill -9 of the trainer while a worker spins in a call: no worker outlives it."""
    import pathlib
    import signal
    import subprocess
    import sys

    code = KILLED_PARENT.format(root=str(pathlib.Path(reward.__file__).parent), path=str(stalling))
    parent = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    pids = [int(p) for p in parent.stdout.readline().split()]
    assert len(pids) == 3 and all(alive(p) for p in pids)
    time.sleep(0.5)  # the call is under way
    parent.send_signal(signal.SIGKILL)
    parent.wait()
    deadline = time.monotonic() + 5
    while any(alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(alive(p) for p in pids)


def test_a_message_cut_short_reads_as_a_dead_worker():
    import io
    import pickle
    import struct

    whole = pickle.dumps(("ok", 1.0))
    assert reward._receive(io.BytesIO(struct.pack("<Q", len(whole)) + whole)) == ("ok", 1.0)
    assert reward._receive(io.BytesIO(struct.pack("<Q", len(whole)) + whole[:3])) is None
    assert reward._receive(io.BytesIO(b"\x01\x02")) is None
