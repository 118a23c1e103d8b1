"""Checkpoints and the final export: sharded, atomic, in verl's layout, loadable at another world
size; the policy as a Hugging Face folder that transformers and vLLM load.

`save_checkpoint` / `load_checkpoint` use torch.distributed.checkpoint, written to a temporary
folder and renamed, so a crash mid-save leaves the last good checkpoint as it was. Folders follow
verl's layout: `global_step_{N}` plus the tracker file `latest_checkpointed_iteration.txt`. A save
that fails (a full disk) removes its half-written folder and says what to do. `export_hf` writes
the final policy. All ranks call these (they are collectives); only rank 0 writes shared files. The
folder must be on a file system every rank sees (any single node; NFS or similar across nodes).
"""

import contextlib
import errno
import json
import os
import re
import shutil

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from sharding import barrier, iter_full_tensors, rank

TRACKER = "latest_checkpointed_iteration.txt"  # verl's name for "which global_step_N is the latest"


def _step_of(folder: str) -> int | None:
    m = re.fullmatch(r"global_step_(\d+)", folder)
    return int(m.group(1)) if m else None


def list_checkpoints(root: str) -> list[int]:
    """Steps of the complete checkpoints under `root` (a `global_step_N` with its marker),
    sorted."""
    if not os.path.isdir(root):
        return []
    steps = [_step_of(f) for f in os.listdir(root)]
    done = lambda s: os.path.exists(os.path.join(root, f"global_step_{s}", "COMPLETE"))  # noqa: E731
    return sorted(s for s in steps if s is not None and done(s))


def latest_checkpoint(root: str) -> str | None:
    """The newest complete checkpoint folder under `root`, or None."""
    steps = list_checkpoints(root)
    return os.path.join(root, f"global_step_{steps[-1]}") if steps else None


def free_name(base: str, start: int = 1) -> str:
    """`base.N` for the first N from `start` that names nothing yet (N = 0: `base` itself), for a
    file or folder kept beside the one that takes its place."""
    names = (f"{base}.{i}" if i else base for i in range(start, 10**6))
    return next(name for name in names if not os.path.exists(name))


def set_aside_later(root: str, step: int) -> None:
    """A run resumed from an earlier checkpoint of its folder (--resume_mode PATH) trains another
    branch: the later checkpoints there are the old branch's, which `--resume_mode auto` would take
    for this one's. They are kept as `global_step_N.abandoned`."""
    for later in [s for s in list_checkpoints(root) if s > step]:
        folder = os.path.join(root, f"global_step_{later}")
        aside = free_name(f"{folder}.abandoned", start=0)
        os.replace(folder, aside)
        print(f"{folder} is a later step of the branch resumed from: kept as {aside}", flush=True)


