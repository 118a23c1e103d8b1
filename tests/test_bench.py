"""bench/: the speed of light of a step and the scaling efficiency, worked by hand; the printed
tables; profile_step and random_model on a tiny model."""

import json
import os
import subprocess
import sys
import time

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "bench"))
import ab_table  # noqa: E402
import bench_engine  # noqa: E402
import gib_table  # noqa: E402
import learn_table  # noqa: E402
import nvml_peak  # noqa: E402
import phase_table  # noqa: E402
import plan_table  # noqa: E402
import scaling_table  # noqa: E402

ROW = {
    "step": 1,
    "timing_s/gen": 10.0,
    "timing_s/old_log_prob": 2.0,
    "timing_s/update_actor": 4.0,
    "timing_s/update_weights": 0.5,
    "timing_s/step": 17.0,
    "perf/gen_tokens_per_s": 1000.0,
    "perf/tflops/old_log_prob": 50.0,
    "perf/tflops/actor": 100.0,
    "perf/mfu/old_log_prob": 0.05,
    "perf/mfu/actor": 0.1,
    "perf/peak_tflops": 1000.0,
    "perf/weight_sync_gb_s": 2.0,
    "critic/score/mean": 0.5,
    "response_length/mean": 100.0,
    "perf/max_memory_allocated_gb": 10.0,
}


def test_nvml_peak_summary_by_hand():
    """Two processes (the trainer, the helper) on a GPU that held 1 GiB before the run."""
    G = 2**30
    samples = [
        (0.0, 1 * G, {}),
        (0.5, 9 * G, {10: 6 * G, 11: 2 * G}),
        (1.0, 13 * G, {10: 11 * G, 11: 1 * G}),
        (1.5, 5 * G, {10: 4 * G}),
    ]
    s = nvml_peak.summarize(1 * G, samples)
    assert s["baseline_gib"] == 1 and s["peak_gib"] == 12
    assert s["peak_processes_gib"] == 12  # the sum at one moment, not each one's peak added
    assert s["peak_by_pid_gib"] == {"10": 11, "11": 2}
    assert s["timeline"] == [[0.0, 0.0], [0.5, 8.0], [1.0, 12.0], [1.5, 4.0]]


def test_plan_table_sets_the_first_steps_own_plan_apart(tmp_path, capsys):
    """Step 1 planned eager beside the helper, steps 2-3 compiled: each against its own steps'
    peaks; the NVML peak after them."""
    rows = [
        {"step": 1, "timing_s/step": 30.0, "perf/planned_memory_gb/update_actor": 50.0,
         "perf/max_memory_allocated_gb/update_actor": 45.0},
        {"step": 2, "timing_s/step": 20.0, "perf/planned_memory_gb/update_actor": 40.0,
         "perf/max_memory_allocated_gb/update_actor": 36.0,
         "perf/planned_memory_gb/save_checkpoint": 8.0},
        {"step": 3, "timing_s/step": 20.0, "perf/planned_memory_gb/update_actor": 40.0,
         "perf/max_memory_allocated_gb/update_actor": 38.0,
         "perf/planned_memory_gb/save_checkpoint": 8.0,
         "perf/max_memory_allocated_gb/save_checkpoint": 6.0},
    ]  # fmt: skip
    # a run that logs the plan's arithmetic at each step's lengths: set beside the step whose peak
    # is the largest (step 3's 38.0 against its 36.0, not step 2's)
    rows[1]["perf/predicted_memory_gb/update_actor"] = 35.0
    rows[2]["perf/predicted_memory_gb/update_actor"] = 36.0
    for r in rows[1:]:
        r["perf/planned_memory_gb/export"] = 8.0
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    peak = tmp_path / "peak.json"
    peak.write_text(json.dumps({"peak_gib": 23.5, "baseline_gib": 0.5, "peak_processes_gib": 23.0}))
    # the export, after the last row: its peak from the run's last line
    log = tmp_path / "run.log"
    log.write_text("done: 3 steps; ...\nexport: 2.5 s, peak 8.8 GiB (planned 8.0 GiB)\n")
    plan_table.main(str(path), str(peak), str(log))
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "steps 2-3"
    assert out[2].split() == ["update_actor", "40.0", "38.0", "0.95", "36.0", "1.06"]
    assert out[3].split() == ["save_checkpoint", "8.0", "6.0", "0.75"]
    assert out[4].split() == ["export", "8.0", "8.8", "1.10"]
    assert out[5] == "step 1 (its own plan)"
    assert out[7].split() == ["update_actor", "50.0", "45.0", "0.90"]
    assert out[8].startswith("all processes (NVML): 23.5 GiB above the 0.5 GiB")
    plan_table.main(str(path))  # no log: the export's peak unknown
    assert capsys.readouterr().out.splitlines()[4].split() == ["export", "8.0", "-"]


