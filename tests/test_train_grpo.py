"""train_grpo.py end to end on CPU: two real steps under `torchrun --nproc_per_node=2` (gloo) with
each rollout engine, resume equivalence, a finished run, and start-up failures (dynamic sampling:
tests/test_train_grpo_filter.py; the rows written and the validation metrics by hand:
tests/test_batches.py, tests/test_reward.py).

Data: a 24-prompt GSM8K-shaped fixture made by data/gsm8k.py; model: the tiny random Qwen2 of
bench/tiny.py; reward: the share of ASCII letters and digits in the response, which a random
model scores unevenly, so groups differ and advantages are non-zero.
"""

import json
import math
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from types import SimpleNamespace

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from safetensors.torch import load_file

import checkpoint
import run
from bench.tiny import make_tiny_model
from tests.tiny_model import free_port

ROOT = Path(__file__).resolve().parents[1]
LR = 1e-4
# every metric the trainer logs on each step; STEP2_ONLY appear with validation (--test_freq 2)
METRICS = [
    "critic/score/mean",
    "critic/score/max",
    "critic/score/min",
    "critic/advantages/mean",
    "response_length/mean",
    "response_length/max",
    "response_length/clip_ratio",
    "prompt_length/mean",
    "actor/pg_loss",
    "actor/pg_clipfrac",
    "actor/pg_clipfrac_lower",
    "actor/ppo_kl",
    "actor/kl_loss",
    "actor/entropy",
    "actor/grad_norm",
    "actor/lr",
    "timing_s/gen",
    "timing_s/old_log_prob",
    "timing_s/ref",
    "timing_s/adv",
    "timing_s/update_actor",
    "timing_s/update_weights",
    "timing_s/step",
    "timing_s/since_launch",
    "perf/throughput",
    "perf/mfu/actor",
    "perf/max_memory_allocated_gb",
    "rollout/logprob_gap_mean",
    "perf/mfu/old_log_prob",
    "perf/tflops/actor",
    "perf/weight_sync_gb_s",
    "perf/peak_tflops",
    "rollout/gen_rounds",
    "rollout/gen_prompts",
    "rollout/all_equal_groups",
    "rollout/solve_none",
    "rollout/solve_all",
    "rollout/skipped_prompts",
]
STEP2_ONLY = [
    "timing_s/testing",
    "val-core/openai/gsm8k/reward/mean@1",
    "val-core/openai/gsm8k/reward_flexible/mean@1",
    "val-core/openai/gsm8k/acc/mean@1",
]
REWARD = '''
def compute_score(data_source, solution_str, ground_truth, extra_info=None, **kwargs):
    """Share of ASCII letters and digits in the response; "acc": whether that is over half."""
    share = sum(c.isascii() and c.isalnum() for c in solution_str) / max(1, len(solution_str))
    return {"score": share, "acc": float(share > 0.5)}
'''


def raw_rows(k, seed):
    """k made-up sums, short enough that a chat-templated prompt stays ~90 bytes = ~90 tokens."""
    rows = []
    for i in range(k):
        a, b = (seed * 7 + i * 3) % 10, (seed + i * 5) % 9 + 1
        rows.append(
            {"question": f"What is {a} plus {b}?", "answer": f"{a} + {b} = {a + b}\n#### {a + b}"}
        )
    return rows


def make_assets(tmp):
    """Parquet files (24 train / 8 test prompts), the tiny model and the reward file, in folder
    `tmp`."""
    raw = tmp / "raw"
    raw.mkdir()
    for split, k, seed in (("train", 24, 0), ("test", 8, 1)):
        (raw / f"{split}.jsonl").write_text(
            "".join(json.dumps(r) + "\n" for r in raw_rows(k, seed))
        )
    subprocess.run(
        [
            sys.executable,
            "data/gsm8k.py",
            "--local_dataset_path",
            str(raw),
            "--local_save_dir",
            str(tmp / "data"),
        ],
        cwd=ROOT,
        check=True,
        capture_output=True,
    )
    (tmp / "reward_fn.py").write_text(REWARD)
    return dict(
        tmp=tmp,
        model=make_tiny_model(str(tmp / "model")),
        data=tmp / "data",
        reward=tmp / "reward_fn.py",
    )


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    return make_assets(tmp_path_factory.mktemp("grpo_e2e"))


def flags(assets, out_dir, engine, steps, resume="disable", *extra):
    return [
        "--model",
        assets["model"],
        "--train_files",
        str(assets["data"] / "train.parquet"),
        "--val_files",
        str(assets["data"] / "test.parquet"),
        "--custom_reward_function_path",
        str(assets["reward"]),
        "--rollout_engine",
        engine,
        "--max_prompt_length",
        "256",
        "--max_response_length",
        "16",
        "--train_batch_size",
        "4",
        "--rollout_n",
        "2",
        "--ppo_mini_batch_size",
        "2",
        "--ppo_micro_batch_size_per_gpu",
        "1",
        "--log_prob_micro_batch_size_per_gpu",
        "2",
        "--total_training_steps",
        str(steps),
        "--test_freq",
        "2",
        "--val_before_train",  # the base model's scores at step 0 (verl's tutorials turn it off)
        "true",
        "--max_val_samples",
        "8",
        "--actor_lr",
        str(LR),
        "--lr_warmup_steps",
        "2",
        "--save_freq",
        "1",
        "--logger",
        "console,jsonl",
        # 1 of each rank's 2 prompts gets the engine's log-probs: the sync check on a subset
        "--logprob_check_prompts",
        "1",
        "--default_local_dir",
        str(out_dir),
        "--resume_mode",
        resume,
        *extra,
    ]