def save_checkpoint(
    root: str,
    step: int,
    models: dict[str, torch.nn.Module],
    optimizers: dict[str, torch.optim.Optimizer] | None = None,
    schedulers: dict | None = None,
    trainer_state: dict | None = None,
    keep_last: int | None = None,
) -> str:
    """Save a sharded checkpoint as `root/global_step_{step}`, atomically.

    `models` / `optimizers` / `schedulers` are keyed by role ("actor", "critic", ...). Every rank
    writes its shards into `root/.tmp_global_step_{step}`; then rank 0 writes the trainer state
    (JSON: step, data position, ...) and the schedulers, marks the folder COMPLETE and renames it.
    A folder without the marker is never loaded. Keeps the newest `keep_last` checkpoints.
    No random number generator's state is kept: nothing in a step draws from one (the engines seed
    each generation from the seed, step and round, the data order from the seed and epoch), so a
    resumed run replays an uninterrupted one without it (tests/test_train_grpo.py).
    """
    final = os.path.join(root, f"global_step_{step}")
    tmp = os.path.join(root, f".tmp_global_step_{step}")
    if rank() == 0:
        os.makedirs(root, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)  # left by a save that died
        os.makedirs(tmp)
    barrier()
    state = {f"model.{k}": get_model_state_dict(m) for k, m in models.items()}
    for k, opt in (optimizers or {}).items():
        state[f"optim.{k}"] = get_optimizer_state_dict(models[k], opt)
    with _writing(tmp, root, f"checkpoint {final}"):
        dcp.save(state, checkpoint_id=tmp)
    barrier()
    if rank() == 0:
        with _writing(tmp, root, f"checkpoint {final}"):
            extra = {"schedulers": {k: s.state_dict() for k, s in (schedulers or {}).items()}}
            torch.save(extra, os.path.join(tmp, "schedulers.pt"))
            with open(os.path.join(tmp, "trainer_state.json"), "w") as f:
                json.dump(
                    {
                        "global_step": step,
                        "world_size": dist.get_world_size() if dist.is_initialized() else 1,
                        **(trainer_state or {}),
                    },
                    f,
                    indent=1,
                )
            open(os.path.join(tmp, "COMPLETE"), "w").close()
        if os.path.exists(final):
            shutil.rmtree(final)
        os.replace(tmp, final)
        tracker_tmp = os.path.join(root, TRACKER + ".tmp")
        with open(tracker_tmp, "w") as f:
            f.write(str(step))
        os.replace(tracker_tmp, os.path.join(root, TRACKER))
        if keep_last:
            for old in list_checkpoints(root)[:-keep_last]:
                shutil.rmtree(os.path.join(root, f"global_step_{old}"), ignore_errors=True)
    barrier()
    return final


# how torch's writers report a full disk without ENOSPC
FULL_DISK = ("No space left", "unexpected pos", "file write failed")


def causes(error, most=16):
    """`error`, its causes and contexts, and the per-rank failures a CheckpointException holds."""
    out, todo = [], [error]
    while todo and len(out) < most:
        e = todo.pop()
        if not isinstance(e, BaseException) or any(e is seen for seen in out):
            continue
        out.append(e)
        todo += [e.__cause__, e.__context__]
        for failure in getattr(e, "failures", {}).values():  # dcp: rank -> (exception, trace)
            todo += list(failure) if isinstance(failure, (list, tuple)) else [failure]
    return out


@contextlib.contextmanager
def _writing(tmp, root, what):
    """A write into the folder `tmp` that becomes `what`: when it fails, the half-written folder
    goes and the error says why, a full disk by name (torch's writers report one as "unexpected pos
    704 vs 598" or "file write failed"), and what to do."""
    try:
        yield
    # the checkpoint library's own error is a BaseException, not an Exception
    except (Exception, dcp.api.CheckpointException) as error:
        try:  # measured before the half-written folder goes, which frees what it took
            free = shutil.disk_usage(root).free
        except OSError:
            free = None
        shutil.rmtree(tmp, ignore_errors=True)
        chain = causes(error)
        full = any(getattr(e, "errno", None) == errno.ENOSPC for e in chain)
        full = full or any(hint in str(e) for e in chain for hint in FULL_DISK)
        full = full or (free is not None and free < 256 * 2**20)
        why = (
            f"the disk holding {root} is full ({free / 2**20:.0f} MiB free)"
            if full and free is not None
            else "the disk is full"
            if full
            else f"{type(error).__name__}: {error}"
        )
        latest = latest_checkpoint(root) if os.path.isdir(root) else None
        kept = (
            f"the last checkpoint, {latest}, is untouched"
            if latest
            else "no checkpoint holds the steps trained so far (the same command trains them "
            "again; --save_freq N checkpoints every N steps)"
        )
        raise OSError(
            errno.ENOSPC if full else errno.EIO,
            f"writing {what} failed: {why}. The half-written folder is removed and {kept}. Free "
            "space (--keep_last_checkpoints N keeps fewer checkpoints) and run the same command "
            "with --resume_mode auto",
        ) from error


class CheckpointError(Exception):
    """A checkpoint that cannot be read: the message names it and what failed."""