def test_gib_table_rows_by_hand(tmp_path, capsys):
    """A run that went through (3 steps, exit 0), one that ran out of memory in step 1 and a
    one-step run: the driver's peak, the lowest and highest measured / planned after the first
    step (of the first where it is the only one), the median step against its speed of light."""
    steps = [
        ROW | {"step": s, "timing_s/step": t, "timing_s/since_launch": 70.0 + s,
               "perf/planned_memory_gb/gen": 18.0, "perf/max_memory_allocated_gb/gen": g,
               "perf/planned_memory_gb/update_actor": 20.0,
               "perf/max_memory_allocated_gb/update_actor": u,
               "perf/predicted_memory_gb/gen": 18.0,
               "perf/predicted_memory_gb/update_actor": 17.0}
        for s, t, g, u in [(1, 40.0, 30.0, 30.0), (2, 17.0, 18.9, 18.0), (3, 19.0, 18.0, 19.0)]
    ]  # fmt: skip
    steps[2] |= {"perf/planned_memory_gb/save_checkpoint": 10.0,
                 "perf/max_memory_allocated_gb/save_checkpoint": 9.0,
                 "perf/planned_memory_gb/export": 10.0,
                 "perf/predicted_memory_gb/export": 10.0}  # fmt: skip
    (tmp_path / "gib_24.jsonl").write_text("".join(json.dumps(r) + "\n" for r in steps))
    (tmp_path / "gib_24.nvml.json").write_text(json.dumps({"peak_gib": 23.96, "baseline_gib": 0.6}))
    (tmp_path / "gib_24.log").write_text(
        "step 3 ...\nexport: 2.0 s, peak 8.7 GiB (planned 10.0 GiB)\n== gib_24: exit 0\n"
    )
    (tmp_path / "gib_ppo_none.log").write_text(
        "torch.OutOfMemoryError: CUDA out of memory.\n== gib_ppo_none: exit 1\n"
    )
    (tmp_path / "qwen3_gib_40.jsonl").write_text(json.dumps(steps[0]) + "\n")
    (tmp_path / "qwen3_gib_40.log").write_text("== qwen3_gib_40: exit 0\n")
    gib_table.main(str(tmp_path), 2000.0)
    out = capsys.readouterr().out.splitlines()
    assert [c.strip() for c in out[2].split("|")[1:-1]] == [
        # gen 18.9/18 = 1.05, the update 19/20 = 0.95 (step 1's 30 GiB not counted), the
        # checkpoint 0.90, the export (its log's line) 0.87; at each step's lengths the update
        # 19/17 = 1.12 (no checkpoint's arithmetic logged: not counted); each step's speed of
        # light 6.25 s (test_speed_of_light_by_hand) at 2000 tok/s: the median 18 s is 2.88x;
        # step 1 ended 71 s after launch
        "gib_24", "24 GiB", "through", "24.0", "0.87 (export)", "1.05 (gen)", "0.87 (export)",
        "1.12 (update_actor)", "18.0", "2.88x", "71",
    ]  # fmt: skip
    assert [c.strip() for c in out[3].split("|")[1:-1]] == [
        "gib_ppo_none", "the GPU's own", "out of memory", "-", "-", "-", "-", "-", "-", "-",
        "-",
    ]  # fmt: skip
    # one step only (the qwen3_gib parts): step 1's peaks, the update 30/20 = 1.50 and gen
    # 30/18 = 1.67, at its lengths gen 1.67 and the update 30/17 = 1.76; its 40 s against 6.25 s
    assert [c.strip() for c in out[4].split("|")[1:-1]] == [
        "qwen3_gib_40", "40 GiB", "through", "-", "1.50 (update_actor)", "1.67 (gen)",
        "1.67 (gen)", "1.76 (update_actor)", "40.0 (step 1)", "6.40x", "71",
    ]  # fmt: skip


def test_speed_of_light_by_hand():
    # 10 s x 1000 tok/s = 10,000 tokens; at plain vLLM's 2000 tok/s: 5 s.
    # FLOPs: 50 TFLOP/s x 2 s + 100 TFLOP/s x 4 s = 500 TFLOP, at 40% of 1000 TFLOP/s: 1.25 s
    assert phase_table.speed_of_light(ROW, 2000.0) == pytest.approx(6.25)
    assert phase_table.speed_of_light(ROW, None) == pytest.approx(11.25)  # at our own rate: 10 s
    # PPO: the critic's passes count too: + 20 TFLOP/s x 1 s (values) + 40 TFLOP/s x 3 s (update)
    # = 140 TFLOP, at 40% of 1000 TFLOP/s: 0.35 s
    ppo = ROW | {
        "timing_s/values": 1.0,
        "timing_s/update_critic": 3.0,
        "perf/tflops/values": 20.0,
        "perf/tflops/critic": 40.0,
    }
    assert phase_table.speed_of_light(ppo, 2000.0) == pytest.approx(6.6)


