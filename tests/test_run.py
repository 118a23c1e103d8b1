"""run.py's accounting and plumbing against small examples worked out by hand: FLOPs per token and
each phase's throughput and MFU, the learning rate's schedule (warmup, cosine, warmup-stable-decay),
the Timer's per-phase peak memory without a sleeping engine's pool, and the Logger finishing its
background loggers.
"""

import dataclasses
import json
import os
import sys
import typing
from types import SimpleNamespace

import pytest
import torch
from transformers import AutoModelForCausalLM, HfArgumentParser

import compile_ahead
import flags
import metrics
import models
import run
import train_grpo
import train_ppo
from bench.tiny import tiny_config
from metrics import flops_per_token
from run import lr_lambda
from train_grpo import Args


def close(actual, expected, atol=1e-4, rtol=0.0):
    torch.testing.assert_close(
        torch.as_tensor(actual, dtype=torch.float32),
        torch.as_tensor(expected, dtype=torch.float32),
        atol=atol,
        rtol=rtol,
    )


# --- FLOPs and MFU --------------------------------------------------------------------------------


def test_flops_per_token_by_hand():
    # tiny config: h = 128, L = 2, V = 320, 4 heads and 2 kv heads of head_dim 32, intermediate 256
    # q = 4 * 32 = 128, kv = 2 * 32 = 64
    # per layer: q,k,v proj h*(q + 2kv) = 128 * 256 = 32768; o proj q*h = 16384; mlp 3*h*I = 98304
    # -> 147456 2 * (L * 147456 + V * h) = 2 * (294912 + 40960) = 671744
    # attention at seq_len 100: 2 * L * seq_len * q = 2 * 2 * 100 * 128 = 51200 -> 722944
    assert flops_per_token(tiny_config(tie=True), 0) == 671744
    assert flops_per_token(tiny_config(tie=True), 100) == 722944
    # tied and untied count the lm_head once and the embedding lookup never
    assert flops_per_token(tiny_config(tie=False), 100) == 722944
    # = 2 x the matrix parameters a token passes through (the tied model holds the V x h matrix
    # once)
    model = AutoModelForCausalLM.from_config(tiny_config(tie=True))
    assert flops_per_token(model.config, 0) == 2 * sum(
        p.numel() for p in model.parameters() if p.dim() == 2
    )


def test_forward_flops_by_hand():
    # tiny config at seq_len 100: 722944 FLOPs per token forward, of which the lm_head is 2 * V * h
    # = 81920. 1000 tokens, 400 of them response tokens:
    # a causal LM: 1000 * (722944 - 81920) + 400 * 81920 = 641024000 + 32768000 = 673792000
    # a value model: the body at every token and a head of 2 * h = 256 at every token:
    # 641024000 + 1000 * 256 = 641280000
    config = tiny_config(tie=True)
    assert metrics.forward_flops(config, 100, 1000, 400) == 673792000
    assert metrics.forward_flops(config, 100, 1000, 400, value=True) == 641280000


def test_phase_perf_by_hand():
    t = {
        "timing_s/old_log_prob": 2.0,
        "timing_s/update_actor": 3.0,
        "timing_s/values": 4.0,
        "timing_s/update_weights": 0.5,
    }
    work = {
        "old_log_prob": ("old_log_prob", 673792000),
        "ref": ("ref", 673792000),
        "update_actor": ("actor", 6 * 673792000),  # 3 passes x 2 epochs
        "values": ("values", 641280000),
    }
    perf = metrics.phase_perf(t, work, 1e9, 4e9)
    assert perf["perf/tflops/old_log_prob"] == pytest.approx(673792000 / 2.0 / 1e12)
    assert perf["perf/mfu/old_log_prob"] == pytest.approx(673792000 / 2.0 / 1e9)
    assert perf["perf/mfu/actor"] == pytest.approx(6 * 673792000 / 3.0 / 1e9)
    assert perf["perf/mfu/values"] == pytest.approx(641280000 / 4.0 / 1e9)
    assert "perf/mfu/ref" not in perf  # no reference phase ran
    assert perf["perf/weight_sync_gb_s"] == pytest.approx(8.0) and perf["perf/peak_tflops"] == 1e-3