def load_checkpoint(
    path: str,
    models: dict[str, torch.nn.Module],
    optimizers: dict[str, torch.optim.Optimizer] | None = None,
    schedulers: dict | None = None,
) -> dict:
    """Load a checkpoint written by `save_checkpoint` (at any world size); returns the trainer
    state. One that cannot be read (truncated, damaged, of other models) raises CheckpointError;
    what it loaded so far is overwritten by the next checkpoint loaded."""
    if not os.path.exists(os.path.join(path, "COMPLETE")):
        raise FileNotFoundError(
            f"{path} is not a complete checkpoint (no COMPLETE marker); pick another "
            f"global_step_N or start fresh with --resume_mode disable"
        )
    try:  # the small files first: a damaged one fails before any weight is touched
        with open(os.path.join(path, "trainer_state.json")) as f:
            trainer_state = json.load(f)
        extra = torch.load(os.path.join(path, "schedulers.pt"), weights_only=False)
        state = {f"model.{k}": get_model_state_dict(m) for k, m in models.items()}
        for k, opt in (optimizers or {}).items():
            state[f"optim.{k}"] = get_optimizer_state_dict(models[k], opt)
        dcp.load(state, checkpoint_id=path)
    # the reader's own message rarely names the checkpoint (and dcp's error is a BaseException)
    except (Exception, dcp.api.CheckpointException) as e:
        raise CheckpointError(f"{path} cannot be read: {type(e).__name__}: {e}") from e
    for k, m in models.items():
        set_model_state_dict(m, state[f"model.{k}"])
    for k, opt in (optimizers or {}).items():
        set_optimizer_state_dict(models[k], opt, state[f"optim.{k}"])
    for k, s in (schedulers or {}).items():
        s.load_state_dict(extra["schedulers"][k])
    return trainer_state


def keep_earlier(path):
    """A fresh run in a folder that holds an earlier run's `path` (its final policy): kept as
    `path.N` (the first free N), as metrics.jsonl is, not overwritten by this run's."""
    if os.path.exists(path):
        kept = free_name(path)
        os.replace(path, kept)
        print(f"{path} held an earlier run's final policy: kept as {kept}", flush=True)


def export_hf(
    path: str,
    model: torch.nn.Module,
    tokenizer=None,
    dtype: torch.dtype = torch.bfloat16,
    max_shard_bytes: int = 4 << 30,
) -> str:
    """Write `model` as a Hugging Face folder (safetensors shards + index, config, generation
    config, tokenizer with its chat template), atomically, on rank 0. Collective: call on all
    ranks."""
    from safetensors.torch import save_file

    tmp = path.rstrip("/") + ".tmp"
    if rank() == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, tensor in iter_full_tensors(model, dtype=dtype):
        if rank() != 0:
            continue
        nbytes = tensor.numel() * tensor.element_size()
        if size + nbytes > max_shard_bytes and shards[-1]:
            shards.append({})
            size = 0
        shards[-1][name] = tensor.detach().to("cpu", copy=True).contiguous()
        size += nbytes
    if rank() == 0:
        root = os.path.dirname(os.path.abspath(path))
        with _writing(tmp, root, f"the final policy {path}"):
            weight_map = {}
            for i, shard in enumerate(shards):
                fname = (
                    "model.safetensors"
                    if len(shards) == 1
                    else f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
                )
                save_file(shard, os.path.join(tmp, fname), metadata={"format": "pt"})
                weight_map.update({k: fname for k in shard})
            if len(shards) > 1:
                total = sum(t.numel() * t.element_size() for s in shards for t in s.values())
                with open(os.path.join(tmp, "model.safetensors.index.json"), "w") as f:
                    json.dump(
                        {"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=1
                    )
            config = model.config.__class__.from_dict(model.config.to_dict())
            config.dtype = dtype
            config.use_cache = True
            config.save_pretrained(tmp)
            if getattr(model, "generation_config", None) is not None:
                model.generation_config.save_pretrained(tmp)
            if tokenizer is not None:
                tokenizer.save_pretrained(tmp)
        shutil.rmtree(path, ignore_errors=True)
        os.replace(tmp, path)
    barrier()
    return path
