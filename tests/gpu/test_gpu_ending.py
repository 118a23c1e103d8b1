"""How a run ends early with NCCL, on two GPUs (skipped with fewer): a reward that raises on one
rank while the other waits for it in an NCCL collective ends both within seconds, that rank's
error as torchrun's root cause; a SIGTERM while one rank is stuck in a reward call and the other
waits in a collective ends the run within --stop_grace_s. The same cases on CPU with gloo:
tests/test_ending.py. Run with `make test-gpu` on a machine with two GPUs."""

import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from tests.test_ending import first_call, rank_1_raises_and_both_end, reward_file
from tests.test_train_grpo import ROOT, flags, make_assets
from tests.tiny_model import free_port

pytestmark = pytest.mark.skipif(
    torch.cuda.device_count() < 2, reason="needs two CUDA GPUs (NCCL between them)"
)


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    return make_assets(tmp_path_factory.mktemp("gpu_ending"))


def test_a_reward_that_raises_on_one_rank_ends_both_over_nccl(assets):
    rank_1_raises_and_both_end(assets)


def test_sigterm_ends_a_run_whose_peer_waits_in_an_nccl_collective(assets):
    """Rank 0 spins in a reward call; rank 1 has scored and waits for it in NCCL's all-reduce; a
    SIGTERM to both: the run ends within --stop_grace_s, naming where rank 0 was."""
    spins = first_call('if os.environ["RANK"] == "0":\n        while True: pass')
    path = reward_file(assets, "spins_on_rank_0", spins)
    out = assets["tmp"] / "spins_run"
    args = flags(assets, out, "hf", 2, "disable", "--custom_reward_function_path", str(path))
    port = str(free_port())
    proc = subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--master_port",
         port, "train_grpo.py", *args, "--stop_grace_s", "3", "--test_freq", "-1"],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )  # fmt: skip
    deadline = time.monotonic() + 300
    while not os.path.exists(f"{path}.mark") and proc.poll() is None:
        assert time.monotonic() < deadline
        time.sleep(0.2)
    time.sleep(2.0)  # rank 1 is in the collective by now
    signalled = time.monotonic()
    os.killpg(proc.pid, signal.SIGTERM)  # as `timeout` and Slurm do
    output = proc.communicate(timeout=120)[0]
    assert time.monotonic() - signalled < 3 + 10, output[-6000:]
    assert "a SIGTERM came 3 s ago (--stop_grace_s)" in output, output[-6000:]
