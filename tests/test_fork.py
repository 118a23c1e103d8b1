"""Forking works, and the copies stay in step.

- The README's fork is a real patch: "This is not a library" shows the change that turns a copy of
  train_grpo.py into RLOO (Ahmadian et al. 2024, eq. 4; Kool et al. 2019: A_i = r_i - 1/(n-1)
  sum_{j != i} r_j, the mean of the group's other responses as the baseline, no division by the
  std). The test applies the README's diff to a copy with `git apply`, checks the advantage by
  hand, trains the copy for two steps under torchrun and runs the embedded demo on it
  (`demo.py --script`). `python -m tests.test_fork` prints the diff, for the README, when
  train_grpo.py has changed under it.
- The copies cannot drift apart: the functions both scripts copy on purpose (the shared math and
  the update's skeleton) are the same text in each, and a test names any that differ.
"""

import ast
import difflib
import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import torch

from tests.test_train_grpo import assets, flags  # noqa: F401 - the module fixture: data, tiny model, reward
from tests.tiny_model import free_port

ROOT = Path(__file__).resolve().parents[1]

# what train_grpo.py and train_ppo.py copy on purpose: a fix to one goes into the other (STYLE.md)
SHARED = ("place_scores", "agg_loss", "compute_policy_loss", "kl_penalty", "update_actor")

RLOO = '''def compute_rloo_outcome_advantage(scores, response_mask, n):
    """A_i = r_i - mean_{j != i} r_j for every token of response i: RLOO's leave-one-out baseline
    (Ahmadian et al. 2024, eq. 4). Consecutive rows form a group: scores (N,), response_mask
    (N, T)."""
    grouped = scores.view(-1, n)  # (B, n)
    baseline = (grouped.sum(-1, keepdim=True) - grouped) / (n - 1)
    return (grouped - baseline).reshape(-1, 1) * response_mask
'''


def functions(source):
    """The text of each top-level function in a module's source, by name."""
    lines = source.splitlines(keepends=True)
    return {
        node.name: "".join(lines[node.lineno - 1 : node.end_lineno])
        for node in ast.parse(source).body
        if isinstance(node, ast.FunctionDef)
    }


def drift(grpo_source, ppo_source):
    """The functions of SHARED whose text differs between the two scripts, each with its diff."""
    grpo, ppo = functions(grpo_source), functions(ppo_source)
    return {
        name: "".join(
            difflib.unified_diff(
                grpo.get(name, "").splitlines(keepends=True),
                ppo.get(name, "").splitlines(keepends=True),
                f"train_grpo.py: {name}",
                f"train_ppo.py: {name}",
            )
        )
        for name in SHARED
        if grpo.get(name) != ppo.get(name)
    }


def test_the_copies_the_scripts_share_have_not_drifted():
    drifted = drift((ROOT / "train_grpo.py").read_text(), (ROOT / "train_ppo.py").read_text())
    assert not drifted, (
        "the scripts' copies differ (a fix in one belongs in the other too):\n"
        + "\n".join(drifted.values())
    )


def test_a_fix_made_in_one_copy_only_is_named():
    grpo, ppo = (ROOT / "train_grpo.py").read_text(), (ROOT / "train_ppo.py").read_text()
    fixed = ppo.replace("return masked.sum() / num_tokens", "return masked.sum() / num_tokens / 1")
    assert fixed != ppo
    assert list(drift(grpo, fixed)) == ["agg_loss"]
    assert "-        return masked.sum() / num_tokens\n" in drift(grpo, fixed)["agg_loss"]
    assert (
        "--- train_grpo.py: agg_loss\n+++ train_ppo.py: agg_loss\n"
        in drift(grpo, fixed)["agg_loss"]
    )
    assert list(drift(grpo, ppo.replace("def kl_penalty(", "def kl_estimate("))) == ["kl_penalty"]


def fork_to_rloo(source):
    """train_grpo.py's text with GRPO's advantage function replaced by RLOO's, and its one call."""
    fn = next(
        node
        for node in ast.parse(source).body
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
    norm = "norm = args.norm_adv_by_std_in_grpo\n"  # Dr.GRPO's switch, which RLOO has not
    start = forked.index(call)
    start = forked.rindex(norm, 0, start) if norm in forked[:start] else start
    forked = (
        forked[:start]
        + "advantages = compute_rloo_outcome_advantage(scores, response_mask, n)"
        + forked[forked.index(call) + len(call) :]
    )
    # the estimator it is, in verl's name (algorithm.adv_estimator=rloo on a verl command line)
    grpo = '"algorithm.adv_estimator": (("grpo",), "this script is GRPO (train_ppo.py: gae)"),'
    assert grpo in forked
    return forked.replace(grpo, '"algorithm.adv_estimator": (("rloo",), "this script is RLOO"),')


def rloo_diff():
    """The fork as a patch of train_rloo.py, a copy of train_grpo.py: what the README shows."""
    source = (ROOT / "train_grpo.py").read_text()
    return "".join(
        difflib.unified_diff(
            source.splitlines(keepends=True),
            fork_to_rloo(source).splitlines(keepends=True),
            "a/train_rloo.py",
            "b/train_rloo.py",
            n=1,
        )
    )


def readme_diff():
    """The ```diff block of the README's "This is not a library"."""
    text = (ROOT / "README.md").read_text()
    section = text[text.index("## This is not a library") :]
    return re.search(r"```diff\n(.*?)```", section, re.S)[1]


def test_the_readmes_fork_is_the_patch_that_makes_rloo(assets, tmp_path):  # noqa: F811
    stale = "the README's diff is stale: python -m tests.test_fork prints it"
    assert readme_diff() == rloo_diff(), stale
    script = tmp_path / "train_rloo.py"
    script.write_text((ROOT / "train_grpo.py").read_text())
    (tmp_path / "rloo.diff").write_text(readme_diff())
    subprocess.run(["git", "apply", "rloo.diff"], cwd=tmp_path, check=True)
    forked = script.read_text()
    changed = [
        line
        for line in difflib.unified_diff(
            (ROOT / "train_grpo.py").read_text().splitlines(), forked.splitlines(), n=0
        )
        if line[:1] in "+-" and line[:3] not in ("+++", "---")
    ]
    assert len(changed) <= 32, "\n".join(changed)  # the function, its call, its verl name

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
    extra = ["--save_freq", "-1", "--test_freq", "-1", "--val_before_train", "false"]
    extra += ["algorithm.adv_estimator=rloo"]  # a verl command line's, taken
    proc = subprocess.run(
        [
            *[sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2"],
            *["--master_port", env["MASTER_PORT"], str(script)],
            *flags(assets, out, "hf", 2, "disable", *extra),
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

    # the embedded demo, on the fork
    demo = subprocess.run(
        [sys.executable, "demo.py", "--quick", "--script", str(script)]
        + ["--out", str(tmp_path / "demo")],
        cwd=ROOT,
        env={**env, "MASTER_PORT": str(free_port())},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert demo.returncode == 0, (demo.stdout + demo.stderr)[-6000:]
    assert "4 RL with train_rloo.py" in demo.stdout
    steps = (tmp_path / "demo" / "arith" / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in steps] == [0, 1, 2]


if __name__ == "__main__":
    print(rloo_diff(), end="")
