"""Rewards: pure `str -> float` scorers, dispatch by `data_source`, loading a user's
`compute_score`, and pass@k over the scores of sampled responses (`validation_metrics`, the val-core
/ val-aux metrics).

A reward function has verl's signature

    compute_score(data_source, solution_str, ground_truth, extra_info=None, **kwargs)
    -> float | dict

and returns a number, or a dict with a numeric "score" plus numeric extras that are logged
(e.g. {"score": 1.0, "acc": 1.0, "format": 0.0}). `RewardFunction` calls it in this process, or in
worker processes with a time limit per call (--reward_workers, --reward_timeout). No torch and no
model calls here.
"""

import ctypes
import importlib.util
import inspect
import math
import numbers
import os
import pickle
import re
import select
import signal
import struct
import subprocess
import sys
import threading
import time
import traceback
from pathlib import Path

import numpy as np

from flags import BadInput

# --- GSM8K. strict gives what verl's verl/utils/reward_score/gsm8k.py gives on every input
# (rewritten) ---
_SOLUTION_CLIP_CHARS = (
    300  # verl only looks at the tail: long regex scans are slow, the answer is at the end
)
_STRICT = re.compile("#### (\\-?[0-9\\.\\,]+)")
_NUMBER = re.compile("(\\-?[0-9\\.\\,]+)")


def gsm8k_extract(solution_str, method="strict"):
    """The final answer in the last 300 characters of a response, or None.

    strict (verl's, the training reward): the number after the last "#### ", without "," and "$".
    flexible (ours, reported in validation next to strict): the last number in any form, without ","
    and "$" and a trailing "." ("costs $1,000." -> "1000"); it is what the model knows, strict is
    what it knows and formats as asked.
    """
    assert method in ("strict", "flexible"), method
    if len(solution_str) > _SOLUTION_CLIP_CHARS:
        solution_str = solution_str[-_SOLUTION_CLIP_CHARS:]
    if method == "strict":
        solutions = _STRICT.findall(solution_str)
        return solutions[-1].replace(",", "").replace("$", "") if solutions else None
    for number in reversed(_NUMBER.findall(solution_str)):
        number = number.replace(",", "").replace("$", "").removesuffix(".")
        if any(c.isdigit() for c in number):  # skips "." and "," that the pattern also matches
            return number
    return None


def gsm8k_score(solution_str, ground_truth, method="strict"):
    """1.0 if the extracted answer equals ground_truth as a string, else 0.0 (verl:
    format_score=0)."""
    answer = gsm8k_extract(solution_str, method)
    return 1.0 if answer is not None and answer == ground_truth else 0.0


def arith_score(solution_str, ground_truth, method="strict"):
    """data/arith.py. strict: 1.0 if the response's first integer is ground_truth (for 85: "85",
    "85, since" and "sum: 85" score, "75", "850" and "47+38=85" do not); flexible: if any integer in
    it is."""
    numbers = re.findall(r"-?[0-9]+", solution_str)
    candidates = numbers[:1] if method == "strict" else numbers
    return 1.0 if ground_truth in candidates else 0.0


# data_source -> scorer(solution_str, ground_truth, method) -> float. A new data set adds one line.
SCORERS = {
    "openai/gsm8k": gsm8k_score,
    "arith": arith_score,
}


def compute_score(data_source, solution_str, ground_truth, extra_info=None, **kwargs):
    """The built-in reward: dispatch on data_source like verl's default_compute_score."""
    scorer = SCORERS.get(data_source)
    if scorer is None:
        raise NotImplementedError(
            f"no reward for data_source={data_source!r}; known: {sorted(SCORERS)}. Add a scorer to "
            "reward.SCORERS, or pass --custom_reward_function_path my_reward.py with a "
            "compute_score(data_source, solution_str, ground_truth, extra_info=None, **kwargs)"
        )
    return scorer(solution_str, ground_truth, method=kwargs.get("method", "strict"))


