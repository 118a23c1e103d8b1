"""The loggers a run writes to, for real: two GRPO steps with `--logger
console,jsonl,tensorboard,wandb` (wandb offline: no network), then each one read back with its own
format's reader (tensorboard's event files by tensorboard, wandb's run file as its LevelDB-style log
of protobuf records), metric names and values intact."""

import glob
import json
import math
import struct

import pytest

from tests.test_train_grpo import flags, launch, make_assets, metrics_by_step


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    assets = make_assets(tmp_path_factory.mktemp("loggers"))
    out = assets["tmp"] / "run"
    args = flags(assets, out, "hf", 2, "disable", "--logger", "console,jsonl,tensorboard,wandb")
    proc = launch(args, nproc=0, env={"WANDB_MODE": "offline", "WANDB_SILENT": "true"})
    assert proc.returncode == 0, proc.output[-6000:]
    return out, proc.output


def wandb_history(path):
    """The history rows of a wandb run file (`run-ID.wandb`): after a 7-byte header (":W&B", magic,
    version), 32 KiB blocks of records, each a 7-byte header (crc, length, type: 1 whole, 2 first,
    3 middle, 4 last piece) and its bytes; a record is a serialized wandb Record."""
    from wandb.proto import wandb_internal_pb2

    data = open(path, "rb").read()
    assert data[:4] == b":W&B"
    rows, pos, pending = {}, 7, b""
    while pos + 7 <= len(data):
        left = 32768 - pos % 32768
        _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if left < 7 or (kind == 0 and length == 0):  # the block's zero padding
            pos += left
            continue
        pending += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):
            record = wandb_internal_pb2.Record.FromString(pending)
            pending = b""
            if record.WhichOneof("record_type") == "history":
                row = {
                    i.key or "/".join(i.nested_key): json.loads(i.value_json)
                    for i in record.history.item
                }
                rows[row["_step"]] = row
    return rows


def close(a, b):
    return math.isclose(a, b, rel_tol=1e-6, abs_tol=1e-9)


def test_every_logger_writes_the_metrics_it_is_given(run):
    out, output = run
    rows = metrics_by_step(out)
    assert sorted(rows) == [0, 1, 2]  # 0: validation before training
    # console: verl's line per step
    for step in (1, 2):
        assert f"step:{step} - actor/entropy:" in output
    # tensorboard: its event files, read by tensorboard
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(out / "tensorboard"), size_guidance={"scalars": 0})
    events.Reload()
    tags = set(events.Tags()["scalars"])
    for step, row in rows.items():
        for key, value in row.items():
            if key == "step" or not isinstance(value, (int, float)):
                continue
            assert key in tags, key
            logged = {e.step: e.value for e in events.Scalars(key)}
            assert math.isclose(logged[step], value, rel_tol=1e-6, abs_tol=1e-6), key
    # wandb: the offline run's file beside metrics.jsonl
    (path,) = glob.glob(str(out / "wandb" / "offline-run-*" / "run-*.wandb"))
    history = wandb_history(path)
    for step, row in rows.items():
        logged = history[step]
        for key, value in row.items():
            if key != "step":
                assert close(logged[key], value), key
    assert "val-core/openai/gsm8k/reward/mean@1" in history[2]


def test_wandb_without_a_login_is_refused_before_anything_loads(tmp_path, monkeypatch):
    """No key in the environment or in a netrc, and not offline: refused at start-up, naming the
    ways out (the run would otherwise end at its first log line, after the models and the engine
    had loaded); offline it passes."""
    from types import SimpleNamespace

    import metrics

    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(tmp_path / "wandb_config"))
    for name in ("WANDB_API_KEY", "WANDB_MODE", "NETRC"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr("sys.stdin", open("/dev/null"))  # no terminal to ask at
    args = SimpleNamespace(logger="[console,wandb]")
    with pytest.raises(SystemExit, match="--logger wandb: .*WANDB_MODE=offline"):
        metrics.check_logins(args)
    monkeypatch.setenv("WANDB_MODE", "offline")
    metrics.check_logins(args)
    metrics.check_logins(SimpleNamespace(logger="console,jsonl"))  # no account needed