def test_table_and_summary(tmp_path, capsys):
    path = tmp_path / "metrics.jsonl"

    def peaks(gen, update):
        return {
            "perf/max_memory_allocated_gb/gen": gen,
            "perf/max_memory_allocated_gb/update_actor": update,
        }

    rows = [
        {"step": 0, "val-core/x/reward/mean@1": 0.1},
        ROW | {"timing_s/since_launch": 95.4} | peaks(90.0, 80.0),
        ROW | {"step": 2, "timing_s/step": 15.0} | peaks(91.0, 40.0),
        ROW | {"step": 3, "timing_s/step": 15.0} | peaks(93.0, 42.0),
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    phase_table.main(str(path), 2000.0)
    out = capsys.readouterr().out
    assert "MFU actor" in out and "MFU ref" not in out  # only phases that ran
    # the median over steps after the first: 15 s against 6.25 s
    assert "median step 15.0 s; speed of light 6.2 s" in out and "2.40x" in out
    # per phase, the median over steps 2-3 (step 1 compiles): gen (91 + 93) / 2, update (40 + 42)
    # / 2
    assert "median peak GiB per phase: gen 92.0, update_actor 41.0" in out
    assert "step 1 ended 95 s after launch (17 s of it in the step)" in out
    # a run that ended before its first step (out of memory in it) has no table, and says so
    path.write_text(json.dumps(rows[0]) + "\n")
    phase_table.main(str(path))
    assert capsys.readouterr().out == f"{path}: no step ended\n"


def test_ab_table_by_hand(tmp_path, capsys):
    """Medians over the steps after the first, side by side, and B / A."""

    def run(name, steps, gap):  # steps: (timing_s/step, timing_s/gen) per step
        rows = [
            {
                "step": i + 1,
                "timing_s/step": s,
                "timing_s/gen": g,
                "rollout/logprob_gap_mean": gap,
                "timing_s/since_launch": 90.0 + 10 * i,
            }
            for i, (s, g) in enumerate(steps)
        ]
        (tmp_path / name).write_text("".join(json.dumps(r) + "\n" for r in rows))
        return str(tmp_path / name)

    # A: steps 2-4 take 20, 22, 30 s (median 22); B: 21, 23, 25 (median 23) -> 23 / 22 = 1.045
    a = run("a.jsonl", [(80, 50), (20, 10), (22, 11), (30, 12)], 0.0125)
    b = run("b.jsonl", [(70, 40), (21, 10), (23, 10), (25, 10)], 0.0125)
    ab_table.main(a, b)
    out = capsys.readouterr().out
    assert "A (3 steps)" in out and "B (3 steps)" in out
    table = {line[:24].strip(): line[24:].split() for line in out.splitlines()[1:]}
    assert table["step s"] == ["22", "23", "1.045"]
    assert table["gen s"] == ["11", "10", "0.909"]  # 10 / 11
    assert table["logprob_gap_mean"] == ["0.0125", "0.0125", "1.000"]
    assert table["step 1 ended s"] == ["90", "90", "1.000"]
    # another tool's run (bench/trl_grpo.py: the step's time and its end after launch only) against
    # ours: the rows both have
    trl = tmp_path / "trl.jsonl"
    trl.write_text(
        "".join(
            json.dumps({"step": i + 1, "timing_s/step": s, "timing_s/since_launch": t}) + "\n"
            for i, (s, t) in enumerate([(146, 146), (70, 216), (75, 291), (80, 371)])
        )
    )
    ab_table.main(str(trl), b)
    out = capsys.readouterr().out
    table = {line[:24].strip(): line[24:].split() for line in out.splitlines()[1:]}
    assert table == {"step s": ["75", "23", "0.307"], "step 1 ended s": ["146", "90", "0.616"]}
    # a run that ended before its first step: said so, naming its file, and no table
    (tmp_path / "failed.jsonl").write_text("")
    with pytest.raises(SystemExit, match="failed.jsonl: no step ended"):
        ab_table.main(str(tmp_path / "failed.jsonl"), b)


def test_learn_table_by_hand(tmp_path, capsys):
    """Training time sums the steps; wall time adds validation and checkpoints; a step run again
    after a resume counts once, as its later line; the summary reads the last validation within the
    budget."""

    def val(strict, flexible=None):
        return {"val-core/a/reward/mean@1": strict} | (
            {} if flexible is None else {"val-core/a/reward_flexible/mean@1": flexible}
        )

    rows = [
        {"step": 0} | val(0.0, 0.2),
        {"step": 1, "timing_s/step": 30.0},
        {"step": 2, "timing_s/step": 60.0, "timing_s/testing": 6.0, "timing_s/save_checkpoint": 3.0}
        | val(0.5, 0.4),
        {"step": 3, "timing_s/step": 100.0},  # stopped here; resumed from step 2's checkpoint
        {"step": 3, "timing_s/step": 40.0},
        {"step": 4, "timing_s/step": 20.0, "timing_s/testing": 7.0} | val(0.6),
    ]
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    learn_table.main(str(path), minutes=2.5)
    lines = capsys.readouterr().out.splitlines()
    assert (
        lines[0]
        == "| step | training time | wall time (with validation, checkpoints) | a strict | a "
        "flexible |"
    )
    # training: 30 + 60 = 90 s; then + 40 + 20 = 150 s. wall: 90 + 6 + 3 = 99 s; then 99 + 40 + 20
    # + 7 = 166 s
    assert lines[2:5] == [
        "| 0 | 0.0 min | 0.0 min | 0.000 | 0.200 |",
        "| 2 | 1.5 min | 1.6 min | 0.500 | 0.400 |",
        "| 4 | 2.5 min | 2.8 min | 0.600 |  |",
    ]
    # no flexible
    assert lines[5] == "within 2.5 minutes of training: step 4 (2.5 min): a strict 0.000 -> 0.600"
    learn_table.main(str(path), minutes=2)
    assert capsys.readouterr().out.splitlines()[-1] == (
        "within 2 minutes of training: step 2 (1.5 min): "
        "a strict 0.000 -> 0.500, a flexible 0.200 -> 0.400"
    )
    learn_table.main(str(path), minutes=1)  # the validation before step 1 is within any budget
    assert (
        capsys.readouterr()
        .out.splitlines()[-1]
        .startswith("within 1 minutes of training: step 0 (0.0 min)")
    )
    path.write_text("".join(json.dumps(r) + "\n" for r in rows[1:]))  # no validation before step 1
    learn_table.main(str(path), minutes=1)
    assert capsys.readouterr().out.splitlines()[-1] == "no validation within 1 minutes of training"
    # a shaped reward that logs the strict score as "acc": that column is the strict one
    acc = {
        "step": 0,
        "val-core/a/acc/mean@1": 0.0,
        "val-core/a/reward/mean@1": 0.1,
        "val-core/a/reward_flexible/mean@1": 0.2,
    }
    path.write_text(json.dumps(acc) + "\n")
    learn_table.main(str(path))
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].endswith("| a strict (acc) | a reward | a flexible |")
    assert lines[2] == "| 0 | 0.0 min | 0.0 min | 0.000 | 0.100 | 0.200 |"
    path.write_text(json.dumps({"step": 1, "timing_s/step": 1.0}) + "\n")
    with pytest.raises(SystemExit, match="holds no validation"):
        learn_table.main(str(path))
    path.write_text(json.dumps({"step": 1}) + "\n{oops\n")
    with pytest.raises(SystemExit, match="line 2: not JSON"):
        learn_table.main(str(path))