def gsm8k_partial_credit(
    data_source, solution_str, ground_truth, extra_info=None, partial=0.5, **kwargs
):
    """GSM8K's strict reward, plus `partial` for a right answer in another format; other sources as
    compute_score.

    1.0 for the right number after "#### " (the strict reward), `partial` for the right number only
    as the last one (flexible: "\\boxed{18}", "the answer is 18"), else 0.0. A model that answers in
    its own format scores nothing under the strict reward until it samples "#### "; this one rewards
    right answers from the first step and still prefers the asked-for format within every group.
    "acc" is the strict score, so validation reports strict accuracy as
    val-core/<source>/acc/mean@1. Use it with `--custom_reward_function_path reward.py
    --custom_reward_function_name gsm8k_partial_credit`. On Qwen2.5-Coder-0.5B-Instruct, which
    answers in \\boxed{}, it slowed the switch to "#### " instead of speeding learning up: the right
    \\boxed{} answers took the advantage the rare "#### " ones got under the strict reward
    (docs/benchmarks.md, "Partial credit").
    """
    if data_source != "openai/gsm8k":
        return compute_score(data_source, solution_str, ground_truth, extra_info, **kwargs)
    strict = gsm8k_score(solution_str, ground_truth, "strict")
    score = strict or partial * gsm8k_score(solution_str, ground_truth, "flexible")
    return {"score": score, "acc": strict}