def test_run_work_counts_each_declared_model():
    """Run.work: each model the script declared and loaded, its pass one forward, a trained one's
    update three per epoch; a value model with its one-score head; a declared model the run did not
    load (the reference without a KL term) counts nothing."""
    config = tiny_config(tie=True)
    specs = [
        models.Model("actor", "m", "old_log_prob"),
        models.Model("ref", "m", "ref", trained=False),
        models.Model("critic", "m", "values", value=True),
    ]
    r = run.Run.__new__(run.Run)
    r.specs, r.args = specs, SimpleNamespace(ppo_epochs=2)
    r.loaded = {role: SimpleNamespace(config=config) for role in ("actor", "critic")}
    # 10 sequences, 1000 tokens (mean length 100), 400 response tokens
    assert r.work(1000, 400, 10) == {
        "old_log_prob": ("old_log_prob", 673792000),
        "update_actor": ("actor", 6 * 673792000),
        "values": ("values", 641280000),
        "update_critic": ("critic", 6 * 641280000),
    }


# --- the learning rate's schedule -----------------------------------------------------------------


def test_export_line_by_hand():
    """The final export comes after the last metrics row: its time, and on a GPU its peak beside
    the plan's (19.1 GiB planned, 18.4 measured), as the log's last line."""
    plan = SimpleNamespace(phases={"export": (19.1 * 2**30, None)})
    gpu = {"timing_s/export": 3.04, "perf/max_memory_allocated_gb/export": 18.44}
    assert run.export_line(gpu, plan) == "export: 3.0 s, peak 18.4 GiB (planned 19.1 GiB)"
    assert run.export_line(gpu, None) == "export: 3.0 s, peak 18.4 GiB"  # no plan
    assert run.export_line({"timing_s/export": 0.26}, None) == "export: 0.3 s"  # on the CPU


def test_lr_lambda_warmup_then_cosine():
    # warmup 2 of 6 steps: (step + 1) / 2 -> 0.5, 1.0
    # cosine after: 0.5 * (1 + cos(pi * (step - 2) / 4)) -> step 2: 1.0, 3: 0.85355, 4: 0.5, 5:
    # 0.14645
    f = lr_lambda(Args(lr_warmup_steps=2, lr_scheduler_type="cosine"), total_steps=6)
    close([f(s) for s in range(6)], [0.5, 1.0, 1.0, 0.85355, 0.5, 0.14645], atol=1e-5)
    f = lr_lambda(Args(lr_warmup_steps=2, lr_scheduler_type="constant"), total_steps=6)
    assert [f(s) for s in range(6)] == [0.5, 1.0, 1.0, 1.0, 1.0, 1.0]
    # ratio 0.5 of 4 steps -> 2 warmup steps; -1 means "use the ratio"
    f = lr_lambda(Args(lr_warmup_steps=-1, lr_warmup_steps_ratio=0.5), total_steps=4)
    assert [f(s) for s in range(4)] == [0.5, 1.0, 1.0, 1.0]
    assert lr_lambda(Args(), total_steps=4)(0) == 1.0  # default: no warmup, constant


def test_lr_lambda_warmup_stable_decay():
    # 10 steps, the last 0.3 decay: held at 1 for steps 0-6, then over steps 7-9 a cosine from 1
    # towards 0.1: 0.1 + 0.9 * 0.5 * (1 + cos(pi * k / 3)) for k = 0, 1, 2 -> 1.0, 0.775, 0.325
    f = lr_lambda(
        Args(lr_scheduler_type="cosine", min_lr_ratio=0.1, lr_decay_steps_ratio=0.3), total_steps=10
    )
    close([f(s) for s in range(10)], [1.0] * 7 + [1.0, 0.775, 0.325], atol=1e-6)
    # with warmup 2 of 6 and the whole rest decaying to 0.5: 0.5 + 0.5 * 0.5 * (1 + cos(pi * k
    # / 4)), k = 0..3
    f = lr_lambda(
        Args(lr_warmup_steps=2, lr_scheduler_type="cosine", min_lr_ratio=0.5), total_steps=6
    )
    close([f(s) for s in range(6)], [0.5, 1.0, 1.0, 0.92678, 0.75, 0.57322], atol=1e-5)
    # a decay longer than what follows the warmup starts at the warmup's end: 0.9 of 6 steps
    # -> from step 2
    f = lr_lambda(
        Args(lr_warmup_steps=2, lr_scheduler_type="cosine", lr_decay_steps_ratio=0.9), total_steps=6
    )
    close([f(s) for s in range(6)], [0.5, 1.0, 1.0, 0.85355, 0.5, 0.14645], atol=1e-5)
    # the PPO script's flags give the same schedule (both scripts once had a copy of lr_lambda)
    kw = dict(
        lr_warmup_steps=1, lr_scheduler_type="cosine", min_lr_ratio=0.2, lr_decay_steps_ratio=0.5
    )
    grpo, ppo = (
        lr_lambda(Args(**kw), total_steps=9),
        run.lr_lambda(train_ppo.Args(**kw), total_steps=9),
    )
    assert [grpo(s) for s in range(9)] == [ppo(s) for s in range(9)]