def test_learn_table_summary_by_hand(tmp_path, capsys):
    """One row per run: the start, the last validation within the budget, the last of all; a shaped
    reward's strict score ("acc") is the strict one; a run without validation says so."""
    a, b, c = tmp_path / "a.jsonl", tmp_path / "b.jsonl", tmp_path / "c.jsonl"
    a.write_text(
        "".join(
            json.dumps(r) + "\n"
            for r in [
                {
                    "step": 0,
                    "val-core/x/reward/mean@1": 0.0,
                    "val-core/x/reward_flexible/mean@1": 0.25,
                },
                {
                    "step": 1,
                    "timing_s/step": 300.0,
                    "val-core/x/reward/mean@1": 0.2,
                    "val-core/x/reward_flexible/mean@1": 0.3,
                },
                {"step": 2, "timing_s/step": 360.0, "val-core/x/reward/mean@1": 0.4},
            ]
        )
    )
    b.write_text(
        json.dumps({"step": 0, "val-core/x/acc/mean@1": 0.1, "val-core/x/reward/mean@1": 0.5})
        + "\n"
    )
    c.write_text(json.dumps({"step": 1, "timing_s/step": 1.0}) + "\n")
    learn_table.summary([str(a), str(b), str(c)], minutes=10)
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("| run | strict / flexible at the start | within 10 minutes")
    # 300 s is within 10 minutes, 660 s is not
    assert lines[2] == "| a | 0.000 / 0.250 | 1 (5.0 min) 0.200 / 0.300 | 2 (11.0 min) 0.400 / - |"
    assert lines[3] == "| b | 0.100 / - | 0 (0.0 min) 0.100 / - | 0 (0.0 min) 0.100 / - |"
    assert lines[4] == "| c | no validation | - | - |"