def load_reward_function(path=None, name="compute_score"):
    """The reward function: built-in compute_score when path is None, else `name` from the file at
    path.

    Called at start-up, before any model loads, so a broken file fails in a second, not after an
    hour.
    """
    if path is None:
        return compute_score
    path = Path(path).expanduser()
    if not path.is_file():
        raise BadInput(f"custom reward file {path} does not exist (--custom_reward_function_path)")
    if path.suffix != ".py":
        raise BadInput(
            f"custom reward file {path} is not a .py file (--custom_reward_function_path)"
        )
    module_name = f"custom_reward_{path.stem}"
    spec = importlib.util.spec_from_file_location(module_name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module  # dataclasses and pickling look the module up by name
    try:
        spec.loader.exec_module(module)
    except Exception as e:
        del sys.modules[module_name]
        raise ImportError(
            f"importing custom reward file {path} failed: {type(e).__name__}: {e}"
        ) from e
    if not hasattr(module, name):
        defined = [
            k
            for k, v in vars(module).items()
            if callable(v) and getattr(v, "__module__", None) == module_name
        ]
        raise BadInput(
            f"{path} defines no function {name!r} (--custom_reward_function_name); it defines "
            f"{defined}"
        )
    fn = getattr(module, name)
    if not callable(fn):
        raise BadInput(f"{path}: {name} is a {type(fn).__name__}, not a function")
    try:
        inspect.signature(fn).bind(
            data_source="", solution_str="", ground_truth="", extra_info=None
        )
    except TypeError as e:
        raise BadInput(
            f"{path}: {name}{inspect.signature(fn)} cannot be called as "
            f"{name}(data_source=, solution_str=, ground_truth=, extra_info=): {e}"
        ) from e
    return fn


# --- calling the reward function: in this process, or in workers with a time limit --------------


class RewardFunction:
    """The reward function (`load_reward_function(path, name)`) as a run calls it: `call_all(calls)`
    with one dict of keyword arguments per sample returns one outcome per sample, in order: ("ok",
    value), ("error", "ValueError: ..."), ("timeout", seconds) or ("died", exit code).

    workers=0 calls it here, one sample after the other. workers=N starts N processes (`_serve`:
    a fresh Python that imports this module and the reward file, not the trainer) that score the
    samples in parallel; a call that outlasts `timeout` seconds has its process killed and a new one
    started, so one stuck sample costs `timeout`, not the run (verl's prime reward manager scores in
    a process pool with a timeout too). The workers die with this process, however it ends (killed
    included: the kernel's parent-death signal); `close()` ends them at once.
    """

    def __init__(self, path=None, name="compute_score", workers=0, timeout=None):
        self.fn = load_reward_function(path, name)  # a broken file fails here, in this process
        self.path = None if path is None else os.fspath(path)
        self.name, self.timeout = name, timeout
        self.label = f"{name} in {self.path}" if path else "compute_score (built in)"
        self.lock = threading.Lock()  # validation and a background rollout may score at once
        self.busy = None  # the call in progress, for a SIGTERM's message
        self.workers = [self._start() for _ in range(workers)]
        # workers still importing the function's file: a call's time limit starts once it has
        self.starting = set(range(workers))
        _OPEN.append(self)

    def _start(self):
        here = os.path.dirname(os.path.abspath(__file__))
        # the kernel's parent-death signal follows the thread that started the worker: only the main
        # thread lives as long as this process
        main_thread = threading.current_thread() is threading.main_thread()
        code = (
            f"import sys; sys.path.insert(0, {here!r}); import reward; "
            f"reward._serve({self.path!r}, {self.name!r}, {os.getpid()}, {main_thread})"
        )
        # in a session of its own: a SIGTERM or Ctrl-C to the trainer's process group (from
        # `timeout`, torchrun, Slurm, a terminal) is the trainer's to handle, not the worker's
        return subprocess.Popen(
            [sys.executable, "-c", code],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            start_new_session=True,
        )

    def call_all(self, calls, stop_at_error=False):
        """One outcome per call, in order; `stop_at_error`: from the first call that fails (raises,
        times out, ends its worker) the others are not made, or abandoned, as ("skipped", None)."""
        with self.lock:
            try:
                if self.workers:
                    self.busy = f"calling the reward function {self.label} in {len(self.workers)} "
                    self.busy += f"worker processes on {len(calls)} samples"
                    return self._call_in_workers(calls, stop_at_error)

                def note(i, call):
                    self.busy = (
                        f"calling the reward function {self.label} on sample {i} "
                        f"(data_source={call['data_source']!r})"
                    )

                return _call_each(self.fn, calls, stop_at_error, note)
            finally:
                self.busy = None

    def _call_in_workers(self, calls, stop_at_error=False):
        outcomes, todo = [None] * len(calls), list(range(len(calls)))[::-1]
        busy = {}  # worker index -> (sample index, deadline)
        while todo or busy:
            if stop_at_error and any(o is not None and o[0] != "ok" for o in outcomes):
                for w in busy:  # abandoned mid-call: a fresh worker in its place
                    self._restart(w)
                return [o if o is not None else ("skipped", None) for o in outcomes]
            idle = [w for w in range(len(self.workers)) if w not in busy and w not in self.starting]
            for w in idle:
                if not todo:
                    break
                i = todo.pop()
                try:
                    _send(self.workers[w].stdin, calls[i])
                except (BrokenPipeError, OSError):  # it died between calls
                    outcomes[i] = ("died", self._restart(w))
                    continue
                busy[w] = (i, time.monotonic() + self.timeout if self.timeout else None)
            watched = set(busy) | (self.starting if todo else set())
            if not watched:
                continue
            deadlines = [d for _, d in busy.values() if d is not None]
            wait = max(0.0, min(deadlines) - time.monotonic()) if deadlines else None
            by_fd = {self.workers[w].stdout.fileno(): w for w in watched}
            ready, _, _ = select.select(list(by_fd), [], [], wait)
            for fd in ready:
                w = by_fd[fd]
                if w in self.starting:  # its "ready"; or its end, the error of a sample not sent
                    if _receive(self.workers[w].stdout) is not None:
                        self.starting.discard(w)
                    elif todo:  # (a worker that cannot import the file would be restarted forever)
                        outcomes[todo.pop()] = ("died", self._restart(w))
                    continue
                i, _ = busy.pop(w)
                out = _receive(self.workers[w].stdout)
                outcomes[i] = out if out is not None else ("died", self._restart(w))
            now = time.monotonic()
            for w, (i, deadline) in list(busy.items()):
                if deadline is not None and now >= deadline:
                    del busy[w]
                    self._restart(w)
                    outcomes[i] = ("timeout", self.timeout)
        return outcomes

    def _restart(self, w):
        """End worker w (killed if it still runs) and start another in its place; returns how the
        old one ended (its exit code; negative: the signal)."""
        old = self.workers[w]
        _kill_group(old)
        code = old.wait()
        for f in (old.stdin, old.stdout):
            f.close()
        self.workers[w] = self._start()
        self.starting.add(w)
        return code

    def close(self):
        for p in self.workers:
            _kill_group(p)
        for p in self.workers:
            p.wait()
            for f in (p.stdin, p.stdout):
                f.close()
        self.workers = []


def _kill_group(worker):
    """Kill a worker and what it started (its session's process group: a reward's sandbox or
    subprocess would otherwise outlive the call that timed out, and the run)."""
    try:
        os.killpg(worker.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        worker.kill()


_OPEN = []  # every RewardFunction of this process, for close_all


def close_all():
    """End every reward worker of this process (a run's last act, on every exit path)."""
    while _OPEN:
        _OPEN.pop().close()


def _call_each(fn, calls, stop_at_error, note=None):
    """`_call` on each call in turn (`note(i, call)` before each); with `stop_at_error` none after
    the first that fails, each of those ("skipped", None)."""
    outcomes = []
    for i, call in enumerate(calls):
        if note is not None:
            note(i, call)
        outcomes.append(_call(fn, call))
        if stop_at_error and outcomes[-1][0] != "ok":
            break
    return outcomes + [("skipped", None)] * (len(calls) - len(outcomes))


def _call(fn, kwargs, catch=(Exception, SystemExit)):
    """("ok", what fn returned), or ("error", what it raised, the exception). A call of sys.exit()
    is an error of the sample too: the run must not end in the middle of a step, least of all with
    status 0. A worker catches everything (`_serve`), KeyboardInterrupt included: a Ctrl-C is the
    trainer's, so one inside a worker is the function's own."""
    try:
        return ("ok", fn(**kwargs))
    except catch as e:
        if isinstance(e, SystemExit):
            return ("error", f"called sys.exit({e.code!r})", e)
        return ("error", f"{type(e).__name__}: {e}", e)


def _send(f, obj):
    data = pickle.dumps(obj)
    f.write(struct.pack("<Q", len(data)) + data)
    f.flush()


def _receive(f):
    """One message, or None at the end of the stream (the other side died or closed it)."""
    head = f.read(8)
    if len(head) < 8:
        return None
    size = struct.unpack("<Q", head)[0]
    data = f.read(size)
    return pickle.loads(data) if len(data) == size else None  # cut short: it died mid-message


def _serve(path, name, parent, parent_death_signal):
    """A reward worker's loop: read a call's keyword arguments, call the function, send back the
    outcome; until the trainer closes the pipe. The function's prints go to stderr: stdout carries
    the outcomes. It dies with the trainer, even a killed one: at once by the kernel's parent-death
    signal, or within a second by a thread that watches the parent."""
    if parent_death_signal and sys.platform == "linux":
        ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG

    def watch():
        while os.getppid() == parent:
            time.sleep(1.0)
        os._exit(1)

    threading.Thread(target=watch, daemon=True).start()
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the trainer's to handle
    calls, outcomes = os.fdopen(os.dup(0), "rb"), os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)
    os.dup2(os.open(os.devnull, os.O_RDONLY), 0)  # user code reading stdin reads nothing, not calls
    fn = load_reward_function(path, name)
    _send(outcomes, ("ready",))  # the time limit of its calls starts now
    while (kwargs := _receive(calls)) is not None:
        outcome = _call(fn, kwargs, BaseException)
        if len(outcome) > 2:  # the exception itself may not pickle: its traceback as text
            outcome = (*outcome[:2], "".join(traceback.format_exception(outcome[2])))
        try:
            _send(outcomes, outcome)
        except (pickle.PicklingError, TypeError, AttributeError) as e:
            _send(outcomes, ("error", f"its result cannot be sent back: {type(e).__name__}: {e}"))


FLOAT32_MAX = 3.4028234663852886e38


def _number(x):
    """x as a finite float, or None when it is not a number (bool and numpy scalars count: True
    -> 1.0)."""
    try:  # finite in float32, as the rewards are trained on
        if isinstance(x, numbers.Real) and math.isfinite(x) and abs(x) <= FLOAT32_MAX:
            return float(x)
    except OverflowError:  # an int beyond any float
        pass
    return None


def _where(i, source, response):
    return f"sample {i} (data_source={source!r}, response starts {response[:200]!r})"


def score_batch(
    fn, data_sources, responses, ground_truths, extra_infos, reward_errors="raise", **kwargs
):
    """Score each response with fn(data_source=, solution_str=, ground_truth=, extra_info=,
    **kwargs); fn is a RewardFunction (in workers, with a time limit) or a plain function.

    Returns (scores, extras, n_errors): scores is a list[float]; extras maps each numeric extra key
    that fn returned in a dict to a list[float] over all samples (0.0 where a sample lacks the key,
    so means are over the batch); non-numeric extras (e.g. the extracted answer) are dropped.
    A failing sample (fn raised or called sys.exit, ran out of time, its worker died, or it
    returned None, a string, nan, a dict without a numeric "score"): reward_errors="raise" raises
    RuntimeError naming the sample, its data source and the function, at the first call that
    raises, times out or dies (no call after it is made); "zero" scores it 0.0, counts it in
    n_errors and prints it to stderr (the first 5 of a batch).
    """
    assert reward_errors in ("raise", "zero"), (
        f"reward_errors must be 'raise' or 'zero', not {reward_errors!r}"
    )
    label = getattr(fn, "label", getattr(fn, "__name__", "the reward function"))
    calls = [
        dict(data_source=s, solution_str=r, ground_truth=g, extra_info=e, **kwargs)
        for s, r, g, e in zip(data_sources, responses, ground_truths, extra_infos)
    ]
    stop = reward_errors == "raise"  # the first failure stops the run: no call after it
    if getattr(fn, "call_all", None) is None:
        outcomes = _call_each(fn, calls, stop)
    else:
        outcomes = fn.call_all(calls, stop_at_error=stop)
    scores, rows, n_errors = [], [], 0
    for i, (call, outcome) in enumerate(zip(calls, outcomes)):
        kind, out = outcome[0], outcome[1]
        if kind == "skipped":  # raise mode, after a failure: the loop raises at that one
            scores.append(0.0)
            rows.append({})
            continue
        score = extra = None
        if kind == "ok":
            extra = (
                {k: _number(v) for k, v in out.items() if k != "score"}
                if isinstance(out, dict)
                else {}
            )
            score = _number(out.get("score") if isinstance(out, dict) else out)
        if score is None:
            if kind == "ok":
                what = f"returned {type(out).__name__} {str(out)[:100]!r}"
            elif kind == "error":
                what = out if out.startswith("called sys.exit") else f"raised {out}"
            elif kind == "timeout":
                what = f"did not return within --reward_timeout {out} s"
            else:  # died
                what = f"ended its worker process (exit code {out})"
            where = _where(i, call["data_source"], call["solution_str"])
            message = f"reward function {label} {what} on {where}"
            if kind == "ok":
                message += (
                    "; it must return a number (finite in float32) or a dict with a numeric 'score'"
                )
            if reward_errors == "raise":
                cause = outcome[2] if len(outcome) > 2 else None
                if isinstance(cause, str):  # a worker's: its traceback as text
                    message, cause = f"{message}\n(in the worker) {cause.rstrip()}", None
                raise RuntimeError(
                    f"{message}. Pass --reward_errors zero to score such samples 0.0"
                ) from cause
            if n_errors < 5:
                print(f"{message}; scored 0.0 (--reward_errors zero)", file=sys.stderr, flush=True)
            score, extra, n_errors = 0.0, {}, n_errors + 1
        scores.append(score)
        rows.append({k: v for k, v in extra.items() if v is not None})
    keys = sorted({k for row in rows for k in row})
    extras = {k: [row.get(k, 0.0) for row in rows] for k in keys}
    return scores, extras, n_errors


# --- pass@k of sampled responses (validation with n samples per problem) ---
def pass_ks(n):
    """The k of the pass@k reported for n samples per problem: powers of two below n, and n (none
    for 1)."""
    return sorted({2**i for i in range(n.bit_length()) if 2**i < n} | {n}) if n > 1 else []


def pass_at_k(correct, k):
    """Unbiased pass@k (Chen et al., 2021) from n >= k samples per problem, c of them correct: the
    chance that k of the n, drawn without replacement, include a correct one, 1 - C(n - c, k) / C(n,
    k), averaged over problems. correct: one row of n booleans per problem. pass@n is the share with
    any correct."""
    counts = [sum(map(bool, row)) for row in correct]
    n = len(correct[0])
    return sum(1.0 - math.comb(n - c, k) / math.comb(n, k) for c in counts) / len(counts)


def validation_metrics(rows, n):
    """The metrics of `validate` from one row per problem: (data_source, {score name: its n values},
    response lengths). The names are "reward", "reward_flexible" (NaN where the source has no
    flexible scorer) and the reward function's extras, which a problem lacks where its function
    returned none."""
    metrics = {}
    for source in sorted({r[0] for r in rows}):
        mine = [r for r in rows if r[0] == source]
        for name in dict.fromkeys(key for r in mine for key in r[1]):
            # a missing extra counts 0, as in training
            vals = np.array([r[1].get(name, [0.0] * n) for r in mine])
            if np.isnan(vals).all():
                continue
            core = name in ("reward", "reward_flexible", "acc")
            metrics[f"val-{'core' if core else 'aux'}/{source}/{name}/mean@{n}"] = float(
                vals.mean()
            )
            for k in pass_ks(n) if core else []:
                metrics[f"val-core/{source}/{name}/pass@{k}"] = pass_at_k(vals > 0, k)
        metrics[f"val-aux/{source}/response_length/mean"] = float(
            np.mean([x for r in mine for x in r[2]])
        )
    return metrics