# --- timing, memory, logging ----------------------------------------------------------------------


class FakeCudaMemory:
    """torch.cuda's peak counter, driven by the test: `peak` is what the next phase reaches."""

    def __init__(self, monkeypatch):
        self.peak = 0
        monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
        monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda *a: None)
        monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda *a: self.peak)


class SleepyEngine:
    """The engine's side of the memory accounting: a 80 GiB sleep-mode pool torch keeps counting."""

    def __init__(self):
        self.sleeping = False

    def unbacked_bytes(self):
        return 80 * 2**30 if self.sleeping else 0


def test_phase_peaks_leave_out_the_sleeping_engines_pool(monkeypatch):
    """By hand, in GiB: torch counts the engine's 80 GiB pool all along. gen peaks at 90 with the
    engine awake (it sleeps at the end: kept, 90); the update peaks at 130 with it asleep
    throughout: 130 - 80 = 50; the sync peaks at 95 and wakes it: kept, 95. The outer step records
    no peak of its own (its inner phases reset the counter), and without an engine nothing is
    subtracted."""
    memory, engine, logged = FakeCudaMemory(monkeypatch), SleepyEngine(), {}
    timer = metrics.Timer(logged, torch.device("cuda"), engine)
    with timer("step"):
        with timer("gen"):
            memory.peak = 90 * 2**30
            engine.sleeping = True
        with timer("update_actor"):
            memory.peak = 130 * 2**30
        with timer("update_weights"):
            memory.peak = 95 * 2**30
            engine.sleeping = False
    peaks = {
        k.split("/")[-1]: v
        for k, v in logged.items()
        if k.startswith("perf/max_memory_allocated_gb/")
    }
    assert peaks == {"gen": 90.0, "update_actor": 50.0, "update_weights": 95.0}
    assert set(logged) - {f"perf/max_memory_allocated_gb/{k}" for k in peaks} == {
        "timing_s/step",
        "timing_s/gen",
        "timing_s/update_actor",
        "timing_s/update_weights",
    }
    engine.sleeping, plain = True, {}
    with metrics.Timer(plain, torch.device("cuda"))("save_checkpoint"):
        memory.peak = 130 * 2**30
    assert plain["perf/max_memory_allocated_gb/save_checkpoint"] == 130.0


def test_timer_gives_cached_memory_back_at_each_phase_only_in_the_eager_first_step(monkeypatch):
    """--warm_compile_caches' eager first step (`Timer.release_cache`): each phase starts with
    torch's cached memory given back (empty_cache), nested phases too; other steps never call it."""
    FakeCudaMemory(monkeypatch)
    released = []
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: released.append(metrics.PHASES[:]))
    timer = metrics.Timer({}, torch.device("cuda"))
    monkeypatch.setattr(metrics.Timer, "release_cache", True)
    with timer("step"), timer("old_log_prob"):
        pass
    with timer("update_actor"):
        pass
    assert released == [[], ["step"], []]
    monkeypatch.setattr(metrics.Timer, "release_cache", False)
    with timer("step"), timer("update_actor"):
        pass
    assert len(released) == 3


def test_warm_compile_caches_default_is_on_where_it_runs():
    """Unset, --warm_compile_caches is on exactly on a GPU with the in-process engine and passes
    that compile; given, it is as given; train_ppo.py's default is off."""
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    warms = compile_ahead.warms
    assert warms(Args(), cuda)
    assert not warms(Args(), cpu)
    assert not warms(Args(engines_per_gpu=4), cuda)
    assert not warms(Args(compile_layers=False, use_torch_compile=False), cuda)
    assert not warms(Args(warm_compile_caches=False), cuda)
    assert warms(Args(warm_compile_caches=True), cpu)
    assert not warms(train_ppo.Args(), cuda)