def test_host_profile_sorts_own_time_by_part(capsys):
    site = "/venv/lib/python3.11/site-packages/"
    assert bench_engine.part_of(site + "vllm/v1/core/sched/scheduler.py", "schedule").startswith(
        "scheduler"
    )
    assert bench_engine.part_of(
        site + "vllm/v1/core/kv_cache_manager.py", "allocate_slots"
    ).startswith("scheduler")
    assert bench_engine.part_of(
        site + "vllm/v1/engine/output_processor.py", "process_outputs"
    ).startswith("engine")
    runner = site + "vllm/v1/worker/gpu_model_runner.py"
    assert bench_engine.part_of(runner, "_update_states").startswith("model runner")
    assert bench_engine.part_of(site + "vllm/config/vllm.py", "__post_init__") == "other vLLM"
    assert (
        bench_engine.part_of("~", "<built-in method torch._C._nn.linear>")
        == "torch: ops and launches"
    )
    waits = "torch: waits for results (tolist, item, cpu, sync)"
    assert bench_engine.part_of("~", "<method 'tolist' of 'torch._C.TensorBase' objects>") == waits
    assert (
        bench_engine.part_of("~", "<method 'synchronize' of 'torch._C._CudaEventBase' objects>")
        == waits
    )
    assert bench_engine.part_of("~", "<method 'item' of 'torch._C.TensorBase' objects>") == waits
    assert bench_engine.part_of("~", "<built-in method builtins.len>") == "Python built-ins"
    assert bench_engine.part_of("/work/rollout.py", "generate") == "other Python"

    def squares():  # Python's own time, in this function of this file: "other Python"
        total = 0
        for i in range(300_000):
            total += i * i
        return total

    res = bench_engine.host_profile(squares, top=2)
    assert res["wall_s"] > 0 and res["other Python"] > 0
    # own times add up to the call
    assert sum(v for k, v in res.items() if k != "wall_s") <= res["wall_s"] * 1.05
    out = capsys.readouterr().out
    assert "host time under cProfile" in out and "squares" in out and "the 2 functions" in out


def test_busy_while_averages_what_it_read_after_settling():
    t0, values = time.perf_counter(), []

    def read():  # what the driver would report: its window covers the idle time before fn for 0.2 s
        values.append(0 if time.perf_counter() - t0 < 0.2 else 40 + 20 * (len(values) % 2))
        return values[-1]

    ran = []
    result, busy = bench_engine.busy_while(
        lambda: (time.sleep(0.6), ran.append(1))[1], read, period=0.02, settle_s=0.25
    )
    assert result is None and ran == [1] and len(values) >= 5
    # nothing read while the driver's window covers the time before
    assert 0 not in values and 40 <= busy <= 60
    # ended too soon
    assert bench_engine.busy_while(lambda: ran.append(2) or 7, read, settle_s=5.0) == (
        7,
        None,
    )
    assert (
        bench_engine.busy_while(lambda: time.sleep(0.2), lambda: None, period=0.02, settle_s=0.0)[1]
        is None
    )
    # no reader
    assert bench_engine.busy_while(lambda: ran.append(3) or 8, None) == (8, None) and ran == [
        1,
        2,
        3,
    ]
    if not bench_engine.GPU:
        assert bench_engine.nvml_gpu_busy() is None


def test_scaling_table_by_hand(tmp_path, capsys):
    def run(name, thr, steps, gap=0.01):
        path = tmp_path / f"{name}.jsonl"
        rows = [
            ROW
            | {
                "step": i + 1,
                "timing_s/step": t,
                "perf/throughput": x,
                "rollout/logprob_gap_mean": gap,
                "perf/max_memory_allocated_gb": 10.0 + i,
                "timing_s/since_launch": 60.0 * (i + 1),
            }
            for i, (t, x) in enumerate(zip(steps, thr))
        ]
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
        return str(path)

    # the first step is warm-up: medians over steps 2-3. 1 GPU: 1000 tok/s/GPU; 2 GPUs: median(900,
    # 700) = 800
    one = run("one", [50.0, 1000.0, 1000.0], [30.0, 20.0, 20.0])
    two = run("two", [50.0, 900.0, 700.0], [30.0, 11.0, 13.0])
    assert (
        scaling_table.summary(two)["throughput"] == 800.0
        and scaling_table.summary(two)["step"] == 12.0
    )
    assert scaling_table.summary(two)["peak_gb"] == 12.0  # the largest over all steps
    scaling_table.main([f"1:1:{one}", f"2:2:{two}"])
    lines = capsys.readouterr().out.splitlines()
    # only phases that ran
    assert lines[0].split()[:2] == ["GPUs", "TP"] and "values" not in lines[0]
    assert lines[2].split()[:2] == ["2", "2"] and "0.80" in lines[2].split()  # 800 / 1000
    # step 1's
    assert lines[0].split()[-3:] == ["first", "step", "s"] and lines[2].split()[-1] == "60"