def launch(args, nproc=2, timeout=300, env=None):
    """train_grpo.py under torchrun (nproc > 0) or as a plain single process (nproc = 0), with
    `env` added to the environment."""
    env = {
        **os.environ,
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "MASTER_PORT": str(free_port()),
        **(env or {}),
    }
    cmd = [sys.executable, "train_grpo.py", *args]
    if nproc:
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            f"--nproc_per_node={nproc}",
            "--master_port",
            env["MASTER_PORT"],
            "train_grpo.py",
            *args,
        ]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    proc.output = proc.stdout + proc.stderr
    return proc


# Most of a launch that stops at start-up is importing torch and transformers (~10 s of CPU). FORKED
# imports them once, then runs train_grpo.py as __main__ in a forked child per argument list: each a
# process of its own (a world of one), with its own output and exit status, as from the command
# line.
FORKED = """
import json, os, runpy, sys, traceback
import train_grpo  # noqa: F401 - the imports, before forking
from tests.tiny_model import free_port

codes = []
for i, args in enumerate(json.load(sys.stdin)):
    sys.stdout.flush()
    pid = os.fork()
    if pid == 0:
        log = os.open(f"{sys.argv[1]}.{i}", os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        os.dup2(log, 1)
        os.dup2(log, 2)
        os.environ["MASTER_PORT"] = str(free_port())
        sys.argv = ["train_grpo.py", *args]
        code = 0
        try:
            runpy.run_path("train_grpo.py", run_name="__main__")
        except SystemExit as e:  # as the interpreter would: a message goes to stderr, with status 1
            if e.code is not None and not isinstance(e.code, int):
                print(e.code, file=sys.stderr)
            code = e.code if isinstance(e.code, int) else int(e.code is not None)
        except BaseException:
            traceback.print_exc()
            code = 1
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    codes.append(os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]))
print(json.dumps(codes))
"""


def launch_forked(arg_lists, timeout=300):
    """train_grpo.py once per argument list, each as a plain single process (launch(args, nproc=0)),
    forked from one that has done the imports (FORKED); the results in the order of `arg_lists`."""
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1"}
    with tempfile.TemporaryDirectory() as tmp:
        proc = subprocess.run(
            [sys.executable, "-c", FORKED, f"{tmp}/out"],
            input=json.dumps(arg_lists),
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=timeout,
        )
        assert proc.returncode == 0, (proc.stdout + proc.stderr)[-6000:]
        codes = json.loads(proc.stdout.splitlines()[-1])
        return [
            SimpleNamespace(
                returncode=code, output=Path(f"{tmp}/out.{i}").read_text(errors="replace")
            )
            for i, code in enumerate(codes)
        ]


def metrics_by_step(out_dir, name="metrics.jsonl"):
    with open(Path(out_dir) / name) as f:
        return {row["step"]: row for row in map(json.loads, f)}


def val_only_metrics(assets, checkpoint, out_dir):
    """--val_only on a checkpoint (a global_step_N folder) with the transformers engine, as one
    process: its metrics at that step. fp32 on CPU, its greedy tokens are vLLM's
    (tests/dist/engine_checks.py checks it)."""
    proc = launch(
        flags(assets, out_dir, "hf", 3, str(checkpoint), "--val_only", "--export_final", "false"),
        nproc=0,
    )
    assert proc.returncode == 0, proc.output[-6000:]
    assert f": {out_dir / 'val_only.jsonl'}" in proc.output  # where its rows went, said
    return metrics_by_step(out_dir, "val_only.jsonl")[int(Path(checkpoint).name.rsplit("_", 1)[1])]


def two_step_run(assets, engine, *extra):
    out = assets["tmp"] / f"run_{engine}"
    proc = launch(flags(assets, out, engine, 2, "disable", *extra))
    assert proc.returncode == 0, proc.output[-6000:]
    return out


@pytest.fixture(scope="module")
def hf_run(assets):
    """Micro-batches by token budget (the same count on both ranks), compiled; the vLLM run by
    count, eager."""
    budget = ["--ppo_max_token_len_per_gpu", "300", "--log_prob_max_token_len_per_gpu", "300"]
    compiled = [
        "--use_torch_compile",
        "true",
        "--compile_layers",
        "true",
        "--compile_update",
        "true",
    ]
    return two_step_run(assets, "hf", "--use_dynamic_bsz", *budget, *compiled)


