"""`compile_ahead` for both train scripts' models: a step's passes compiled on a made-up
batch before the first step (while a pool of engines starts), from the models the script
declares and never by calling its functions, leaving the weights as they were, so that the
script's own first step compiles nothing.

torch.compile runs with the aot_eager backend here: which graphs dynamo captures, and whether a
later call needs another, does not depend on the backend, and inductor's code generation would take
a minute on 2 cores.
"""

import os
import re
import subprocess
import sys
from pathlib import Path

import compile_ahead
from tests.test_train_grpo import flags, launch, make_assets
from tests.tiny_model import free_port

ROOT = Path(__file__).resolve().parents[1]

COMPILE_AHEAD = """
import functools, os, sys, torch, torch.distributed as dist
# before the scripts compile anything
torch.compile = functools.partial(torch.compile, backend="aot_eager")
sys.path.insert(0, os.getcwd())
import compile_ahead, models, ops, passes, train_grpo, train_ppo
from torch._dynamo.utils import counters
from tests.tiny_model import make_samples
from bench.tiny import make_tiny_model
dist.init_process_group("gloo", rank=0, world_size=1)
path = make_tiny_model(sys.argv[1])
device = torch.device("cpu")
# a real step's batch: other sizes than compile_ahead's, over more sequences
samples = make_samples([(5, 3), (9, 6), (3, 7), (4, 4), (6, 2)], seed=0)
mask = passes.response_targets(samples, 7, device)[1]  # (5, 7)
torch.manual_seed(0)
advantages = torch.randn(5, 7) * mask


# each parameter whole (a forward leaves the root's unsharded, the others are DTensors)
def snapshot(*models):
    return [(p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
            for m in models for p in m.parameters()]


def same(models, before):
    return all(torch.equal(a, b) for a, b in zip(snapshot(*models), before))


for script in (train_grpo, train_ppo):
    kw = dict(model=path, compile_layers=True, use_torch_compile=True, compile_update=True,
              use_dynamic_bsz=True, max_prompt_length=24, max_response_length=16,
              log_prob_max_token_len_per_gpu=160,
              ppo_max_token_len_per_gpu=96)  # the made-up batch: 160 // (8 + 16) = 6 sequences
    if script is train_ppo:
        kw.update(critic_model=path, critic_ppo_max_token_len_per_gpu=128)
    args = script.Args(**kw)
    # fills in the defaults that depend on other flags
    script.check_args(args, 1)
    ops.compile_logits_math()
    specs = [m for m in script.models(args) if m is not None]
    loaded = {spec.role: models.load(spec, device, args) for spec in specs}
    actor, ref = loaded["actor"], loaded["ref"]
    before = snapshot(*loaded.values())
    # nothing compiled for the other script's models stays to be reused
    torch._dynamo.reset()
    counters.clear()
    compile_ahead.compile_ahead(loaded, specs, args, device)
    graphs = counters["stats"]["unique_graphs"]
    assert graphs > 0, script.__name__
    assert same(loaded.values(), before), f"{script.__name__}: compile_ahead changed a weight"
    assert all(p.grad is None for m in loaded.values() for p in m.parameters()), (
        f"{script.__name__}: gradients left behind")
    # the step's passes, where the first step would compile, now compile nothing: any new graph
    # fails here
    optimizer = torch.optim.AdamW(actor.parameters(), lr=1e-3)
    budget = args.log_prob_max_token_len_per_gpu
    with torch.compiler.set_stance("fail_on_recompile"):
        old, _ = passes.batched_log_probs(actor, samples, 8, 1.0, True, 7, budget,
                                            with_entropy=True)
        ref_log_probs, _ = passes.batched_log_probs(ref, samples, 8, 1.0, True, 7, budget)
        if script is train_ppo:
            critic = loaded["critic"]
            values = passes.batched_values(critic, samples, 8, True, 7, budget)
            script.update_critic(critic=critic, optimizer=torch.optim.AdamW(critic.parameters()),
                                 samples=samples, values=values, returns=advantages,
                                 response_mask=mask, args=args, step=1, device=device)
        script.update_actor(actor=actor, optimizer=optimizer, samples=samples, old_log_probs=old,
                            ref_log_probs=ref_log_probs, advantages=advantages, response_mask=mask,
                            args=args, step=1, device=device)
    assert counters["stats"]["unique_graphs"] == graphs, script.__name__
    assert not same([actor], before), f"{script.__name__}: the real update changed nothing"
    print(script.__name__, "OK", graphs, flush=True)
"""


def test_compile_ahead_leaves_the_weights_and_the_first_step_nothing_to_compile(tmp_path):
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
    proc = subprocess.run(
        [sys.executable, "-c", COMPILE_AHEAD, str(tmp_path / "model")],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    assert "train_grpo OK" in proc.stdout and "train_ppo OK" in proc.stdout, proc.stdout


def test_made_up_batch_fills_the_largest_token_budget():
    # 8 + 16 tokens a sequence: 160 // 24 = 6 sequences, the last with half the response (8 + 8):
    # 128 tokens
    samples, T = compile_ahead.made_up_batch(16, 160)
    assert T == 16 and [(len(p), len(r)) for p, r in samples] == [(8, 16)] * 5 + [(8, 8)]
    samples, T = compile_ahead.made_up_batch(16, 240)  # PPO's critic budget, when it is the largest
    assert len(samples) == 10 and T == 16
    # without a token budget: two short sequences, the micro-batches counted in sequences
    samples, T = compile_ahead.made_up_batch(1024)
    assert [(len(p), len(r)) for p, r in samples] == [(8, 12), (4, 6)] and T == 12


def test_the_compiling_helper_fills_the_caches_the_trainer_loads(tmp_path):
    """--warm_compile_caches, two train_grpo.py steps with the log-prob math compiled by inductor
    (whose graphs AOTAutograd's cache keys): the first step runs eager (nothing compiles in it)
    while the helper process compiles the passes on one-layer copies into empty compile caches;
    after it the trainer's compile_ahead loads every graph from them (with the layers compiled
    too: the same, 10 s longer). The helper is spawned from the train script, which Python imports
    first there (as __mp_main__): unless the helper moves it last in sys.modules
    (compile_ahead.name_globals_as_the_trainer), pickle names torch's globals by the script in the
    cache keys, and none matches the trainer's. The engine is the in-process vLLM, whose worker sets
    the trainer's float32 matmul precision, which the keys hold: the helper sets it as the engine
    will (compile_ahead.set_as_the_engine_will), or none matches either."""
    assets = make_assets(tmp_path)
    run = flags(assets, tmp_path / "run", "vllm", 2, "disable", "--use_torch_compile", "true")
    run += ["--warm_compile_caches", "true", "--test_freq", "-1"]
    run += ["--save_freq", "-1", "--export_final", "false"]
    proc = launch(run, nproc=0, env={"TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor")})
    assert proc.returncode == 0, proc.output[-6000:]
    assert "the first step runs eager while the helper compiles" in proc.output, proc.output[-3000:]
    assert "the helper process compiled the passes" in proc.output, proc.output[-3000:]
    assert "for the compiling helper" in proc.output, proc.output[-3000:]
    # every graph of the process so far came from the caches: the eager step compiled none
    found = re.search(r"(\d+) of (\d+) graphs from the helper's compile caches", proc.output)
    assert found, proc.output[-3000:]
    assert int(found[1]) == int(found[2]) > 0, found[0]
    assert "step:2" in proc.output, proc.output[-3000:]