def test_profile_step_runs_on_a_tiny_model(tmp_path):
    """bench/profile_step.py end to end on CPU: the table of passes, eager and compiled (the update
    too), host against device time per mode, and both operator profiles."""
    import subprocess

    from bench.tiny import make_tiny_model

    model = make_tiny_model(str(tmp_path / "model"))
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "MASTER_PORT": "29713"}
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc_per_node=1",
            "--master_port",
            "29713",
            "bench/profile_step.py",
            "--model",
            model,
            "--sequences",
            "8",
            "--mini_batch",
            "4",
            "--max_response_length",
            "32",
            "--log_prob_tokens",
            "512",
            "--update_tokens",
            "256",
            "--repeats",
            "1",
            "--modes",
            "eager",
            "train",
            "fused",
            "--out",
            str(tmp_path / "out"),
        ],
        cwd=root,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = [
        line.split()[:2]
        for line in proc.stdout.splitlines()
        if line.startswith(("eager", "train", "fused"))
    ]
    assert rows == [
        ["eager", "log_prob"],
        ["eager", "update"],
        ["train", "log_prob"],
        ["train", "update"],
        ["fused", "log_prob"],
        ["fused", "update"],
    ], proc.stdout
    assert "top operators" in proc.stdout
    for mode in ("eager", "train", "fused"):
        assert f"# {mode}: one update micro-batch of " in proc.stdout, proc.stdout
    for mode in ("train", "fused"):
        diff = [
            line for line in proc.stdout.splitlines() if line.startswith(f"# {mode}: |log-prob")
        ]
        assert len(diff) == 1 and float(diff[0].split()[-3].rstrip(",")) < 1e-4, proc.stdout
    for name in ("profile_log_prob.txt", "profile_update.txt"):
        assert "aten::" in (tmp_path / "out" / name).read_text()
    # the compile summary: the train mode compiled graphs, and reports where the time went
    summary = proc.stdout[proc.stdout.index("torch.compile: ") :]
    assert int(summary.split()[1]) > 0 and "_compile.compile_inner" in summary, summary


def test_random_model_has_the_shape_and_the_tokenizer(tmp_path, monkeypatch):
    import random_model
    from transformers import AutoConfig, AutoTokenizer

    from bench.tiny import make_tiny_model

    tok_dir = make_tiny_model(str(tmp_path / "tok"))
    small = dict(
        random_model.SHAPES["qwen3-1.7b"],
        vocab_size=320,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
    )
    monkeypatch.setitem(random_model.SHAPES, "small-qwen3", small)
    out = random_model.make("small-qwen3", tok_dir, str(tmp_path / "m"))
    config = AutoConfig.from_pretrained(out)
    assert (
        config.model_type == "qwen3" and config.num_key_value_heads == 2 and config.head_dim == 16
    )
    assert (
        AutoTokenizer.from_pretrained(out).chat_template
        == AutoTokenizer.from_pretrained(tok_dir).chat_template
    )
    assert not os.path.exists(out + ".tmp")


@pytest.mark.parametrize("no_grad", [False, True])
def test_fused_head_bench_runs_both_ways_and_agrees(tmp_path, no_grad):
    """bench/fused_head.py at a small shape: a row per way with its peak, and the fused gradients
    (with --no_grad: log-probs and entropy) equal the logits path's."""
    import subprocess

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    proc = subprocess.run(
        [
            sys.executable,
            "bench/fused_head.py",
            "--tokens",
            "64",
            "--hidden",
            "16",
            "--vocab",
            "512",
            *(["--no_grad"] if no_grad else []),
        ],
        cwd=root,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    rows = [line.split() for line in proc.stdout.splitlines() if line.strip().startswith("64 ")]
    assert [r[1] for r in rows] == ["logits", "fused"], proc.stdout
    assert all(float(r[2]) > 0 for r in rows)  # peak GB
    assert float(rows[1][-1]) < 1e-5, proc.stdout  # max |(grad) diff|, float32
    assert ("forward (no gradients)" in proc.stdout) == no_grad


SLOW_STOP = """
import signal, sys, time
def stop(*_):
    time.sleep(4)  # finishing the step in progress and checkpointing it
    open(sys.argv[1] + "." + __import__("os").environ["RANK"], "w").write("saved")
    sys.exit(0)
signal.signal(signal.SIGTERM, stop)
time.sleep(120)
"""


STUBBORN = """
import os, signal, sys, time
signal.signal(signal.SIGTERM, signal.SIG_IGN)
open(sys.argv[1] + "." + os.environ["RANK"], "w").write(str(os.getpid()))
time.sleep(120)
"""


def test_limit_kills_workers_that_outlive_the_grace_period(tmp_path):
    """Workers that do not stop by the grace period's end are killed with torchrun: torchrun starts
    each in a session of its own, so killing the command's session alone would leave them running,
    orphaned (and holding the command's output open)."""
    import subprocess
    import time

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    script = tmp_path / "stubborn.py"
    script.write_text(STUBBORN)
    cmd = f"{sys.executable} -m torch.distributed.run --nproc_per_node=2 --master_port 0 {script} "
    start = time.monotonic()
    subprocess.run(
        ["bash", os.path.join(root, "bench/limit.sh"), "8", "1", cmd + f"{tmp_path}/pid"],
        env={**os.environ, "TORCH_ELASTIC_SHUTDOWN_TIMEOUT": "1"},
        capture_output=True,
        timeout=100,
    )
    assert time.monotonic() - start < 60
    pids = [int(p.read_text()) for p in tmp_path.glob("pid.*")]
    assert len(pids) == 2  # both had started by the limit

    def running(pid):  # a killed process not yet reaped is a zombie, not running
        try:
            return open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0] != "Z"
        except FileNotFoundError:
            return False

    time.sleep(1)
    assert not [pid for pid in pids if running(pid)]