@pytest.fixture(scope="module")
def vllm_run(assets):
    """Activations recomputed in the update (Hugging Face's checkpointing under FSDP2); every
    response written out as text."""
    dumps = assets["tmp"] / "dumps"
    dirs = [
        "--rollout_data_dir",
        str(dumps / "rollouts"),
        "--validation_data_dir",
        str(dumps / "val"),
    ]
    return two_step_run(assets, "vllm", "--enable_gradient_checkpointing", *dirs)


@pytest.mark.parametrize("run", ["hf_run", "vllm_run"])
def test_two_steps_log_every_metric_and_change_the_policy(run, assets, request):
    out = request.getfixturevalue(run)
    m = metrics_by_step(out)
    assert sorted(m) == [0, 1, 2]  # 0: validation before training
    vocab = json.loads((Path(assets["model"]) / "config.json").read_text())["vocab_size"]
    for step, names in ((1, METRICS), (2, METRICS + STEP2_ONLY)):
        missing = [k for k in names if k not in m[step]]
        assert not missing, f"step {step} lacks {missing}"
        bad = {k: m[step][k] for k in names if not math.isfinite(m[step][k])}
        assert not bad, f"step {step}: non-finite {bad}"
        # fp32 trainer and fp32 engine: the engine generated with exactly the trainer's weights;
        # what is left is the two forwards' float rounding (~1e-6; a push without
        # model.norm.weight made it ~7e-5)
        assert m[step]["rollout/logprob_gap_mean"] < 1e-5
        # no KL in the reward: the rewards are the scores, each once (on the last token)
        assert m[step]["critic/rewards/mean"] == pytest.approx(m[step]["critic/score/mean"])
        assert m[step]["actor/grad_norm"] > 0
        assert 0 < m[step]["response_length/mean"] <= m[step]["response_length/max"] <= 16
        assert (
            m[step]["critic/score/min"]
            <= m[step]["critic/score/mean"]
            <= m[step]["critic/score/max"]
        )
        # a token mean (the old pass's), below uniform's
        assert 0 < m[step]["actor/entropy"] < math.log(vocab)
        # no filter: one batch
        assert m[step]["rollout/gen_rounds"] == 1 and m[step]["rollout/gen_prompts"] == 4
        assert 0 <= m[step]["rollout/all_equal_groups"] <= 1
        assert 0 <= m[step]["rollout/solve_none"] <= 1 and 0 <= m[step]["rollout/solve_all"] <= 1
    # some group had signal
    assert any(m[s]["critic/score/max"] > m[s]["critic/score/min"] for s in (1, 2))
    # --lr_warmup_steps 2: step 1 trains at (0 + 1) / 2 * LR, step 2 at LR
    assert m[1]["actor/lr"] == pytest.approx(LR / 2) and m[2]["actor/lr"] == pytest.approx(LR)
    assert "val-core/openai/gsm8k/reward/mean@1" in m[0]

    initial = load_file(os.path.join(assets["model"], "model.safetensors"))
    final = load_file(out / "hf_model" / "model.safetensors")
    assert initial.keys() == final.keys()
    for name, w in initial.items():
        # the export is bf16: compare at that precision; ~half the entries move past rounding
        if w.dim() == 2:
            changed = (w.to(final[name].dtype) != final[name]).float().mean().item()
            assert changed > 0.1, f"{name}: only {changed:.1%} of entries changed"


def read_jsonl(path):
    with open(path) as f:
        return [json.loads(line) for line in f]


def test_rollout_and_validation_data_dirs_hold_every_response(assets, vllm_run):
    """--rollout_data_dir and --validation_data_dir (verl's names): every response of each step and
    of each validation as text, with the scores the metrics averaged, validation in the data's
    order."""
    m, dumps = metrics_by_step(vllm_run), assets["tmp"] / "dumps"
    # nothing half-written left
    assert sorted(os.listdir(dumps / "rollouts")) == [
        "1.jsonl",
        "2.jsonl",
    ]
    for step in (1, 2):
        rows = read_jsonl(dumps / "rollouts" / f"{step}.jsonl")
        assert len(rows) == 4 * 2 and {r["step"] for r in rows} == {step}
        assert set(rows[0]) == {"input", "output", "gts", "score", "step", "score_flexible", "acc"}
        assert sum(r["score"] for r in rows) / len(rows) == pytest.approx(
            m[step]["critic/score/mean"]
        )
        # a group: one prompt
        assert all(rows[i]["input"] == rows[i + 1]["input"] for i in range(0, 8, 2))
        assert all("What is" in r["input"] and r["gts"] == r["gts"].strip() for r in rows)
    data = pq.read_table(assets["data"] / "test.parquet").to_pylist()
    # before training, and at step 2
    assert sorted(os.listdir(dumps / "val")) == [
        "0.jsonl",
        "2.jsonl",
    ]
    for step in (0, 2):
        rows = read_jsonl(dumps / "val" / f"{step}.jsonl")
        # both ranks validated half: the file holds the 8 prompts in the data's order
        assert [r["gts"] for r in rows] == [d["reward_model"]["ground_truth"] for d in data[:8]]
        assert all(d["prompt"][0]["content"] in r["input"] for r, d in zip(rows, data))
        prefix = "val-core/openai/gsm8k/"
        assert sum(r["score"] for r in rows) / 8 == pytest.approx(m[step][prefix + "reward/mean@1"])
        assert sum(r["score_flexible"] for r in rows) / 8 == pytest.approx(
            m[step][prefix + "reward_flexible/mean@1"]
        )
        # the reward's extra
        assert sum(r["acc"] for r in rows) / 8 == pytest.approx(m[step][prefix + "acc/mean@1"])


