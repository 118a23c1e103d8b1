"""Test helpers: a free port, a torchrun launch, random samples, a gradient recorder. The tiny model
itself is bench/tiny.py."""

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoModelForTokenClassification

import ops
from bench.tiny import tiny_config


def free_port() -> int:
    """A TCP port free on this machine now, for a process group's MASTER_PORT."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


ROOT = Path(__file__).resolve().parents[1]


def torchrun(nproc: int, script: str, work: Path, timeout: int = 400) -> None:
    """`torchrun --nproc_per_node=NPROC SCRIPT WORK` from the repo root on CPU (gloo, one thread a
    rank), its output in WORK/SCRIPT_NAME.log; a failure fails the test with the log's last
    lines."""
    env = dict(
        os.environ,
        PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
        VLLM_ENABLE_V1_MULTIPROCESSING="0",
        VLLM_CPU_KVCACHE_SPACE="1",
        VLLM_NO_USAGE_STATS="1",
        HF_HUB_OFFLINE="1",
        TOKENIZERS_PARALLELISM="false",
        OMP_NUM_THREADS="1",
        PYTHONUNBUFFERED="1",
    )
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nproc_per_node={nproc}",
        "--master_port",
        str(free_port()),
        script,
        str(work),
    ]
    log = Path(work) / f"{Path(script).stem}_{nproc}.log"
    try:
        with open(log, "w") as f:
            proc = subprocess.run(
                cmd, cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT, timeout=timeout
            )
        failed = proc.returncode != 0 and f"exit code {proc.returncode}"
    except subprocess.TimeoutExpired:
        failed = "timed out"
    if failed:
        tail = "\n".join(log.read_text(errors="replace").splitlines()[-60:])
        pytest.fail(f"{' '.join(cmd)}: {failed}; last lines of {log}:\n{tail}", pytrace=False)


def make_samples(lengths, seed=0):
    """(prompt_ids, response_ids) pairs of the given (prompt, response) lengths, random byte
    tokens."""
    g = torch.Generator().manual_seed(seed)
    return [
        (
            torch.randint(0, 256, (p,), generator=g).tolist(),
            torch.randint(0, 256, (r,), generator=g).tolist(),
        )
        for p, r in lengths
    ]


LENGTHS = [(5, 3), (9, 6), (3, 1), (7, 4)]  # N = 4 sequences, T = 6


class GradRecorder:
    """An optimizer stand-in: records the accumulated gradient at each step instead of taking it."""

    def __init__(self, model):
        self.model, self.steps = model, []

    def step(self):
        self.steps.append({n: p.grad.clone() for n, p in self.model.named_parameters()})

    def zero_grad(self, set_to_none=True):
        self.model.zero_grad(set_to_none=set_to_none)


def tiny_policy():
    """The tiny model in memory, as the scripts load it (packed attention), with larger weights than
    the default init, so log-probs are far from uniform."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(
        tiny_config(), dtype=torch.float32, attn_implementation=ops.PACKED_ATTENTION
    )
    return _spread(model)


def tiny_critic():
    """A value model on the tiny body, as sharding.load_critic builds one: one label, no dropout."""
    torch.manual_seed(0)
    config = tiny_config()
    config.num_labels, config.classifier_dropout = 1, 0.0
    model = AutoModelForTokenClassification.from_config(
        config, dtype=torch.float32, attn_implementation=ops.PACKED_ATTENTION
    )
    return _spread(model)


@torch.no_grad()
def _spread(model):
    for p in model.parameters():
        if p.dim() == 2:
            p.normal_(0, 0.1)
    return model
