"""What a step logs and where: each phase's time and peak memory (`Timer`), throughput and MFU,
and the loggers (console, jsonl, wandb, tensorboard), metrics.jsonl kept whole across crashes.
"""

import contextlib
import json
import os
import threading
import time
from dataclasses import asdict

import torch
from tqdm import tqdm

import sharding
from checkpoint import free_name
from flags import loggers, need

IMPORTED = time.time()


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


PHASES = []  # the main thread's phases in progress, outermost first: what a stuck run is doing
OUT_OF_MEMORY_IN = []  # the phases the GPU ran out of memory in, outermost first


class Timer:
    """`with timer("gen"):` adds the seconds spent inside to metrics["timing_s/gen"] (nestable), and
    on a GPU the phase's peak memory to metrics["perf/max_memory_allocated_gb/gen"] (innermost
    phases only).

    torch counts a sleeping engine's pool as allocated though the engine has released its memory, so
    a phase that starts and ends with the engine asleep subtracts it: the peak is what the GPU
    held."""

    # --warm_compile_caches' eager first step: each phase starts with the memory torch's allocator
    # caches given back, so that one phase's large blocks are not split by the next one's tensors
    release_cache = False

    def __init__(self, metrics, device, engine=None):
        self.metrics, self.device, self.engine = metrics, device, engine
        self.inner_done = False  # a phase nested in the current one has recorded its peak

    @contextlib.contextmanager
    def __call__(self, name):
        sync(self.device)
        cuda = self.device.type == "cuda"
        if cuda and Timer.release_cache:
            torch.cuda.empty_cache()
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        unbacked = self.engine.unbacked_bytes() if self.engine is not None else 0
        self.inner_done = False
        main = threading.current_thread() is threading.main_thread()
        PHASES.append(name) if main else None
        t0 = time.perf_counter()
        try:
            yield
        except torch.OutOfMemoryError:
            if main and not OUT_OF_MEMORY_IN:  # the innermost phase it left
                OUT_OF_MEMORY_IN.extend(PHASES)
            raise
        finally:
            PHASES.pop() if main else None
        sync(self.device)
        key = f"timing_s/{name}"
        self.metrics[key] = self.metrics.get(key, 0.0) + time.perf_counter() - t0
        if self.engine is not None and self.engine.unbacked_bytes() != unbacked:
            unbacked = 0  # the engine woke or slept inside the phase: its peak may include the pool
        if cuda and not self.inner_done:  # an outer phase's peak was reset by its inner phases
            key = f"perf/max_memory_allocated_gb/{name}"
            peak = (torch.cuda.max_memory_allocated() - unbacked) / 2**30
            self.metrics[key] = max(self.metrics.get(key, 0.0), peak)
        self.inner_done = True


def check_logins(args):
    """A logger that needs an account has one before anything loads, not at the first step's log
    line: wandb's own check of its key (WANDB_API_KEY, `wandb login`'s), unless it logs offline
    (WANDB_MODE=offline or disabled). On a terminal with no key, wandb asks there, as it would at
    the first step; without one, the run is refused."""
    offline = os.environ.get("WANDB_MODE", "").lower() in ("offline", "dryrun", "disabled")
    if offline or "wandb" not in loggers(args):
        return
    import wandb

    try:
        wandb.login(verify=False)
    except Exception as error:  # wandb's UsageError, AuthenticationError
        need(
            False,
            f"--logger wandb: {error} Or set WANDB_API_KEY; or keep the run's wandb files on "
            "this machine with WANDB_MODE=offline (wandb sync sends them later)",
        )


class Logger:
    """Rank 0 only: console line per step (verl's format), jsonl, wandb, tensorboard."""

    def __init__(self, args, out_dir, flags=None, name="metrics.jsonl"):
        """`flags`: the run's flags for wandb's config (`Run.flags`; default: asdict(args)); `name`:
        the jsonl file's."""
        self.kinds = loggers(args)
        self.on = sharding.rank() == 0
        self.path, self.wandb, self.tb = os.path.join(out_dir, name), None, None
        if not self.on:
            return
        os.makedirs(out_dir, exist_ok=True)
        if "wandb" in self.kinds:
            import wandb

            self.wandb = wandb.init(  # its files (an offline run's too) beside metrics.jsonl
                project=args.project_name,
                name=args.experiment_name,
                config=flags or asdict(args),
                dir=out_dir,
            )
        if "tensorboard" in self.kinds:
            from torch.utils.tensorboard import SummaryWriter

            self.tb = SummaryWriter(os.path.join(out_dir, "tensorboard"))

    def resume(self, step, last_row=None):
        """metrics.jsonl as the run goes on from `step` (rank 0; `repair_metrics`)."""
        if self.on and "jsonl" in self.kinds:
            repair_metrics(self.path, step, last_row)

    def log(self, metrics, step):
        if not self.on:
            return
        if "console" in self.kinds:
            tqdm.write(
                f"step:{step} - "
                + " - ".join(
                    f"{k}:{v:.4g}" if isinstance(v, float) else f"{k}:{v}"
                    for k, v in sorted(metrics.items())
                )
            )
        if "jsonl" in self.kinds:
            with open(self.path, "a") as f:
                f.write(json.dumps({"step": step, **metrics}) + "\n")
        if self.wandb:
            self.wandb.log(metrics, step=step)
        if self.tb:
            for k, v in metrics.items():
                self.tb.add_scalar(k, v, step)

    def close(self):
        """Finish the wandb run and write tensorboard's pending events: a finished run ends without
        the interpreter's exit hooks (the end of this file)."""
        if self.wandb:
            self.wandb.finish()
        if self.tb:
            self.tb.close()


