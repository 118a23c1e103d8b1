"""How a run ends when its reward function misbehaves, on CPU with the tiny model: a reward call
that never returns fails as a reward error after --reward_timeout, under torchrun with 2 processes;
a reward that raises on one rank ends both ranks within seconds, showing that rank's error; a
SIGTERM ends a run stuck in a reward call within --stop_grace_s, naming the phase. The reward
workers themselves: tests/test_reward.py."""

import os
import re
import signal
import subprocess
import sys
import time

import pytest

from tests.test_train_grpo import ROOT, flags, launch, make_assets, metrics_by_step
from tests.tiny_model import free_port


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    return make_assets(tmp_path_factory.mktemp("ending"))


def reward_file(assets, name, body):
    """A reward that scores as the end-to-end tests' and does `body` first."""
    path = assets["tmp"] / f"{name}.py"
    path.write_text(
        "import os, sys, time\n"
        "MARK = __file__ + '.mark'\n"
        "def compute_score(data_source, solution_str, ground_truth, extra_info=None, **kwargs):\n"
        + "".join(f"    {line}\n" for line in body.strip().splitlines())
        + "    return sum(c.isalnum() for c in solution_str) / max(1, len(solution_str))\n"
    )
    return path


def first_call(action):
    """`action` on the first call of the whole run (a file made exclusively marks it)."""
    return f"""
try:
    os.close(os.open(MARK, os.O_CREAT | os.O_EXCL))
except FileExistsError:
    pass
else:
    {action}
"""


def workers_alive(marker):
    """Processes whose command line names `marker` (the reward workers of one run)."""
    out = subprocess.run(["pgrep", "-f", marker], capture_output=True, text=True).stdout
    return out.split()


def test_a_reward_call_that_never_returns_times_out_under_two_ranks(assets):
    """One call of the whole run never returns: with --reward_timeout it scores 0 as a reward
    error, counted at its step, and the run trains its two steps; the workers end with it."""
    path = reward_file(assets, "stalls_once", first_call("time.sleep(3600)"))
    out = assets["tmp"] / "stalls_once_run"
    timeout = ["--reward_workers", "2", "--reward_timeout", "3", "--reward_errors", "zero"]
    args = flags(assets, out, "hf", 2, "disable", "--custom_reward_function_path", str(path))
    proc = launch([*args, *timeout, "--test_freq", "-1"])
    assert proc.returncode == 0, proc.output[-6000:]
    assert (
        f"reward function compute_score in {path} did not return within --reward_timeout 3.0 s"
        in (proc.output)
    )
    m = metrics_by_step(out)
    assert m[1]["reward/errors"] == 1 and m[2]["reward/errors"] == 0
    assert not workers_alive(str(path))


def rank_1_raises_and_both_end(assets):
    """Rank 1's reward raises while rank 0 waits for it in a collective: both end within seconds,
    rank 1's error first in torchrun's summary (with gloo here; tests/gpu/ with NCCL)."""
    raises = """
if os.environ["RANK"] == "1":
    open(MARK, "w").write(str(time.time()))
    raise ValueError("a sample this function cannot read")
"""
    path = reward_file(assets, "raises_on_rank_1", raises)
    out = assets["tmp"] / "raises_on_rank_1_run"
    proc = launch(
        flags(assets, out, "hf", 2, "disable", "--custom_reward_function_path", str(path))
    )
    ended = time.time()
    assert proc.returncode != 0
    raised = float(open(f"{path}.mark").read())
    assert ended - raised < 15, proc.output[-6000:]
    assert (
        f"reward function compute_score in {path} raised ValueError: a sample this function "
        "cannot read on sample 0"
    ) in proc.output, proc.output[-6000:]
    assert "[rank 1] Traceback" in proc.output, proc.output[-6000:]
    assert "[rank 0] stopping: rank 1 failed" in proc.output, proc.output[-6000:]
    # torchrun's summary names rank 1's error as the root cause, not rank 0's closed connection
    root_cause = proc.output.split("Root Cause (first observed failure):")[1].split("exitcode")[0]
    assert re.search(r"rank\s*: 1 ", root_cause), proc.output[-3000:]


def test_a_reward_that_raises_on_one_rank_ends_both_within_seconds(assets):
    rank_1_raises_and_both_end(assets)