def test_limit_signals_the_workers_and_lets_them_finish(tmp_path):
    """bench/limit.sh at its limit signals torchrun's workers only: torchrun, told to give them 1 s
    after a signal of its own, waits for them as they take 4 s to checkpoint and exit cleanly. Also
    when a command follows torchrun's: its shell then waits for torchrun, and its command line names
    it (the two commands run side by side). A torchrun whose workers have not started yet gets the
    signal itself."""
    import socket
    import subprocess
    import time

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    script = tmp_path / "slow_stop.py"
    script.write_text(SLOW_STOP)
    env = {**os.environ, "TORCH_ELASTIC_SHUTDOWN_TIMEOUT": "1"}

    def command(saved):
        return (
            f"{sys.executable} -m torch.distributed.run --nproc_per_node=2 --master_port 0 "
            f"{script} {tmp_path}/{saved}"
        )

    def limit(seconds, grace, cmd):
        return subprocess.Popen(
            ["bash", os.path.join(root, "bench/limit.sh"), str(seconds), str(grace), cmd],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )

    start = time.monotonic()
    # 15 s: the workers have started and set their handler by then, on a slow machine too (a 2-core
    # machine took more than 2 s)
    runs = {
        after: limit(15, 60, command(f"saved{i}") + after)
        for i, after in enumerate(["", " && true"])
    }
    for after, proc in runs.items():
        output = proc.communicate(timeout=120)[0]
        assert proc.returncode == 0, (after, output[-5000:])
    for i in range(2):
        assert sorted(p.name for p in tmp_path.glob(f"saved{i}.*")) == [
            f"saved{i}.0",
            f"saved{i}.1",
        ]
    assert time.monotonic() - start < 50  # ended with the workers, not at the grace period's end
    # a limit reached before torchrun has started its workers stops torchrun itself, at once: one
    # node of two waits for the other before it starts any, for ever (a limit of 0 on a loaded
    # machine could still find the workers started)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    start = time.monotonic()
    waiting = command("early").replace(
        "--master_port 0", f"--nnodes 2 --node_rank 0 --master_addr 127.0.0.1 --master_port {port}"
    )
    proc = limit(1, 60, waiting)
    proc.communicate(timeout=120)
    # no worker ran to checkpoint
    assert proc.returncode != 0 and not list(tmp_path.glob("early.*"))
    assert time.monotonic() - start < 30  # not at the grace period's end
    # a command without torchrun gets the signal itself
    proc = subprocess.run(
        ["bash", os.path.join(root, "bench/limit.sh"), "1", "30", "sleep 20"], timeout=60
    )
    assert proc.returncode == 143  # 128 + SIGTERM


def test_background_runs_past_its_caller_and_is_found_by_name(tmp_path):
    """bench/background.sh: a command started in its own session outlives the call that started it;
    `wait` says whether it has ended (exit 1 while it runs, its status once it has), `start` refuses
    a second run of one name, and `stop` ends the whole session, what the command started
    included."""
    import subprocess

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "BG_DIR": str(tmp_path / "bg")}

    def bg(*args, timeout=60):
        return subprocess.run(
            ["bash", os.path.join(root, "bench/background.sh"), *args],
            env=env,
            capture_output=True,
            text=True,
            timeout=timeout,
        )

    assert (
        bg("start", "quick", f"echo hello; echo err >&2; touch {tmp_path}/done; exit 3").returncode
        == 0
    )
    waited = bg("wait", "quick", "30")
    assert waited.returncode == 0 and "quick ended with status 3" in waited.stdout, (
        waited.stdout + waited.stderr
    )
    assert (tmp_path / "bg" / "quick.log").read_text().split() == ["hello", "err"]
    assert (tmp_path / "done").exists()

    # its caller gone (the start returned), the run goes on; a pid file, not a command line, finds
    # it
    assert bg("start", "slow", f"sleep 60 & sleep 60; touch {tmp_path}/not_stopped").returncode == 0
    waited = bg("wait", "slow", "1")
    assert waited.returncode == 1 and "slow still running after" in waited.stdout
    again = bg("start", "slow", "true")
    assert again.returncode == 1 and "slow is already running" in again.stderr
    start = time.monotonic()
    assert bg("stop", "slow", "5").returncode == 0
    assert time.monotonic() - start < 5  # the sleeps ended at the SIGTERM
    waited = bg("wait", "slow", "5")
    assert waited.returncode == 0 and "status ? (killed)" in waited.stdout
    pid = (tmp_path / "bg" / "slow.pid").read_text().strip()
    left = subprocess.run(["pgrep", "-s", pid], capture_output=True, text=True)
    # nothing of its session is left, the background sleep included
    assert left.stdout == "", left.stdout
    assert not (tmp_path / "not_stopped").exists()

    for args in (
        ("wait", "nobody", "1"),
        ("stop", "nobody"),
        ("wait", "quick", "soon"),
        ("start", "x"),
    ):
        assert bg(*args).returncode == 2, args