def test_the_compiling_helper_starts_with_the_scripts_models(monkeypatch):
    """`compile_ahead.WarmStart` on a GPU's first rank starts the helper process with the models the
    script declared (the process is a stand-in: nothing is spawned)."""
    started = []

    class Process:
        def __init__(self, target, name, args):
            self.name, self.args = name, args

        def start(self):
            started.append(self)

        def kill(self):
            pass

    ctx = SimpleNamespace(Event=lambda: None, Process=Process)
    monkeypatch.setattr(torch.multiprocessing, "get_context", lambda kind: ctx)
    monkeypatch.setenv("LOCAL_RANK", "0")
    args = Args(kl_loss_coef=0.1)
    specs = [m for m in train_grpo.models(args) if m]
    compile_ahead.WarmStart(run.Run(args, 0, 1, torch.device("cuda"), specs))
    (helper,) = started
    assert helper.name == "warm_compile_caches" and helper.args[2] == specs
    assert [m.role for m in specs] == ["actor", "ref"]


def test_timer_keeps_the_phases_in_progress_for_a_stuck_runs_message():
    timer = metrics.Timer({}, torch.device("cpu"))
    with timer("step"):
        with timer("gen"):
            assert metrics.PHASES == ["step", "gen"]
        with pytest.raises(ValueError), timer("update_actor"):
            raise ValueError  # a phase that fails leaves the list too
        assert metrics.PHASES == ["step"]
    assert metrics.PHASES == []
    where = run.Run.where(SimpleNamespace(reward_fn=SimpleNamespace(busy="calling it")))
    assert where == "no phase (between two), calling it"


def test_logger_close_finishes_the_background_loggers(tmp_path):
    """A finished run ends with os._exit, which runs no exit hooks: the run itself finishes the
    wandb run and writes tensorboard's pending events (stand-ins here: neither package is installed
    for the tests)."""
    calls = []
    logger = metrics.Logger(flags.RunArgs(logger="jsonl"), str(tmp_path))
    logger.close()  # none of them on: nothing to close
    logger.wandb = SimpleNamespace(finish=lambda: calls.append("wandb"))
    logger.tb = SimpleNamespace(close=lambda: calls.append("tensorboard"))
    logger.close()
    assert calls == ["wandb", "tensorboard"]


# --- every numeric flag within its range ----------------------------------------------------------

UNBOUNDED = {"entropy_coeff"}  # a negative coefficient is an entropy penalty: any finite number


def outside(bound, limit, is_int, also):
    """A value past `limit` on the wrong side of `bound`, and not one of the values `also` allows
    (for ge=0 with -1 allowed: -2)."""
    step = (1 if is_int else 0.5) * (-1 if bound in ("gt", "ge") else 1)
    value = limit if bound in ("gt", "lt") else limit + step
    while value in also:
        value += step
    return value


def number_type(f):
    """int or float for a numeric field (also when it may be None), else None."""
    types = typing.get_args(f.type) or (f.type,)
    return next((t for t in types if t in (int, float)), None)


@pytest.mark.parametrize("script", [train_grpo, train_ppo], ids=["grpo", "ppo"])
def test_every_numeric_flag_is_range_checked_at_start_up(script):
    """Walks every field of the script's Args: each number has its range (or is known to have
    none), its default passes, and a value past each bound stops the run naming the flag."""
    numeric = [f for f in dataclasses.fields(script.Args) if number_type(f)]
    assert len(numeric) > 40

    def check(**kw):
        script.check_args(script.Args(default_local_dir="/tmp/unused", **kw), 1)

    check()
    for f in numeric:
        bounds, also = flags.RANGES[f]
        assert bounds or f.name in UNBOUNDED, f"--{f.name} declares no range"
        cases = [outside(k, v, number_type(f) is int, also) for k, v in bounds.items()]
        cases += [float("nan")] if number_type(f) is float else []
        for value in cases:
            with pytest.raises(SystemExit, match=f"--{f.name} "):
                check(**{f.name: value})
        for value in also:  # the values that mean something pass
            check(**{f.name: value})


@pytest.mark.parametrize(
    "kw, message",
    [
        (dict(grad_clip=-1.0), "--grad_clip -1.0 must be > 0"),
        (dict(total_training_steps=0), "--total_training_steps 0 must be >= 1"),
        (dict(temperature=0.0), "--temperature 0.0 must be > 0"),
        (dict(ppo_mini_batch_size=0), "--ppo_mini_batch_size 0 must be >= 1"),
        (dict(top_p=1.5), r"--top_p 1.5 must be > 0 and <= 1"),
        (dict(save_freq=0), "--save_freq 0 must be >= 1, or -1"),
        (dict(clip_ratio_low=1.0), "--clip_ratio_low 1.0 must be >= 0 and < 1"),
    ],
)
def test_range_messages_by_hand(kw, message):
    with pytest.raises(SystemExit, match=message):
        train_grpo.check_args(train_grpo.Args(default_local_dir="/tmp/unused", **kw), 1)