def test_resume_replays_the_uninterrupted_run(assets, vllm_run):
    out = assets["tmp"] / "run_vllm_resumed"
    first = launch(flags(assets, out, "vllm", 1))
    assert first.returncode == 0, first.output[-6000:]
    second = launch(flags(assets, out, "vllm", 2, "auto"))
    assert second.returncode == 0, second.output[-6000:]
    assert "resumed from" in second.output and "global_step_1" in second.output
    # the export's time, its last line (no GPU: no peak)
    assert re.search(r"^export: \d+\.\d s$", second.stdout, re.M)
    resumed, whole = metrics_by_step(out), metrics_by_step(vllm_run)
    assert sorted(resumed) == [0, 1, 2]
    for step in (1, 2):
        keys = {k for k in whole[step] if not k.startswith(("timing_s/", "perf/"))}
        # the first launch's last step (1) also validated, so its row has the val-* metrics on top
        assert (
            keys <= resumed[step].keys()
            if step == 1
            else keys == {k for k in resumed[step] if not k.startswith(("timing_s/", "perf/"))}
        )
        differ = {
            k: (whole[step][k], resumed[step][k])
            for k in keys
            if resumed[step][k] != pytest.approx(whole[step][k], rel=1e-6, abs=1e-12)
        }
        assert not differ, f"step {step} differs after resuming: {differ}"
    a = load_file(vllm_run / "hf_model" / "model.safetensors")
    b = load_file(out / "hf_model" / "model.safetensors")
    for name in a:
        torch.testing.assert_close(b[name], a[name], rtol=0, atol=0, msg=name)


def test_fused_kernels_train_the_same_step(assets, vllm_run):
    """--use_fused_kernels changes how the update computes its log-probs (chunks of the output
    layer, no whole logits), not what it computes: the first step, on the same rollouts, logs the
    losses, KL, entropy and gradient norm of the run without it."""
    out = assets["tmp"] / "run_vllm_fused"
    proc = launch(flags(assets, out, "vllm", 1, "disable", "--use_fused_kernels", "true"))
    assert proc.returncode == 0, proc.output[-6000:]
    fused, whole = metrics_by_step(out)[1], metrics_by_step(vllm_run)[1]
    keys = [k for k in whole if k.startswith(("actor/", "critic/"))]
    assert {"actor/pg_loss", "actor/kl_loss", "actor/entropy", "actor/grad_norm"} <= set(keys)
    differ = {
        k: (whole[k], fused[k])
        for k in keys
        if fused[k] != pytest.approx(whole[k], rel=1e-5, abs=1e-9)
    }
    assert not differ, differ


SIGTERM_WHILE_TRAINING = '''
import os, signal
def compute_score(data_source, solution_str, ground_truth, extra_info=None, **kwargs):
    """Once the test asks (its file exists), the next training response scored sends the whole job
    (torchrun and both ranks) a SIGTERM, once, as `timeout` does: it lands while a step trains,
    never while one validates, whatever the machine's speed."""
    if extra_info["split"] == "train" and os.path.exists(__file__ + ".ask"):
        try:
            os.close(os.open(__file__ + ".signalled", os.O_CREAT | os.O_EXCL))
            os.killpg(os.getpgid(0), signal.SIGTERM)
        except FileExistsError:
            pass
    return 0.5
'''


