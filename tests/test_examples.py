"""The recipes in examples/: every flag of each script parses with its train script's parser (a
renamed flag breaks this test, not a user's run); and the two-node recipe runs for real, as far as
one machine allows: two torchrun agents joined by c10d rendezvous on localhost (gloo), one process
each, train a tiny model for two steps and checkpoint into the shared folder; then the same recipe
with two processes per agent resumes from that checkpoint (four ranks) and trains a third step."""

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from transformers import HfArgumentParser

import cli
import train_grpo
import train_ppo
from tests.test_train_grpo import flags, make_assets, metrics_by_step
from tests.tiny_model import free_port

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = sorted((ROOT / "examples").glob("*.sh"))


def command(path):
    """The train script's name and the flags a recipe gives it, its variables at their defaults."""
    text = path.read_text().replace("\\\n", " ")
    lines = [line for line in text.splitlines() if not line.startswith("#")]
    line = next(line for line in lines if re.search(r"train_(grpo|ppo)\.py", line))
    line = re.sub(r"\$\{(\w+):-([^}]*)\}", r"\2", line)  # ${VAR:-default}
    line = re.sub(r"\$\{\w+:\?[^}]*\}", "host", line)  # ${VAR:?message}
    line = line.replace('"$@"', "").replace("$ROOT/", "").replace("$MODEL", "model")
    line = line.replace("$DATA", "data").replace("$HOME", "home")
    words = shlex.split(line)
    at = next(i for i, w in enumerate(words) if re.fullmatch(r"train_(grpo|ppo)\.py", w))
    return words[at], words[at + 1 :]


def test_there_are_the_recipes_the_docs_name():
    names = {p.name for p in EXAMPLES}
    assert {
        "grpo_gsm8k.sh",
        "ppo_gsm8k.sh",
        "grpo_gsm8k_fast.sh",
        "grpo_qwen3_1.7b.sh",
        "grpo_8gpu.sh",
        "grpo_2nodes.sh",
    } <= names


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_every_flag_of_a_recipe_parses(path):
    script, words = command(path)
    Args = {"train_grpo.py": train_grpo.Args, "train_ppo.py": train_ppo.Args}[script]
    (args,) = HfArgumentParser(Args).parse_args_into_dataclasses(cli.bare_switches(Args, words))
    assert args.model == "model" and args.train_files == "data/train.parquet"
    subprocess.run(["bash", "-n", str(path)], check=True)


def two_agents(assets, out, nproc, steps, resume):
    """examples/grpo_2nodes.sh started twice on this machine, as on two nodes; returns their
    outputs once both have ended (each must exit 0)."""
    env = {
        **os.environ,
        "TORCHRUN": f"{sys.executable} -m torch.distributed.run",
        "NPROC": str(nproc),
        "HEAD_NODE_IP": "127.0.0.1",
        "PORT": str(free_port()),
        "RDZV_ID": f"two_nodes_{nproc}",
        "MODEL": assets["model"],
        "DATA": str(assets["data"]),
        "CKPT_DIR": str(out),
        "VLLM_CPU_KVCACHE_SPACE": "1",
    }
    extra = flags(assets, out, "hf", steps, resume, "--test_freq", "-1", "--export_final", "false")
    agents = [
        subprocess.Popen(
            ["bash", "examples/grpo_2nodes.sh", *extra],
            cwd=ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for _ in range(2)
    ]
    outputs = [a.communicate(timeout=600)[0] for a in agents]
    for agent, output in zip(agents, outputs):
        assert agent.returncode == 0, output[-6000:]
    return outputs


def test_two_nodes_train_checkpoint_and_resume_with_more_processes(tmp_path):
    assets = make_assets(tmp_path)
    out = tmp_path / "shared"
    two_agents(assets, out, 1, 2, "disable")
    first = metrics_by_step(out)
    assert sorted(first) == [1, 2] and (out / "global_step_2" / "COMPLETE").exists()
    outputs = two_agents(assets, out, 2, 3, "auto")  # 4 ranks from a checkpoint of 2
    resumed = metrics_by_step(out)
    assert sorted(resumed) == [1, 2, 3] and (out / "global_step_3" / "COMPLETE").exists()
    assert resumed[1] == first[1] and resumed[2] == first[2]  # rows of the first launch kept
    assert any(f"resumed from {out / 'global_step_2'} (step 2)" in o for o in outputs)


def test_the_cpu_quick_start_trains_on_its_own_data_and_reward(tmp_path):
    """examples/quickstart_cpu.sh as a new user runs it: a tiny model written, their parquet and
    reward, two steps with the real CPU engine, validated, exported, with a gradient from the first
    step; no NaN metric for a data set that is not GSM8K, and none of vLLM's harmless reload
    warnings. The engine's KV cache is what a
    round generates (memory.cpu_kv_cache_bytes), not a share of the machine's memory."""
    env = {k: v for k, v in os.environ.items() if k != "VLLM_CPU_KVCACHE_SPACE"}
    env.update(
        OUT=str(tmp_path), PY=sys.executable, VLLM_LOGGING_LEVEL="INFO"
    )  # its KV cache's line
    out = subprocess.run(
        ["bash", "examples/quickstart_cpu.sh", "--total_training_steps", "2"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    output = out.stdout + out.stderr
    assert out.returncode == 0, output[-6000:]
    rows = metrics_by_step(tmp_path / "run")
    assert sorted(rows) == [1, 2] and "val-core/my/backwards/reward/mean@1" in rows[2]
    assert "critic/score/brevity/mean" in rows[1] and "critic/score_flexible/mean" not in rows[1]
    # the reward's partial credit tells a random model's responses apart: the update has a gradient
    assert all(rows[s]["critic/score/max"] > 0 and rows[s]["actor/grad_norm"] > 0 for s in (1, 2))
    assert (tmp_path / "run" / "hf_model" / "config.json").exists()
    assert "Failed to load weights" not in output and "nan" not in output.split("done:")[0][-3000:]
    # vLLM's CPU build's notes that ask nothing of a user (rollout.quiet_cpu_build)
    assert "Triton not available" not in output and "reduce_op" not in output, output[-6000:]
    assert "Explicitly set (" in output and "Auto set" not in output, output[-6000:]