def repair_metrics(path, step, last_row=None):
    """Make metrics.jsonl hold one row per step up to `step`, where a run goes on from (0: afresh).

    Afresh, an earlier run's file is kept as metrics.jsonl.N (the first free N), not erased.
    Resumed, the rows after `step` go (the run trains those steps again), so does a torn last row (a
    crash in the middle of writing it), and `last_row`, the row the checkpoint of `step` kept, is
    written again when the crash came between the checkpoint and its row. A row that cannot be read
    elsewhere in the file stops the run, naming the file and the line."""
    if not os.path.exists(path):
        rows = []
    elif step == 0:
        if os.path.getsize(path):
            kept = free_name(path)
            os.replace(path, kept)
            print(f"{path} held an earlier run's metrics: kept as {kept}", flush=True)
        return
    else:
        with open(path) as f:
            lines = f.read().splitlines()
        rows = []
        for i, line in enumerate(lines, 1):
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as e:
                if i < len(lines):
                    need(
                        False, f"{path} line {i} is not a JSON row ({e}): mend or delete that line"
                    )
                print(f"{path}: dropped its torn last line {i} (a crash while it was written)")
                continue
            need(
                isinstance(rows[-1], dict) and isinstance(rows[-1].get("step"), int),
                f"{path} line {i} is not a step's row (no integer 'step'): mend or delete it",
            )
        rows = [row for row in rows if row["step"] <= step]
    if last_row is not None and not any(row["step"] == step for row in rows):
        rows.append(last_row)
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path + ".tmp", "w") as f:
        f.writelines(json.dumps(row) + "\n" for row in rows)
    os.replace(path + ".tmp", path)


def flops_per_token(config, seq_len):
    """Forward FLOPs per token: 2 x the parameters a token is multiplied through (the lm_head once,
    the embedding lookup never, so tied and untied models count alike) + attention scores and
    values, 2 * 2 * layers * seq_len * heads * head_dim, halved for causal masking."""
    h, L, V = config.hidden_size, config.num_hidden_layers, config.vocab_size
    hd = getattr(config, "head_dim", None) or h // config.num_attention_heads
    q, kv = config.num_attention_heads * hd, config.num_key_value_heads * hd
    per_layer = h * (q + 2 * kv) + q * h + 3 * h * config.intermediate_size
    return 2 * (L * per_layer + V * h) + 2 * L * seq_len * q


def forward_flops(config, seq_len, tokens, response_tokens, value=False):
    """One forward pass's FLOPs over `tokens` tokens of sequences `seq_len` long on average: the
    body at every token; a causal LM's output layer (2 V h a token) only at the `response_tokens`
    positions where it is applied, a value model's head (2 h: one score) at every token."""
    head = 2 * config.vocab_size * config.hidden_size
    body = tokens * (flops_per_token(config, seq_len) - head)
    return body + (tokens * 2 * config.hidden_size if value else response_tokens * head)


def phase_perf(t, work, peak_flops, push_bytes):
    """Achieved TFLOP/s and MFU of the phases that ran (`t`: their timing_s/*), from `work`:
    {phase: (its name in perf/tflops/<name> and perf/mfu/<name>, its FLOPs)}. Weight sync in
    GB/s."""
    out = {"perf/peak_tflops": peak_flops / 1e12}
    for phase, (name, flops) in work.items():
        if f"timing_s/{phase}" in t:
            rate = flops / t[f"timing_s/{phase}"]
            out |= {f"perf/tflops/{name}": rate / 1e12, f"perf/mfu/{name}": rate / peak_flops}
    if "timing_s/update_weights" in t:
        out["perf/weight_sync_gb_s"] = push_bytes / t["timing_s/update_weights"] / 1e9
    return out


def seconds_since_launch():
    """Wall-clock seconds since this process started (Linux: /proc; elsewhere: since this script was
    imported, which misses the imports of torch and transformers)."""
    try:
        with open("/proc/self/stat") as f:
            start_ticks = int(f.read().rsplit(")", 1)[1].split()[19])  # field 22, starttime
        return time.clock_gettime(time.CLOCK_BOOTTIME) - start_ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, AttributeError):
        return time.time() - IMPORTED


def measure_peak_flops(device):
    """Measured dense matmul rate (FLOP/s) of this device: the MFU denominator."""
    n, dtype = (8192, torch.bfloat16) if device.type == "cuda" else (512, torch.float32)
    a, b = (
        torch.randn(n, n, device=device, dtype=dtype),
        torch.randn(n, n, device=device, dtype=dtype),
    )
    for _ in range(3):
        a @ b
    sync(device)
    t, iters = time.perf_counter(), 20
    for _ in range(iters):
        a @ b
    sync(device)
    return 2 * n**3 * iters / (time.perf_counter() - t)