def stop_by_sigterm_then_resume(script, out, make_flags):
    """Run `script` on two ranks for 20 steps (`make_flags(steps, resume)`: checkpoints every 10
    steps, validation every step) and, once step 1 is logged, have SIGTERM sent to the whole job
    while a step trains (SIGTERM_WHILE_TRAINING), as `timeout` or a batch scheduler does. Check
    that the step in progress was checkpointed and the run stopped without validating it or
    exporting; then resume for one more step. Returns the step it stopped after."""
    import signal
    import time

    env = {**os.environ, "MASTER_PORT": str(free_port())}
    log = out.parent / f"{out.name}.log"
    reward_fn = out.parent / f"{out.name}_reward.py"
    reward_fn.write_text(SIGTERM_WHILE_TRAINING)

    def run_flags(steps, resume):
        return [*make_flags(steps, resume), "--custom_reward_function_path", str(reward_fn)]

    with open(log, "w") as f:
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc_per_node=2",
            "--master_port",
            env["MASTER_PORT"],
            script,
            *run_flags(20, "disable"),
        ]
        proc = subprocess.Popen(
            cmd, cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT, start_new_session=True
        )
        try:
            deadline = time.time() + 240
            while not (
                (out / "metrics.jsonl").exists()
                and '"step": 1,' in (out / "metrics.jsonl").read_text()
            ):
                assert proc.poll() is None and time.time() < deadline, log.read_text()[-6000:]
                time.sleep(0.2)
            (reward_fn.parent / f"{reward_fn.name}.ask").touch()  # the signal, at the next scoring
            proc.wait(timeout=120)
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
    output = log.read_text()
    stopped = [line for line in output.splitlines() if "stopped by SIGTERM after step" in line]
    assert len(stopped) == 1, output[-6000:]
    k = int(stopped[0].split("after step ")[1].split()[0])
    assert 1 <= k < 20 and "--resume_mode auto" in stopped[0]
    assert os.path.basename(checkpoint.latest_checkpoint(str(out))) == f"global_step_{k}"
    logged = metrics_by_step(out)
    assert (
        max(logged) == k
        and "timing_s/testing" in logged[k - 1]
        and "timing_s/testing" not in logged[k]
    )
    assert not (out / "hf_model").exists()
    env["MASTER_PORT"] = str(free_port())
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node=2",
        "--master_port",
        env["MASTER_PORT"],
        script,
        *run_flags(k + 1, "auto"),
    ]
    resumed = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert resumed.returncode == 0, (resumed.stdout + resumed.stderr)[-6000:]
    assert f"resumed from {out / f'global_step_{k}'}" in resumed.stdout
    assert sorted(metrics_by_step(out))[-1] == k + 1 and (out / "hf_model").exists()
    return k


def test_sigterm_checkpoints_the_step_in_progress_and_resume_continues(assets):
    """SIGTERM during a run with GRPO's default --save_freq -1 (no checkpoint of its own) loses no
    step: the stop is checkpointed all the same (stop_by_sigterm_then_resume)."""
    out = assets["tmp"] / "run_sigterm"
    stop_by_sigterm_then_resume(
        "train_grpo.py",
        out,
        lambda steps, resume: flags(assets, out, "hf", steps, resume, "--test_freq", "1"),
    )


SIGTERM_IN_VALIDATION = '''
import os, signal
def compute_score(data_source, solution_str, ground_truth, extra_info=None, **kwargs):
    """The test set's first response scored sends this rank a SIGTERM, once: it lands in
    validation."""
    if extra_info["split"] == "test":
        try:
            os.close(os.open(__file__ + ".signalled", os.O_CREAT | os.O_EXCL))
            os.kill(os.getpid(), signal.SIGTERM)
        except FileExistsError:
            pass
    return 0.5
'''


def stop_in_validation(run, out, make_flags):
    """A SIGTERM that arrives while a step validates (9-17 s on an H200) stops the run after that
    step, checkpointed, instead of running the next step first (which can outlast the grace period).
    `run` launches two ranks with `make_flags(reward_file)` (20 steps, validation every 2 from step
    2, checkpoints every 10); the reward function signals one rank, and both stop."""
    reward_fn = out.parent / f"{out.name}_reward.py"
    reward_fn.write_text(SIGTERM_IN_VALIDATION)
    proc = run(make_flags(reward_fn))
    assert proc.returncode == 0, proc.output[-6000:]
    assert "stopped by SIGTERM after step 2 of 20" in proc.output, proc.output[-6000:]
    assert os.path.basename(checkpoint.latest_checkpoint(str(out))) == "global_step_2"
    logged = metrics_by_step(out)
    assert (
        max(logged) == 2
        and "timing_s/testing" in logged[2]
        and "timing_s/save_checkpoint" in logged[2]
    )


def test_sigterm_during_validation_stops_after_that_step(assets):
    out = assets["tmp"] / "run_sigterm_val"
    stop_in_validation(
        launch,
        out,
        lambda reward_fn: flags(
            assets,
            out,
            "hf",
            20,
            "disable",
            "--save_freq",
            "10",
            "--test_freq",
            "2",
            "--val_before_train",
            "false",
            "--custom_reward_function_path",
            str(reward_fn),
        ),
    )


def test_a_sigterm_in_the_last_step_checkpoints_it_and_the_same_command_exports(assets):
    """A SIGTERM while the last step validates (a final export can outlast the grace period too):
    that step is checkpointed, whatever --save_freq says (GRPO's default -1 here), and not
    exported; the same command then writes the final policy and trains nothing."""
    out = assets["tmp"] / "run_sigterm_last"
    reward_fn = out.parent / f"{out.name}_reward.py"
    reward_fn.write_text(SIGTERM_IN_VALIDATION)
    extra = ["--save_freq", "-1", "--test_freq", "2", "--val_before_train", "false"]
    extra += ["--custom_reward_function_path", str(reward_fn)]
    proc = launch(flags(assets, out, "hf", 2, "disable", *extra))
    assert proc.returncode == 0, proc.output[-6000:]
    assert (
        "stopped by SIGTERM after step 2 of 2, checkpointed in" in proc.output
        and "--resume_mode auto writes the final policy from there" in proc.output
    ), proc.output[-6000:]
    assert os.path.basename(checkpoint.latest_checkpoint(str(out))) == "global_step_2"
    assert not (out / "hf_model").exists()
    again = launch(flags(assets, out, "hf", 2, "auto", *extra))
    assert again.returncode == 0, again.output[-6000:]
    assert "step:1" not in again.output and "wrote its final policy" in again.output
    assert (out / "hf_model" / "config.json").exists()