def sigterm_in_a_reward_call(assets, name, body, grace, signum=signal.SIGTERM):
    """A run whose first reward call does `body`, signalled (SIGTERM) a second into that call;
    returns its exit status, its output and the seconds from the signal to its end."""
    path = reward_file(assets, name, first_call(body))
    out = assets["tmp"] / f"{name}_run"
    args = flags(assets, out, "hf", 2, "disable", "--custom_reward_function_path", str(path))
    env = {**os.environ, "MASTER_PORT": str(free_port())}
    proc = subprocess.Popen(
        [sys.executable, "train_grpo.py", *args, "--stop_grace_s", str(grace), "--test_freq", "-1"],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    deadline = time.monotonic() + 240
    while not os.path.exists(f"{path}.mark") and proc.poll() is None:
        assert time.monotonic() < deadline
        time.sleep(0.2)
    time.sleep(1.0)  # well inside the call
    signalled = time.monotonic()
    proc.send_signal(signum)
    output = proc.communicate(timeout=60)[0]
    return proc.returncode, output, time.monotonic() - signalled, path, proc.pid


def test_sigterm_ends_a_run_stuck_in_a_reward_call(assets):
    """A reward call that never returns (no time limit), then a SIGTERM: the run ends within
    --stop_grace_s, saying where it was stuck."""
    code, output, took, path, _ = sigterm_in_a_reward_call(assets, "spins", "while True: pass", 3)
    assert took < 3 + 5, output[-6000:]
    assert code == 128 + signal.SIGTERM, output[-6000:]
    assert (
        "a SIGTERM came 3 s ago (--stop_grace_s) and the run is still in phase step > gen, "
        f"calling the reward function compute_score in {path} on sample 0"
    ) in output, output[-6000:]
    assert "--resume_mode auto continues from the last checkpoint" in output


def test_sys_exit_in_user_code_is_not_a_finished_run(assets):
    """sys.exit(0) where the run did not mean to end (here: a reward file that calls it when
    imported) ends it with status 1, saying where, never with status 0."""
    path = assets["tmp"] / "exits_on_import.py"
    path.write_text(
        "import sys\nsys.exit(0)\n"
        "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
        "    return 0.0\n"
    )
    out = assets["tmp"] / "exits_on_import_run"
    args = flags(assets, out, "hf", 2, "disable", "--custom_reward_function_path", str(path))
    env = {**os.environ, "MASTER_PORT": str(free_port())}
    proc = subprocess.run(
        [sys.executable, "train_grpo.py", *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert f"the run ended by sys.exit(0) at {path}:2 before it finished" in proc.stderr


def test_the_stop_deadline_holds_when_the_interpreter_is_stuck_in_c_code(assets):
    """A reward call stuck in C code that keeps the interpreter lock (a regular expression that
    backtracks for hours), then a SIGTERM: the deadline's thread cannot run, so the watchdog
    process ends the run WATCHDOG_AFTER_S after --stop_grace_s."""
    from ending import WATCHDOG_AFTER_S

    stuck = 'import re; re.match(r"(a+)+$", "a" * 40 + "!")'
    code, output, took, _, pid = sigterm_in_a_reward_call(assets, "backtracks", stuck, 2)
    assert 2 + WATCHDOG_AFTER_S - 1 < took < 2 + WATCHDOG_AFTER_S + 5, output[-6000:]
    assert code == -signal.SIGKILL, output[-6000:]
    assert f"[watchdog] process {pid} is still running 7 s after its stop signal" in output


def test_a_child_the_reward_forks_and_terminates_leaves_the_run_alone(assets):
    """A reward that runs code in a forked child and ends it with SIGTERM (a sandbox's time
    limit): the child ends, and the run, which got no SIGTERM, trains on past the watchdog's time
    (a child with the trainer's handler would note the signal and sleep on, and its signal would
    reach the watchdog, which would kill the trainer)."""
    sandbox = (
        "import multiprocessing as mp; p = mp.get_context('fork').Process(target=time.sleep, "
        "args=(60,)); p.start(); time.sleep(0.2); p.terminate(); p.join(5); "
        "assert p.exitcode == -15, p.exitcode; time.sleep(4)"
    )
    path = reward_file(assets, "forks_a_sandbox", first_call(sandbox))
    out = assets["tmp"] / "forks_a_sandbox_run"
    args = flags(assets, out, "hf", 2, "disable", "--custom_reward_function_path", str(path))
    proc = launch([*args, "--stop_grace_s", "0.5", "--test_freq", "-1"], nproc=0)
    assert proc.returncode == 0, proc.output[-6000:]
    assert sorted(metrics_by_step(out)) == [1, 2] and "[watchdog]" not in proc.output


STANDS_DOWN = """
import os, signal, sys, time
sys.path.insert(0, sys.argv[1])
import ending
stop = ending.StopRequest(grace=0.5)
stop.stand_down()  # the run has stopped stepping: it exports
os.kill(os.getpid(), signal.SIGTERM)
time.sleep(0.5 + ending.WATCHDOG_AFTER_S + 1.5)  # a long export
print("exported", flush=True)
"""


def test_after_the_steps_neither_deadline_nor_watchdog_ends_the_run():
    """Once the run has stopped stepping (`StopRequest.stand_down`: it exports its final policy),
    a SIGTERM ends it neither by the deadline nor by the watchdog."""
    proc = subprocess.run(
        [sys.executable, "-c", STANDS_DOWN, ROOT], capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0 and "exported" in proc.stdout, proc.stderr[-3000:]
    assert "[watchdog]" not in proc.stderr


def test_a_sighup_stops_as_a_sigterm_does(assets):
    """A closed terminal's SIGHUP in the middle of step 1 (a reward call of 2 s): the step is
    checkpointed and the run stops, as for a SIGTERM, instead of dying with what it trained."""
    code, output, _, _, _ = sigterm_in_a_reward_call(
        assets, "hangup", "time.sleep(2)", 25, signal.SIGHUP
    )
    assert code == 0, output[-6000:]
    assert "stopped by SIGHUP after step 1 of 2, checkpointed in" in output, output[-3000:]


def test_a_reader_that_goes_away_does_not_end_the_run(assets):
    """The run's output read by `| head`, which stops reading early: the run trains its steps and
    exports, what it can no longer print dropped (it died of a BrokenPipeError at its next line)."""
    out = assets["tmp"] / "headed_run"
    args = flags(assets, out, "hf", 2, "disable", "--test_freq", "-1")
    env = {**os.environ, "MASTER_PORT": str(free_port())}
    proc = subprocess.Popen(
        [sys.executable, "train_grpo.py", *args],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
    )
    proc.stdout.read(100)
    proc.stdout.close()  # as head does once it has its lines
    assert proc.wait(timeout=300) == 0
    assert sorted(metrics_by_step(out)) == [1, 2] and (out / "hf_model").is_dir()
