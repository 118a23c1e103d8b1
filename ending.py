"""How a run ends: early, a SIGTERM checkpoints the step in progress (within a deadline), and a rank
that fails ends every rank within seconds, its error first in torchrun's summary; at the end, the
process's exit status says whether the run finished (`run_to_end`).
"""

import contextlib
import errno
import json
import os
import signal
import subprocess
import sys
import threading
import time
import traceback

import torch
import torch.distributed as dist

import metrics
import reward
import sharding
from flags import BadInput

STOP_SIGNALS = (signal.SIGTERM, signal.SIGHUP)  # a scheduler's or timeout's; a closed terminal's


class StopRequest:
    """SIGTERM, the notice a batch scheduler or `timeout` gives before it kills a job (and SIGHUP, a
    closed terminal's), noted instead of obeyed: the train loop asks `agreed` after each step's
    update, again after its validation and after its checkpoint, and when any rank was signalled
    all of them checkpoint that step and stop, so `--resume_mode auto` continues where the run
    stopped rather than from the last `--save_freq` checkpoint. A run still short of that stop
    `grace` seconds after the first signal (a phase stuck: a reward call that never returns, a rank
    waiting for one that hangs) ends at once, saying where it was (`where()`), before torchrun's
    kill 30 s after its own SIGTERM (`--shutdown-timeout` from torch 2.12) would end it without a
    word. Every later signal is noted the same way (`timeout` signals the workers and torchrun,
    which signals them again); Ctrl-C (SIGINT) still stops at once."""

    def __init__(self, grace=None, where=None):
        self.signalled, self.grace, self.where, self.signum = False, grace, where, None
        self.finished = threading.Event()  # the run has stopped: the deadline stands down
        # where Python runs signal handlers
        if threading.current_thread() is threading.main_thread():
            for signum in STOP_SIGNALS:
                signal.signal(signum, self._note)
            if grace is not None:
                watchdog(grace + WATCHDOG_AFTER_S)
            if not _plain_child.registered:
                os.register_at_fork(after_in_child=_plain_child)
                _plain_child.registered = True

    def _note(self, signum, frame):
        if not self.signalled and self.grace is not None:
            threading.Thread(target=self._deadline, daemon=True, name="sigterm_deadline").start()
        self.signum = self.signum or signum
        self.signalled = True

    @property
    def name(self):
        """The stop's signal, by name (the first, where several came)."""
        return signal.Signals(self.signum or signal.SIGTERM).name

    def _deadline(self):
        if self.finished.wait(self.grace):
            return
        where = self.where() if self.where else "a phase"
        why = f"a {self.name} came {self.grace:g} s ago (--stop_grace_s) and the run is still in "
        why += where
        print(
            f"[rank {sharding.rank()}] {why}: ending now, without checkpointing this step; the "
            "same command with --resume_mode auto continues from the last checkpoint",
            file=sys.stderr,
            flush=True,
        )
        tell_peers(f"rank {sharding.rank()} ended: {why}")  # ranks waiting for this one end too
        reward.close_all()
        os._exit(128 + (self.signum or signal.SIGTERM))

    def stand_down(self):
        """The run has stopped stepping (it exports, or says where it stopped): no deadline, no
        watchdog, for a SIGTERM from here on."""
        self.finished.set()
        if WATCHDOG_PIPE:
            os.write(WATCHDOG_PIPE[0], bytes([0]))

    def agreed(self, device) -> bool:
        """Whether any rank has been signalled (a collective: every rank calls it at the same
        point)."""
        flag = torch.tensor([float(self.signalled)], device=device)
        if dist.is_initialized():
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())


def _plain_child():
    """In a process forked from the trainer (user code's multiprocessing, a sandbox): SIGTERM ends
    it, as it would have ended the process it copies before the run took the signal over, and
    its signals reach no watchdog, which would take them for the trainer's."""
    if threading.current_thread() is threading.main_thread():
        for signum in STOP_SIGNALS:
            signal.signal(signum, signal.SIG_DFL)
        signal.set_wakeup_fd(-1)


_plain_child.registered = False

# how long after --stop_grace_s the watchdog ends a run whose interpreter is stuck (the deadline's
# thread, which says where the run was, goes first when Python still runs)
WATCHDOG_AFTER_S = 5.0

