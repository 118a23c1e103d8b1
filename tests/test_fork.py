"""Forking works: copy train_grpo.py, change only its advantage to RLOO's leave-one-out baseline
(the README's "This is not a library" shows the same change), and the copy trains.

RLOO (Ahmadian et al. 2024, eq. 4; Kool et al. 2019): A_i = r_i - 1/(n-1) sum_{j != i} r_j, the mean
of the group's other responses as the baseline, no division by the std.
"""

import ast
import difflib
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import torch

from tests.test_train_grpo import assets, flags  # noqa: F401 - the module fixture: data, tiny model, reward
from tests.tiny_model import free_port

ROOT = Path(__file__).resolve().parents[1]

RLOO = '''def compute_rloo_outcome_advantage(scores, response_mask, n):
    """A_i = r_i - mean_{j != i} r_j for every token of response i: RLOO's leave-one-out baseline
    (Ahmadian et al. 2024, eq. 4). Consecutive rows form a group: scores (N,), response_mask
    (N, T)."""
    grouped = scores.view(-1, n)  # (B, n)
    baseline = (grouped.sum(-1, keepdim=True) - grouped) / (n - 1)
    return (grouped - baseline).reshape(-1, 1) * response_mask
'''


def fork_to_rloo(source):
    """train_grpo.py's text with GRPO's advantage function replaced by RLOO's, and its one call."""
    tree = ast.parse(source)
    fn = next(
        node
        for node in tree.body
        if getattr(node, "name", None) == "compute_grpo_outcome_advantage"
    )
    lines = source.splitlines(keepends=True)
    forked = "".join(lines[: fn.lineno - 1]) + RLOO + "".join(lines[fn.end_lineno :])
    call = forked[forked.index("advantages = compute_grpo_outcome_advantage(") :]
    depth, end = 0, 0
    for end, c in enumerate(call):  # to the parenthesis that closes the call
        depth += {"(": 1, ")": -1}.get(c, 0)
        if c == ")" and depth == 0:
            break
    call = call[: end + 1]
    assert forked.count(call) == 1, call
    return forked.replace(
        call,
        "advantages = compute_rloo_outcome_advantage(token_level_rewards.sum(-1), "
        "response_mask, n)",
    )


def test_the_rloo_fork_changes_only_the_advantage_and_trains(assets, tmp_path):  # noqa: F811
    source = (ROOT / "train_grpo.py").read_text()
    forked = fork_to_rloo(source)
    changed = [
        line
        for line in difflib.unified_diff(source.splitlines(), forked.splitlines(), lineterm="", n=0)
        if line[:1] in "+-" and line[:3] not in ("+++", "---")
    ]
    assert len(changed) <= 30, "\n".join(changed)  # the function and its call, nothing else
    script = tmp_path / "train_rloo.py"
    script.write_text(forked)

    # the fork's advantage by hand: scores [1, 0, 0] in a group of 3: baselines 0, 0.5, 0.5
    # -> 1, -0.5, -0.5; a group of equal scores gets 0, as in GRPO
    spec = importlib.util.spec_from_file_location("train_rloo", script)
    rloo = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(rloo)
    adv = rloo.compute_rloo_outcome_advantage(
        torch.tensor([1.0, 0.0, 0.0, 2.0, 2.0, 2.0]), torch.ones(6, 2), 3
    )
    torch.testing.assert_close(adv[:, 0], torch.tensor([1.0, -0.5, -0.5, 0.0, 0.0, 0.0]))
    assert not hasattr(rloo, "compute_grpo_outcome_advantage")

    # two steps of the copy, as a user would run it from a fork of the repository (its plumbing
    # importable)
    out = tmp_path / "run"
    env = {
        **os.environ,
        "PYTHONPATH": str(ROOT),
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "MASTER_PORT": str(free_port()),
    }
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc_per_node=2",
            "--master_port",
            env["MASTER_PORT"],
            str(script),
            *flags(
                assets,
                out,
                "hf",
                2,
                "disable",
                "--save_freq",
                "-1",
                "--test_freq",
                "-1",
                "--val_before_train",
                "false",
            ),
        ],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-6000:]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    assert all(r["actor/grad_norm"] > 0 for r in rows)
    from safetensors.torch import load_file

    trained = load_file(out / "hf_model" / "model.safetensors")
    initial = load_file(Path(assets["model"]) / "model.safetensors")
    # the export is bf16: the initial weights rounded alike, so only a trained weight differs
    assert any(
        not torch.equal(trained[k], initial[k].to(trained[k].dtype))
        for k in trained
        if k in initial
    )