def test_resuming_from_an_earlier_checkpoint_sets_the_later_ones_aside(assets, hf_run):
    """--resume_mode PATH at step 1 of a run that went on to step 2: the new branch's steps replace
    the old one's, whose step 2 is kept as global_step_2.abandoned, so that a later
    --resume_mode auto continues this branch, never the old."""
    out = assets["tmp"] / "branched"
    shutil.copytree(hf_run, out, ignore=shutil.ignore_patterns("hf_model", ".lock"))
    proc = launch(flags(assets, out, "hf", 2, str(out / "global_step_1"), "--val_n", "2"))
    assert proc.returncode == 0, proc.output[-6000:]
    assert f"{out / 'global_step_2'} is a later step of the branch resumed from: kept as " in (
        proc.output
    )
    assert checkpoint.list_checkpoints(str(out)) == [1, 2]  # step 2 is the new branch's
    assert (out / "global_step_2.abandoned" / "COMPLETE").exists()
    rows = metrics_by_step(out)
    assert sorted(rows) == [0, 1, 2]
    # --val_n at each validation: greedy mean@1, and sampled mean@2 and pass@k
    assert {"mean@1", "mean@2", "pass@2"} <= {
        k.rsplit("/", 1)[1] for k in rows[2] if k.startswith("val-core/openai/gsm8k/reward/")
    }


def test_resuming_a_finished_run_does_nothing(assets, hf_run):
    before = (hf_run / "metrics.jsonl").read_text()
    checkpoints = sorted(os.listdir(hf_run))
    proc = launch(flags(assets, hf_run, "hf", 2, "auto"))
    assert proc.returncode == 0, proc.output[-6000:]
    assert "already finished 2 of 2 steps" in proc.output
    assert "step:1" not in proc.output and "done:" not in proc.output  # no training, no export
    assert (hf_run / "metrics.jsonl").read_text() == before
    assert sorted(os.listdir(hf_run)) == checkpoints


def test_a_finished_run_writes_what_a_crash_left_unwritten(assets, hf_run):
    """A crash after the last checkpoint: before its metrics row reached metrics.jsonl (torn while
    written) and before the final policy was exported. The same command writes both, and trains
    nothing."""
    out = assets["tmp"] / "crashed_at_the_end"
    shutil.copytree(hf_run, out, ignore=shutil.ignore_patterns("hf_model", ".lock"))
    rows = (out / "metrics.jsonl").read_text().splitlines()
    (out / "metrics.jsonl").write_text("\n".join(rows[:-1]) + "\n" + rows[-1][:40])
    proc = launch(flags(assets, out, "hf", 2, "auto"))
    assert proc.returncode == 0, proc.output[-6000:]
    assert "step:1" not in proc.output and "wrote its final policy" in proc.output
    restored = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    whole = [json.loads(line) for line in rows]
    # the checkpoint kept step 2's row as it stood before the checkpoint was timed
    assert restored[:-1] == whole[:-1] and restored[-1]["step"] == 2
    assert restored[-1] == {k: v for k, v in whole[-1].items() if k != "timing_s/save_checkpoint"}
    assert sorted(os.listdir(out / "hf_model")) == sorted(os.listdir(hf_run / "hf_model"))


def test_a_damaged_checkpoint_is_named_and_auto_resumes_from_the_one_before(assets, hf_run):
    """The newest checkpoint's metadata truncated (a disk that filled up, a copy cut short):
    --resume_mode auto says so and resumes from the one before, with a changed --actor_lr that it
    names and applies; pointed at the damaged one, the run stops naming it."""
    out = assets["tmp"] / "damaged"
    shutil.copytree(hf_run, out, ignore=shutil.ignore_patterns("hf_model", ".lock"))
    metadata = out / "global_step_2" / ".metadata"
    metadata.write_bytes(metadata.read_bytes()[:64])
    more = ["--export_final", "false", "--actor_lr", str(2 * LR)]
    # pointed at the damaged one first (the run that resumes writes a new global_step_2)
    runs = [
        flags(assets, out, "hf", 3, str(metadata.parent)),
        flags(assets, out, "hf", 3, "auto", *more),
    ]
    named, auto = launch_forked(runs)
    assert auto.returncode == 0, auto.output[-6000:]
    assert "global_step_2 cannot be read" in auto.output
    assert "resuming from the checkpoint before it" in auto.output
    assert f"--actor_lr {LR} -> {2 * LR}" in auto.output
    m = metrics_by_step(out)
    assert [m[s]["actor/lr"] for s in (2, 3)] == [2 * LR, 2 * LR]  # warmed up: the new rate in full
    assert named.returncode == 1 and "global_step_2 cannot be read" in named.output
    assert "--resume_mode disable" in named.output