WATCHDOG = r"""
import os, select, signal, sys, time
signal.signal(signal.SIGTERM, signal.SIG_IGN)
signal.signal(signal.SIGINT, signal.SIG_IGN)
pid, wait = int(sys.argv[1]), float(sys.argv[2])
while True:  # the numbers of the signals the trainer caught; 0: it stands down; nothing: it ended
    got = os.read(0, 512)
    if not got or 0 in got:
        sys.exit(0)
    if signal.SIGTERM in got or signal.SIGHUP in got:
        break
deadline = time.monotonic() + wait
while (left := deadline - time.monotonic()) > 0:
    if select.select([0], [], [], left)[0] and ((got := os.read(0, 512)) == b"" or 0 in got):
        sys.exit(0)  # it ended, or stood down, in time
print(f"[watchdog] process {pid} is still running {wait:g} s after its stop signal and does not "
      "respond (its interpreter is stuck, in C code that holds it): killed. The same command "
      "with --resume_mode auto continues from the last checkpoint", file=sys.stderr, flush=True)
os.kill(pid, signal.SIGKILL)
"""


WATCHDOG_PIPE = []  # this process's end of the watchdog's pipe, once it has one


def watchdog(seconds):
    """A small process that kills this one `seconds` after its first SIGTERM when it is still
    running: the stop's deadline even when this interpreter cannot run its own (a reward function
    stuck in C code that holds the interpreter lock, such as a regular expression that
    backtracks for hours, keeps Python's signal handlers and threads from running). It learns of
    the signal from the signal's C-level handler, which writes the signal's number to a pipe
    (`signal.set_wakeup_fd`) without the interpreter, and of this process's end from the pipe
    closing; it ignores the group signals that reach it, in a session of its own."""
    read, write = os.pipe()
    os.set_blocking(write, False)
    signal.set_wakeup_fd(write, warn_on_full_buffer=False)
    WATCHDOG_PIPE[:] = [write]
    subprocess.Popen(
        [sys.executable, "-c", WATCHDOG, str(os.getpid()), str(seconds)],
        stdin=read,
        start_new_session=True,
    )
    os.close(read)


class Unbroken:
    """stdout or stderr as the run writes them, whose reader going away (`| head`, a terminal hung
    up) does not end the run: what can no longer be written is dropped."""

    def __init__(self, stream):
        self.stream, self.broken = stream, False

    def _guarded(self, call, *args):
        if not self.broken:
            try:
                return call(*args)
            except OSError as error:
                if not isinstance(error, BrokenPipeError) and error.errno != errno.EIO:
                    raise
                self.broken = True

    def write(self, text):
        self._guarded(self.stream.write, text)
        return len(text)

    def flush(self):
        self._guarded(self.stream.flush)

    def __getattr__(self, name):
        return getattr(self.stream, name)


FAILED = "run/failed"  # the key in the process group's store that the first failed rank writes


# how long a rank that ends for another's failure waits before it exits: torchrun names the failure
# it saw first, by the whole second, so the failed rank's comes first in its summary
AFTER_PEER_FAILURE_S = 2.0


finished = threading.Event()  # this process's run ended: its peers' watch stands down


def watch_peers(interval=1.0):
    """End this process within `interval` + AFTER_PEER_FAILURE_S seconds of another rank's failure
    (`fail`). Without it the others wait for the failed rank in a collective that never completes:
    NCCL until its 10-minute timeout, gloo wherever its peers' sockets stay open."""
    store = dist.distributed_c10d._get_default_store()

    def watch():
        while not finished.wait(interval):
            try:
                failed = store.check([FAILED])
            except Exception:  # the store's host has ended (the launcher or rank 0): so do we
                failed = not finished.is_set()
            if failed and not finished.is_set():
                try:
                    why = store.get(FAILED).decode()
                except Exception:
                    why = "the process group's store is gone: another process has ended"
                print(f"[rank {dist.get_rank()}] stopping: {why}", file=sys.stderr, flush=True)
                reward.close_all()
                time.sleep(AFTER_PEER_FAILURE_S)
                os._exit(1)

    threading.Thread(target=watch, daemon=True, name="watch_peers").start()


def tell_peers(message):
    """Write why this rank ends into the store, for the others' `watch_peers`; returns the message
    the store holds, another rank's when that one ended first (or None without a store)."""
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return None
    try:
        store = dist.distributed_c10d._get_default_store()
        return store.compare_set(FAILED, "", message[:4000]).decode()
    except Exception:
        return None