COMPILES_AND_EXITS = """
import os, torch
double = torch.compile(lambda x: x * 2 + 1)
assert double(torch.ones(3)).tolist() == [3.0, 3.0, 3.0]
os._exit(0)  # as the train scripts end
"""


def test_compile_times_reports_the_graphs_of_a_script_that_exits_at_once(tmp_path):
    """bench/compile_times.py runs a script that compiles one function and ends with os._exit, and
    still prints and writes where compiling went: one graph."""
    script = tmp_path / "script.py"
    script.write_text(COMPILES_AND_EXITS)
    proc = subprocess.run(
        [sys.executable, os.path.join(ROOT, "bench", "compile_times.py"), str(script)],
        env={**os.environ, "OUT": str(tmp_path)},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    written = (tmp_path / "compile_times.txt").read_text()
    assert "torch.compile: 1 graphs" in written and written.strip() in proc.stdout
    assert "compile_inner" in written  # Dynamo's timers, by phase


def test_verl_grpo_keeps_the_raw_log_and_each_steps_numbers(tmp_path):
    """bench/verl_grpo.py around a stand-in for verl's trainer that prints as verl's console logger
    does (behind Ray's prefix, numpy scalars as numpy 2 prints them): the command and every line in
    the raw log, a row per step, the stand-in's exit status passed on."""
    import verl_grpo

    line = "(TaskRunner pid=7) step:2 - timing_s/step:283.5 - a/b@1:np.float64(0.25)"
    assert verl_grpo.parse_step(line) == (2, {"timing_s/step": 283.5, "a/b@1": 0.25})
    assert verl_grpo.parse_step("Training Progress:  33%|###  | 1/3") is None
    fake = tmp_path / "fake" / "verl" / "trainer"
    fake.mkdir(parents=True)
    for init in (fake.parent / "__init__.py", fake / "__init__.py"):
        init.write_text("")
    (fake / "main_ppo.py").write_text(
        "import sys\n"
        "assert 'actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4' in sys.argv\n"
        "assert 'trainer.total_training_steps=2' in sys.argv and sys.argv[-1] == 'trainer.seed=3'\n"
        "import importlib.util\n"  # SDPA without packed sequences where flash-attn is missing
        "sdpa = '+actor_rollout_ref.model.override_config.attn_implementation=sdpa' in sys.argv\n"
        "assert sdpa == (importlib.util.find_spec('flash_attn') is None)\n"
        "assert sdpa == ('actor_rollout_ref.model.use_remove_padding=False' in sys.argv)\n"
        "print('(TaskRunner pid=7) step:1 - timing_s/gen:30.5 - timing_s/step:290.0 - '\n"
        "      'x:np.int64(4)')\n"
        "print('some other line')\n"
        "print('(TaskRunner pid=7) step:2 - timing_s/gen:29.0 - timing_s/step:283.0')\n"
        "sys.exit(3)\n"
    )
    out = tmp_path / "out"
    proc = subprocess.run(
        [sys.executable, os.path.join(ROOT, "bench", "verl_grpo.py"), "--model", "M", "--data", "D"]
        + ["--out", str(out), "--steps", "2", "trainer.seed=3"],
        env=dict(os.environ, PYTHONPATH=str(tmp_path / "fake")),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 3, proc.stderr
    log = (out / "verl.log").read_text().splitlines()
    assert log[0].startswith("$ ") and "-m verl.trainer.main_ppo" in log[0]
    assert "data.train_files=D/train.parquet" in log[0] and "some other line" in log
    rows = [json.loads(line) for line in (out / "verl_steps.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    assert rows[0]["timing_s/gen"] == 30.5 and rows[0]["x"] == 4 and rows[1]["timing_s/step"] == 283
    assert 0 < rows[0]["timing_s/since_launch"] <= rows[1]["timing_s/since_launch"]