def test_a_second_run_in_the_same_folder_is_refused(assets, tmp_path):
    held = run.lock_folder(str(tmp_path / "busy"))  # as a run in progress holds it
    (proc,) = launch_forked([flags(assets, tmp_path / "busy", "hf", 2)])
    held.close()
    assert proc.returncode == 1 and "is in use by another run" in proc.output, proc.output[-3000:]


def test_val_only_scores_the_base_model_and_a_checkpoint(assets, hf_run):
    """--val_only: greedy mean@1 and, with --val_n 4, sampled mean@4 and pass@1/2/4, strict (here
    the custom reward) and flexible. Its greedy scores equal the ones the training run logged: the
    base model's before training, and, pointed at the run's last checkpoint, those weights' at that
    step. Scoring a checkpoint in its own run's folder writes val_only.jsonl, leaving the
    training's metrics.jsonl as it was."""
    sampled = ["--val_only", "--val_n", "4", "--val_temperature", "1.0"]
    base_dir, ckpt_dir = assets["tmp"] / "val_only_base", assets["tmp"] / "val_only_ckpt"
    shutil.copytree(hf_run, ckpt_dir, ignore=shutil.ignore_patterns("hf_model", ".lock"))
    trained = (ckpt_dir / "metrics.jsonl").read_text()
    base = launch(flags(assets, base_dir, "hf", 2, "disable", *sampled))
    assert base.returncode == 0, base.output[-6000:]
    ckpt = launch(flags(assets, ckpt_dir, "hf", 2, str(ckpt_dir / "global_step_2"), *sampled))
    assert ckpt.returncode == 0, ckpt.output[-6000:]
    assert "resumed from" in ckpt.output and "step:1" not in ckpt.output  # scored, did not train
    assert (ckpt_dir / "metrics.jsonl").read_text() == trained
    (base_row,), (ckpt_row,) = (
        metrics_by_step(base_dir, "val_only.jsonl").values(),
        metrics_by_step(ckpt_dir, "val_only.jsonl").values(),
    )
    assert base_row["step"] == 0 and ckpt_row["step"] == 2
    prefix = "val-core/openai/gsm8k/"
    for row in (base_row, ckpt_row):
        for name in ("reward", "reward_flexible", "acc"):
            k = {
                s: row[f"{prefix}{name}/{s}"]
                for s in ("mean@1", "mean@4", "pass@1", "pass@2", "pass@4")
            }
            assert all(0 <= v <= 1 for v in k.values()), k
            assert k["pass@1"] <= k["pass@2"] <= k["pass@4"], k
        # flexible scores and the reward's "acc" are 0 or 1, so pass@1 is the mean of the samples
        for name in ("reward_flexible", "acc"):
            assert row[f"{prefix}{name}/pass@1"] == pytest.approx(row[f"{prefix}{name}/mean@4"])
    logged = metrics_by_step(hf_run)  # the run validated before training (step 0) and at step 2
    for name in ("reward", "reward_flexible"):
        key = f"{prefix}{name}/mean@1"
        assert base_row[key] == pytest.approx(logged[0][key], abs=1e-9)
        assert ckpt_row[key] == pytest.approx(logged[2][key], abs=1e-9)
    # the weights differ
    assert base_row[f"{prefix}reward/mean@1"] != ckpt_row[f"{prefix}reward/mean@1"]


def write_parquet_without(src, dst, column):
    table = pq.read_table(src)
    pq.write_table(table.drop([column]), dst)


BAD_INPUT = [
    "rollout_n_1",
    "missing_column",
    "missing_reward_file",
    "token_budget",
    "compile_update",
    "warm_compile_caches",
    "dump_dir_is_a_file",
    "train_file_is_csv",
    "model_without_config",
    "checkpoints_under_a_file",
    "val_source_without_scorer",
    "empty_train_file",
    "loss_agg_mode",
    "reward_signature",
    "offload_on_cpu",
    "longer_than_the_model",
    "missing_data_files",
]