def fail(error):
    """This rank failed: show its error, tell the other ranks through the store (`watch_peers`),
    record it for torchrun's summary, end the process at once. Never a barrier: the other ranks may
    be waiting in another collective for this one. A rank that fails because another one did first
    (gloo's "Connection closed by peer") says so in a line and leaves torchrun's summary to that
    rank's error."""
    rank = dist.get_rank()
    why = str(error.code) if isinstance(error, SystemExit) else f"{type(error).__name__}: {error}"
    mine = f"rank {rank} failed: {why}"
    first = tell_peers(mine)
    if first is not None and first != mine[:4000]:
        print(f"[rank {rank}] stopping: {first}", file=sys.stderr, flush=True)
        time.sleep(AFTER_PEER_FAILURE_S)
    else:
        if isinstance(error, SystemExit):  # a refused flag or file (`need`): the message says it
            print(why, file=sys.stderr)
        else:
            text = "".join(traceback.format_exception(error))
            print(f"[rank {rank}] {text}", file=sys.stderr, end="")
        record_for_torchrun(error, stack=not isinstance(error, SystemExit))
    sys.stdout.flush()
    sys.stderr.flush()
    reward.close_all()
    os._exit(1)


def record_for_torchrun(error, stack=True):
    """Under torchrun, `error` as this process's failure in torchrun's summary ("Root Cause"),
    which would otherwise say only `error_file: <N/A>`: the error file torchrun reads (its
    ErrorHandler's format), with the traceback, or (`stack` false, for a refused input whose
    message says it all) the message alone."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return
    text = "".join(traceback.format_exception(error)) if stack else f"{error}\n"
    record = {"message": f"{type(error).__name__}: {error}"}
    record["extraInfo"] = {"py_callstack": text, "timestamp": str(int(time.time()))}
    with contextlib.suppress(OSError), open(path, "w") as f:
        json.dump({"message": record}, f)


def out_of_memory_note():
    """What to do when the GPU ran out of memory, and in which phase (torch's error follows)."""
    where = " > ".join(metrics.OUT_OF_MEMORY_IN) or "start-up or between two phases"
    return (
        f"{os.path.basename(sys.argv[0])}: out of GPU memory in {where}. The plan printed at "
        "start-up gave each phase its share (--print_plan shows it; metrics.jsonl has "
        "perf/planned_memory_gb/<phase> beside the measured perf/max_memory_allocated_gb/<phase>). "
        "Where other processes hold part of this GPU, give the run what is left with "
        "--gpu_memory_gib; else lower --ppo_max_token_len_per_gpu or "
        "--log_prob_max_token_len_per_gpu, or turn on --use_fused_kernels, "
        "--enable_gradient_checkpointing, --ref_param_offload or --optimizer_offload (README, "
        "Troubleshooting)."
    )


def run_to_end(main, args):
    """Run a train script's `main(args)` and end the process: a finished run with status 0 and
    without the interpreter's teardown; a refused input (`flags.BadInput`) in its line; running
    out of GPU memory with `out_of_memory_note` before torch's error; a sys.exit() from somewhere
    the run did not mean to end as a failure; any failure with more than one rank through `fail`,
    which ends every rank."""
    try:
        main(args)
    except BaseException as error:
        if isinstance(error, BadInput):  # its message names the input and what to do
            error = SystemExit(f"{os.path.basename(sys.argv[0])}: {error}")
        if isinstance(error, torch.OutOfMemoryError):
            print(out_of_memory_note(), file=sys.stderr, flush=True)
        clean = isinstance(error, SystemExit) and error.code in (0, None)
        if clean and not finished.is_set():
            # sys.exit() from somewhere the run did not mean to end (user code, a library): not
            # a finished run, so not status 0 (--print_plan's exit is one: it sets `finished`)
            frame = traceback.extract_tb(error.__traceback__)[-1]
            error = SystemExit(
                f"{os.path.basename(sys.argv[0])}: the run ended by sys.exit({error.code!r}) at "
                f"{frame.filename}:{frame.lineno} before it finished; the same command with "
                "--resume_mode auto continues from the last checkpoint"
            )
            clean = False
        if not clean and dist.is_initialized() and dist.get_world_size() > 1:
            fail(error)  # ends the process
        if not clean:
            record_for_torchrun(error, stack=not isinstance(error, SystemExit))
        reward.close_all()
        raise error from error.__cause__  # its cause kept: a reward's error points into its file
    finished.set()
    reward.close_all()
    if dist.is_initialized():
        dist.barrier()
    # A finished run has written everything (metrics, checkpoints, the export) and closed its
    # loggers. It ends without the interpreter's teardown, which shuts vLLM's engine down and
    # collects what it held: 4-6 s per process on CPU, for nothing. An EnginePool's engines exit
    # when their pipes close.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