# --- what a run leaves behind: metrics.jsonl, the folder's lock -----------------------------------


def write_rows(path, rows, tail=""):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows) + tail)


def test_repair_metrics_keeps_one_row_per_step_across_crashes(tmp_path, capsys):
    path = tmp_path / "metrics.jsonl"
    rows = [{"step": s, "x": float(s)} for s in range(4)]
    # resumed from step 2's checkpoint: steps 3 on go, and a torn last line (a crash mid-append) too
    write_rows(path, rows, tail='{"step": 4, "x": 4.')
    metrics.repair_metrics(str(path), 2)
    assert [json.loads(line) for line in path.read_text().splitlines()] == rows[:3]
    assert "dropped its torn last line 5" in capsys.readouterr().out
    # a crash between step 3's checkpoint and its row: the checkpoint's row is written again
    metrics.repair_metrics(str(path), 3, last_row=rows[3])
    assert [json.loads(line) for line in path.read_text().splitlines()] == rows
    metrics.repair_metrics(str(path), 3, last_row={"step": 3, "x": -1.0})  # the row is there: kept
    assert [json.loads(line) for line in path.read_text().splitlines()] == rows


def test_repair_metrics_names_a_damaged_row_and_keeps_an_earlier_run(tmp_path, capsys):
    path = tmp_path / "metrics.jsonl"
    write_rows(path, [{"step": 1}], tail='{"step": 2, oops}\n{"step": 3}\n')
    with pytest.raises(SystemExit, match=r"metrics.jsonl line 2 is not a JSON row"):
        metrics.repair_metrics(str(path), 3)
    write_rows(path, [{"step": 1}, {"note": "lr raised here"}, {"step": 2}])  # a user's note
    with pytest.raises(SystemExit, match=r"metrics.jsonl line 2 is not a step's row"):
        metrics.repair_metrics(str(path), 2)
    # a fresh run in a folder that holds another run's metrics keeps them beside its own
    write_rows(path, [{"step": 0}, {"step": 1}])
    (tmp_path / "metrics.jsonl.1").write_text("taken\n")
    metrics.repair_metrics(str(path), 0)
    assert not path.exists() and (tmp_path / "metrics.jsonl.2").read_text().count("step") == 2
    assert "kept as" in capsys.readouterr().out


def test_one_run_per_folder(tmp_path):
    held = run.lock_folder(str(tmp_path / "run"))
    with pytest.raises(SystemExit, match=rf"run is in use by another run \(pid {os.getpid()} on "):
        run.lock_folder(str(tmp_path / "run"))
    held.close()  # the run ends (a killed process's lock goes with it): the folder is free
    run.lock_folder(str(tmp_path / "run")).close()


@pytest.mark.parametrize("script", [train_grpo, train_ppo], ids=["grpo", "ppo"])
def test_the_command_line_parses_every_flag(script):
    """The flags as torchrun passes them: every field a flag of its own, with its default."""
    (args,) = HfArgumentParser(script.Args).parse_args_into_dataclasses(["--grad_clip", "0.5"])
    assert args.grad_clip == 0.5 and args == script.Args(grad_clip=0.5)


def test_out_of_memory_names_its_phase_and_what_to_do(monkeypatch, capsys):
    """The GPU out of memory inside a phase (here the old log-prob pass, within the step): the
    run's end names the phase, where the plan and the peaks are, and what to change; torch's error
    follows as it was."""
    import metrics

    monkeypatch.setattr(run, "parse", lambda Args: None)
    monkeypatch.setattr(sys, "argv", ["train_grpo.py"])
    monkeypatch.setattr(sys, "stdout", sys.stdout)  # launch wraps them; put back afterwards
    monkeypatch.setattr(sys, "stderr", sys.stderr)
    monkeypatch.setattr(metrics, "OUT_OF_MEMORY_IN", [])
    cpu = torch.device("cpu")

    def main(args):
        timer = metrics.Timer({}, cpu)
        with timer("step"):
            with timer("gen"):
                pass
            with timer("old_log_prob"):
                raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 7.53 GiB.")

    with pytest.raises(torch.OutOfMemoryError, match="Tried to allocate 7.53 GiB"):
        run.launch(main, None)
    err = capsys.readouterr().err
    assert err.startswith("train_grpo.py: out of GPU memory in step > old_log_prob. ")
    assert "--gpu_memory_gib" in err and "--log_prob_max_token_len_per_gpu" in err
    assert metrics.PHASES == []