def bad_input(assets, case):
    """The output folder, arguments and expected error texts of a start-up failure."""
    out = assets["tmp"] / f"bad_{case}"
    expected = []
    args = flags(assets, out, "hf", 2)
    if case == "rollout_n_1":
        args[args.index("--rollout_n") + 1] = "1"
        expected = ["--rollout_n must be > 1"]
    elif case == "token_budget":
        args += ["--use_dynamic_bsz", "--ppo_max_token_len_per_gpu", "100"]
        expected = ["--ppo_max_token_len_per_gpu 100 must hold the longest sequence"]
    elif case == "compile_update":
        args += ["--compile_update", "true", "--compile_layers", "false"]
        expected = [
            "--compile_update compiles the update's decoder layers, which --compile_layers false "
            "leaves eager"
        ]
    elif case == "warm_compile_caches":  # the compiling flags are off on a CPU
        args += ["--warm_compile_caches", "true"]
        expected = [
            "--warm_compile_caches compiles the step's passes ahead, and none compiles here"
        ]
    elif case == "dump_dir_is_a_file":  # under a file
        args += ["--validation_data_dir", str(assets["reward"] / "val")]
        expected = [
            f"--validation_data_dir {assets['reward'] / 'val'}: {assets['reward']} is a file, not "
            "a folder"
        ]
    elif case == "missing_column":
        bad = assets["tmp"] / "no_reward_model.parquet"
        write_parquet_without(assets["data"] / "train.parquet", bad, "reward_model")
        args[args.index("--train_files") + 1] = str(bad)
        expected = [str(bad), "no column 'reward_model'"]
    elif case == "train_file_is_csv":
        bad = assets["tmp"] / "train.csv"
        bad.write_text("question,answer\n1+1,2\n")
        args[args.index("--train_files") + 1] = str(bad)
        expected = [f"{bad} is not a readable parquet file"]
    elif case == "model_without_config":
        bad = assets["tmp"] / "model_without_config"
        shutil.copytree(assets["model"], bad, ignore=shutil.ignore_patterns("config.json"))
        args[args.index("--model") + 1] = str(bad)
        expected = [f"--model {bad} has no config.json"]
    elif case == "val_source_without_scorer":  # the built-in reward; found before any step
        i = args.index("--custom_reward_function_path")
        del args[i : i + 2]
        bad = assets["tmp"] / "unknown_source.parquet"
        table = pq.read_table(assets["data"] / "test.parquet")
        sources = pa.array(["my/puzzles"] * table.num_rows)
        pq.write_table(table.set_column(table.column_names.index("data_source"), "data_source",
                                        sources), bad)  # fmt: skip
        args[args.index("--val_files") + 1] = str(bad)
        expected = [f"--val_files {bad}: data_source 'my/puzzles' (8 prompts) has no scorer"]
    elif case == "empty_train_file":
        bad = assets["tmp"] / "empty.parquet"
        pq.write_table(pq.read_table(assets["data"] / "train.parquet").slice(0, 0), bad)
        args[args.index("--train_files") + 1] = str(bad)
        expected = [f"{bad} holds no rows"]
    elif case == "loss_agg_mode":  # the math function names its modes
        args += ["--loss_agg_mode", "seq-mean"]
        expected = ["--loss_agg_mode 'seq-mean' is not one of token-mean"]
    elif case == "reward_signature":
        bad = assets["tmp"] / "two_arguments.py"
        bad.write_text("def compute_score(solution, answer):\n    return 0.0\n")
        args[args.index("--custom_reward_function_path") + 1] = str(bad)
        expected = [f"{bad}: compute_score(solution, answer) cannot be called as"]
    elif case == "longer_than_the_model":  # the tiny model's 1,024 positions
        args[args.index("--max_response_length") + 1] = "2000"
        expected = ["--max_response_length = 2256 tokens, more than --model"]
    elif case == "missing_data_files":  # both: the training file named, by its flag
        args[args.index("--train_files") + 1] = str(assets["tmp"] / "nope" / "train.parquet")
        args[args.index("--val_files") + 1] = str(assets["tmp"] / "nope" / "test.parquet")
        expected = [f"--train_files {assets['tmp'] / 'nope' / 'train.parquet'}: no such file"]
    elif case == "offload_on_cpu":
        args += ["--param_offload"]
        expected = ["--param_offload keeps a model's state on the CPU between its passes"]
    elif case == "checkpoints_under_a_file":
        args[args.index("--default_local_dir") + 1] = str(assets["reward"] / "run")
        expected = [f"{assets['reward']} is a file, not a folder"]
    else:
        missing = assets["tmp"] / "no_such_reward.py"
        args[args.index("--custom_reward_function_path") + 1] = str(missing)
        expected = [str(missing), "--custom_reward_function_path"]
    return out, args, expected


@pytest.fixture(scope="module")
def bad_input_runs(assets):
    """Each case of BAD_INPUT launched as a plain single process (one import for all:
    launch_forked)."""
    cases = {case: bad_input(assets, case) for case in BAD_INPUT}
    procs = launch_forked([args for _, args, _ in cases.values()])
    return {
        case: (out, expected, proc)
        for (case, (out, _, expected)), proc in zip(cases.items(), procs)
    }


@pytest.mark.parametrize("case", BAD_INPUT)
def test_bad_input_fails_at_start_up(case, bad_input_runs):
    out, expected, proc = bad_input_runs[case]
    assert proc.returncode != 0
    for text in expected:
        assert text in proc.output, proc.output[-3000:]
    assert "Loading weights" not in proc.output  # failed before any model loaded
    assert "Traceback" not in proc.output, proc.output[-3000:]  # the message alone
    assert not out.exists()  # nothing left behind


def test_a_fresh_run_refuses_a_folder_with_checkpoints(assets, hf_run):
    before = sorted(os.listdir(hf_run))
    proc = launch(flags(assets, hf_run, "hf", 2, "disable"), nproc=0, timeout=120)
    assert proc.returncode != 0
    assert (
        "holds checkpoints of an earlier run" in proc.output and "--resume_mode auto" in proc.output
    )
    assert "Loading weights" not in proc.output
    assert sorted(os.listdir(hf_run)) == before
