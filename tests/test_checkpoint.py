"""checkpoint.py in one process: a disk that fills while the checkpoint library writes is named as
full, whatever exception type the library raises, and the half-written folder is removed."""

import errno
import os

import pytest
import torch
import torch.distributed.checkpoint.filesystem as dcp_fs

import checkpoint


class Filling:
    """A stream that takes `room` bytes and then fails as a full disk does."""

    def __init__(self, stream, room):
        self.stream, self.room = stream, room

    def write(self, data):
        self.room -= len(data)
        if self.room < 0:
            raise OSError(errno.ENOSPC, "No space left on device")
        return self.stream.write(data)

    def __getattr__(self, name):
        return getattr(self.stream, name)


def test_a_disk_that_fills_during_a_checkpoint_is_named_and_leaves_nothing(tmp_path, monkeypatch):
    model = torch.nn.Linear(64, 64)
    opt = torch.optim.AdamW(model.parameters())
    model(torch.ones(1, 64)).sum().backward()
    opt.step()
    root = str(tmp_path / "ckpt")
    checkpoint.save_checkpoint(root, 1, {"actor": model}, {"actor": opt})
    real = dcp_fs.FileSystem.create_stream

    def filling(self, path, mode):
        cm = real(self, path, mode)

        class Wrapped:
            def __enter__(self):
                return Filling(cm.__enter__(), room=100)

            def __exit__(self, *exc):
                return cm.__exit__(*exc)

        return Wrapped()

    monkeypatch.setattr(dcp_fs.FileSystem, "create_stream", filling)
    with pytest.raises(OSError) as e:
        checkpoint.save_checkpoint(root, 2, {"actor": model}, {"actor": opt})
    message = str(e.value)
    assert e.value.errno == errno.ENOSPC
    assert f"writing checkpoint {root}/global_step_2 failed: the disk holding {root}" in message
    assert "is full" in message and f"the last checkpoint, {root}/global_step_1" in message
    assert sorted(os.listdir(root)) == ["global_step_1", "latest_checkpointed_iteration.txt"]


def test_a_damaged_model_file_is_named_with_the_flag(tmp_path):
    """model.safetensors cut short (a download that stopped): the error names the model, the flag
    and what to do, not only the reader's "header too large"."""
    import dataclasses

    import models
    import train_grpo
    from bench.tiny import make_tiny_model

    path = make_tiny_model(str(tmp_path / "model"))
    weights = os.path.join(path, "model.safetensors")
    with open(weights, "r+b") as f:
        f.truncate(100)
    args = dataclasses.replace(train_grpo.Args(), model=path)
    spec = models.Model("actor", path, "old_log_prob")
    with pytest.raises(SystemExit) as e:
        models.load(spec, torch.device("cpu"), args)
    message = str(e.value.code)
    assert f"the actor model {path} (--model) cannot be loaded: " in message
    assert "download or export it again" in message


def test_a_fresh_run_keeps_an_earlier_runs_final_policy(tmp_path, capsys):
    """hf_model/ of an earlier run in the folder: kept as hf_model.N, the first free N."""
    final = tmp_path / "hf_model"
    for taken in ("hf_model", "hf_model.1"):
        (tmp_path / taken).mkdir()
        (tmp_path / taken / "config.json").write_text(taken)
    checkpoint.keep_earlier(str(final))
    assert (
        not final.exists() and (tmp_path / "hf_model.2" / "config.json").read_text() == "hf_model"
    )
    assert (
        f"{final} held an earlier run's final policy: kept as {final}.2" in capsys.readouterr().out
    )
    checkpoint.keep_earlier(str(final))  # nothing there: nothing to keep
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf_model.1", "hf_model.2"]
