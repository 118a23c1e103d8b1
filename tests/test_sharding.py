"""sharding.py's passes against small examples worked out by hand, and their properties: packed
equals padded and a loop over sequences (log-probs, entropy, values), compiled, chunked and fused
log-probs equal autograd through the whole logits, micro-batches by count and by token budget,
packed attention equals a block-diagonal causal mask, clip_and_step clips and steps or stops; in
subprocesses, the frozen reference reusing the actor's compiled layers, and fused log-probs under
FSDP2 on two gloo ranks.

Shapes as in the train scripts: N sequences, T response tokens, V vocabulary; K tokens, H hidden
size.
"""

import math
import os
import re
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

import models
import ops
import passes
import sharding
import train_ppo
from ops import entropy_from_logits, token_log_probs
from passes import forward_log_probs, forward_values
from tests.tiny_model import LENGTHS, free_port, make_samples, tiny_critic, tiny_policy

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def close(actual, expected, atol=1e-5, rtol=0.0):
    torch.testing.assert_close(
        torch.as_tensor(actual, dtype=torch.float32),
        torch.as_tensor(expected, dtype=torch.float32),
        atol=atol,
        rtol=rtol,
    )


# --- entropy --------------------------------------------------------------------------------------


def test_entropy_from_logits():
    # uniform over V = 8: H = log 8 = 2.0794
    close(entropy_from_logits(torch.zeros(8)), math.log(8), atol=1e-6)
    # p = [1/4, 3/4] from logits [0, log 3]: H = 0.25 * 1.3863 + 0.75 * 0.28768 = 0.34657 + 0.21576
    # = 0.56233
    close(entropy_from_logits(torch.tensor([0.0, math.log(3)])), 0.56233, atol=1e-5)
    # one-hot-ish: [100, 0, 0, 0] -> p_other = e^-100: H ~ 0
    close(entropy_from_logits(torch.tensor([100.0, 0, 0, 0])), 0.0, atol=1e-6)
    # per position over a batch: (2, 3, V) -> (2, 3); adding a constant to the logits changes
    # nothing
    logits = torch.randn(2, 3, 11, generator=torch.Generator().manual_seed(0))
    h = entropy_from_logits(logits)
    assert h.shape == (2, 3)
    close(entropy_from_logits(logits + 50.0), h, atol=1e-4)


# --- log-probs on a tiny model: packed, compiled, chunked, fused ----------------------------------


@pytest.fixture(scope="module")
def model():
    return tiny_policy()


@torch.no_grad()
def test_packed_log_probs_equal_padded_and_a_loop(model):
    samples = make_samples(LENGTHS)
    # (N, T)
    packed, packed_entropy = forward_log_probs(model, samples, 0.7, packed=True, with_entropy=True)
    padded, padded_entropy = forward_log_probs(model, samples, 0.7, packed=False, with_entropy=True)
    assert packed.shape == padded.shape == (4, 6)
    close(packed, padded, atol=1e-5)
    close(packed_entropy, padded_entropy, atol=1e-5)
    mask = passes.response_targets(samples, 6, "cpu")[1]
    for out in (packed, padded, packed_entropy, padded_entropy):
        assert torch.equal(out * (1 - mask), torch.zeros_like(out))  # zero beyond each response
    # a loop over sequences, each alone and unpadded: log_softmax(logits / 0.7) at the response
    # tokens
    for i, (p, r) in enumerate(samples):
        logits = model(input_ids=torch.tensor([p + r])).logits[0, len(p) - 1 : -1] / 0.7  # (|r|, V)
        expected = torch.log_softmax(logits, -1).gather(-1, torch.tensor(r)[:, None]).squeeze(-1)
        close(packed[i, : len(r)], expected, atol=1e-5)
        close(packed_entropy[i, : len(r)], entropy_from_logits(logits), atol=1e-5)


def log_prob_entropy_grads(m, samples):
    """The parameter gradients of sum(log-probs) + sum(entropy) over packed `samples` (then zeroed
    again), and the log-probs."""
    log_probs, entropy = forward_log_probs(m, samples, 0.7, packed=True, with_entropy=True)
    (log_probs.sum() + entropy.sum()).backward()
    grads = [p.grad.clone() for p in m.parameters()]
    m.zero_grad()
    return grads, log_probs


def test_compiled_layers_and_logits_math_equal_eager(model, monkeypatch):
    """--compile_layers and --use_torch_compile change kernels, not results: without gradients
    (where they compile) log-probs and entropy of packed batches of two shapes equal the eager ones;
    with gradients the layers run eagerly and the log-probs and entropy through their compiled
    forward and hand-written backward (ops.CompiledLogProbs): the gradient equals the eager
    one."""
    import copy

    from torch._dynamo.utils import counters

    compiled = ops.compile_layers(copy.deepcopy(model))
    batches = [make_samples(LENGTHS), make_samples([(4, 2), (6, 5), (2, 7)], seed=1)]

    def run(m):
        with torch.no_grad():
            out = [
                t
                for s in batches
                for t in forward_log_probs(m, s, 0.7, packed=True, with_entropy=True)
            ]
        return out, log_prob_entropy_grads(m, batches[0])[0]

    expected, expected_grads = run(model)
    monkeypatch.setattr(ops, "LOGITS_MATH", dict(ops.LOGITS_MATH))
    ops.compile_logits_math()
    counters.clear()
    actual, actual_grads = run(compiled)
    # the layer (around attention) and the logits math
    assert counters["stats"]["unique_graphs"] >= 3
    for a, e in zip(actual, expected):
        close(a, e, atol=1e-5)
    for a, e in zip(actual_grads, expected_grads):
        close(a, e, atol=1e-5, rtol=1e-4)


def test_compile_update_compiles_the_backward_and_keeps_the_gradient(model, monkeypatch):
    """--compile_update: the training forward runs through compiled graphs (a compiled backward node
    in its autograd graph) and its gradients equal eager ones up to fp32 reordering."""
    import copy

    samples = make_samples(LENGTHS)
    expected, _ = log_prob_entropy_grads(model, samples)
    monkeypatch.setattr(ops, "LOGITS_MATH", dict(ops.LOGITS_MATH))
    ops.compile_logits_math()
    actual, log_probs = log_prob_entropy_grads(
        ops.compile_layers(copy.deepcopy(model), with_grad=True), samples
    )
    nodes, seen = [log_probs.grad_fn], set()
    while nodes:  # walk the autograd graph
        node = nodes.pop()
        if node is not None and node not in seen:
            seen.add(node)
            nodes += [n for n, _ in node.next_functions]
    names = [type(n).__name__ for n in seen]
    assert "CompiledFunctionBackward" in names  # the layers
    assert "CompiledLogProbsBackward" in names  # the log-probs' and entropy's hand-written backward
    for a, e in zip(actual, expected):
        close(a, e, atol=5e-5, rtol=1e-4)  # fp32: eager's entropy, lse - sum p z, cancels digits


def test_compiled_log_probs_by_hand():
    """Two rows of logits [ln 3, 0] at T = 2: z = [ln 3 / 2, 0], p = [0.633975, 0.366025] (sqrt 3
    / (sqrt 3 + 1)). Target 0: log p_0 = -0.455746; target 1: log p_1 = -1.005052. The loss log p_0
    + 2 log p_1 has d/dlogits = g (onehot - p) / T: row 0 [0.366025, -0.366025] / 2, row 1 2
      [-0.633975, 0.633975] / 2."""
    logits = torch.tensor([[math.log(3), 0.0]] * 2, requires_grad=True)
    log_probs, entropy = ops.compiled_log_probs(logits, torch.tensor([0, 1]), 2.0)
    assert entropy is None
    close(log_probs, [-0.455746, -1.005052], atol=1e-6)
    (log_probs * torch.tensor([1.0, 2.0])).sum().backward()
    close(logits.grad, [[0.183013, -0.183013], [-0.633975, 0.633975]], atol=1e-6)


def test_compiled_entropy_by_hand():
    """One row of logits [ln 3, 0] at T = 1 (ChunkedLogProbs' example): p = [3/4, 1/4], log p_0
    = -0.287682, H = 0.562335, dH/dz = -p (log p + H) = [-0.205990, 0.205990]. The loss log p_0 + 3
    H has d/dlogits = (onehot - p) + 3 dH/dz = [0.25 - 0.617970, -0.25 + 0.617970] = [-0.367970,
    0.367970]; with the entropy unused (a metric), only the first term: [0.25, -0.25]."""
    for weight, grad in ((3.0, [[-0.367970, 0.367970]]), (0.0, [[0.25, -0.25]])):
        logits = torch.tensor([[math.log(3), 0.0]], requires_grad=True)
        log_probs, entropy = ops.compiled_log_probs(
            logits, torch.tensor([0]), 1.0, with_entropy=True
        )
        close(log_probs, [-0.287682], atol=1e-6)
        close(entropy, [0.562335], atol=1e-6)
        (log_probs.sum() + weight * entropy.sum() if weight else log_probs.sum()).backward()
        close(logits.grad, grad, atol=1e-6)


@pytest.mark.parametrize("with_entropy", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_compiled_log_probs_equal_autograd(dtype, with_entropy):
    """The log-probs (and entropy) and the gradient of a loss that weighs them unevenly equal
    autograd through the eager `token_log_probs`, for fp32 and bf16 logits (the gradient in the
    logits' dtype) and two shapes."""
    g = torch.Generator().manual_seed(0)
    for K, V in ((7, 11), (13, 5)):
        logits = (3 * torch.randn(K, V, generator=g)).to(dtype)
        targets = torch.randint(0, V, (K,), generator=g)
        coef, coef_entropy = torch.randn(K, generator=g), torch.randn(K, generator=g)
        runs = []
        for fn in (token_log_probs, ops.compiled_log_probs):
            x = logits.clone().requires_grad_()
            log_probs, entropy = fn(x, targets, 0.7, with_entropy)
            assert log_probs.dtype == torch.float32 and (entropy is None) != with_entropy
            loss = (log_probs * coef).sum() + (
                (entropy * coef_entropy).sum() if with_entropy else 0
            )
            loss.backward()
            runs.append([log_probs.detach(), x.grad] + ([entropy.detach()] if with_entropy else []))
        (expected, expected_grad, *expected_entropy), (actual, actual_grad, *actual_entropy) = runs
        close(actual, expected, atol=1e-5)
        for a, e in zip(actual_entropy, expected_entropy):
            close(a, e, atol=1e-5)
        assert actual_grad.dtype == dtype
        # eager's entropy, lse - sum_v p_v z_v, cancels digits the compiled -sum_v p_v log p_v keeps
        close(
            actual_grad,
            expected_grad,
            atol=(1e-5 if with_entropy else 1e-6) if dtype == torch.float32 else 1e-2,
        )


def test_compiled_log_probs_compile_one_forward_for_every_pass(monkeypatch):
    """The update reuses the forward graph the passes without gradients compiled (logits that
    require a gradient must not compile it again). A step's passes, twice: old log-probs with the
    entropy, reference log-probs, then a training pass, forward and backward, compile three graphs
    in all: the forward with the entropy, the forward without, the backward."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    monkeypatch.setattr(ops, "_COMPILED_LOG_PROBS", {})
    counters.clear()
    for K in (6, 9):  # another micro-batch size: dynamic shapes, no new graph
        logits, targets = torch.randn(K, 11), torch.arange(K)
        with torch.no_grad():
            ops.compiled_log_probs(logits, targets, 0.7, with_entropy=True)
            ops.compiled_log_probs(logits, targets, 0.7)
        assert counters["stats"]["unique_graphs"] == (2 if K == 6 else 3)  # the two forwards
        ops.compiled_log_probs(logits.clone().requires_grad_(), targets, 0.7)[0].sum().backward()
        assert counters["stats"]["unique_graphs"] == 3  # and the backward


def test_gpu_check_of_compiled_log_probs_runs_on_cpu():
    """`make test-gpu`'s check of CompiledLogProbs at the real vocabulary, run here at a small
    shape: the check itself works, and finds the two ways equal within its bounds."""
    from tests.gpu.gpu_checks import compiled_log_probs_check

    res = compiled_log_probs_check("cpu", tokens=64, vocab=1000)
    assert (
        res["compiled_log_probs_max_diff"] < 1e-3 and res["compiled_log_probs_grad_rel_diff"] < 1e-2
    )
    assert res["compiled_entropy_max_diff"] < 1e-3


def test_chunked_log_probs_by_hand():
    """One token, V = 2, H = 1: W = [[1], [0]], h = ln 3, T = 1, so z = [ln 3, 0], p = [3/4, 1/4].
    log p_0 = ln(3/4) = -0.287682; H = -(3/4 ln 3/4 + 1/4 ln 1/4) = 0.562335.
    d log p_0 / dz = onehot - p = [1/4, -1/4]: d/dh = z-gradient . W[:, 0] = 1/4; d/dW = [[ln3 / 4],
    [-ln3 / 4]]. dH / dz = -p (log p + H) = [-0.75 (-0.287682 + 0.562335), -0.25 (-1.386294
    + 0.562335)]
            = [-0.205990, 0.205990]: d/dh = -0.205990; d/dW = [[-0.205990 ln 3], [0.205990 ln
            3]]."""
    h = torch.tensor([[math.log(3)]], dtype=torch.float64, requires_grad=True)
    w = torch.tensor([[1.0], [0.0]], dtype=torch.float64, requires_grad=True)
    log_probs, entropy = ops.ChunkedLogProbs.apply(h, w, torch.tensor([0]), 1.0, 1)
    close(log_probs, [-0.287682], atol=1e-6)
    close(entropy, [0.562335], atol=1e-6)
    log_probs.sum().backward()
    close(h.grad, [[0.25]], atol=1e-6)
    close(w.grad, [[math.log(3) / 4], [-math.log(3) / 4]], atol=1e-6)
    h.grad, w.grad = None, None
    _, entropy = ops.ChunkedLogProbs.apply(h, w, torch.tensor([0]), 1.0, 1)
    entropy.sum().backward()
    close(h.grad, [[-0.205990]], atol=1e-6)
    close(w.grad, [[-0.205990 * math.log(3)], [0.205990 * math.log(3)]], atol=1e-6)


@pytest.mark.parametrize("chunk", [1, 3, 7, 100])
def test_chunked_log_probs_equal_autograd_through_whole_logits(chunk):
    """Any chunking: the log-probs, entropy and both gradients of a loss that weighs them (the
    update's log-probs with a KL-like nonlinearity, an entropy bonus) equal autograd through the
    whole logits."""
    g = torch.Generator().manual_seed(0)
    K, H, V, temperature = 7, 5, 11, 0.7
    hidden = torch.randn(K, H, generator=g, dtype=torch.float64)
    weight = torch.randn(V, H, generator=g, dtype=torch.float64)
    targets = torch.randint(0, V, (K,), generator=g)
    coef = torch.randn(K, generator=g, dtype=torch.float64)

    def run(fn):
        h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        log_probs, entropy = fn(h, w)
        ((coef * log_probs.exp()).sum() + 0.3 * (coef * entropy).sum()).backward()
        return log_probs, entropy, h.grad, w.grad

    # in float64 throughout
    expected = run(
        lambda h, w: (
            torch.log_softmax(h @ w.T / temperature, -1).gather(-1, targets[:, None])[:, 0],
            entropy_from_logits(h @ w.T / temperature),
        )
    )
    actual = run(lambda h, w: ops.ChunkedLogProbs.apply(h, w, targets, temperature, chunk))
    for a, e in zip(actual, expected):
        torch.testing.assert_close(a, e, rtol=1e-10, atol=1e-12)


def test_chunked_log_probs_keep_no_logits_for_the_backward():
    """What the backward keeps: through the whole logits, at least their (K, V) fp32 copy; chunked,
    the inputs and three floats per token, however large V."""
    K, H, V = 64, 16, 4096
    hidden, weight = torch.randn(K, H, requires_grad=True), torch.randn(V, H, requires_grad=True)
    targets = torch.randint(0, V, (K,))

    def saved_bytes(fn):
        seen = {}

        def pack(t):
            seen[t.data_ptr()] = t.numel() * t.element_size()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            fn()
        return sum(seen.values())

    whole = saved_bytes(lambda: token_log_probs(hidden @ weight.T, targets, 1.0))
    chunked = saved_bytes(lambda: ops.ChunkedLogProbs.apply(hidden, weight, targets, 1.0, 8))
    inputs = (K * H + V * H) * 4 + K * 8
    assert whole >= K * V * 4
    assert chunked <= inputs + 2 * K * 4


@pytest.mark.parametrize("packed", [True, False])
def test_fused_log_probs_equal_the_logits_path(model, packed, monkeypatch):
    """forward_log_probs(fused=True), as every pass runs it with --use_fused_kernels: the same
    log-probs, entropy and parameter gradients as through the model's logits; without a gradient
    too, still chunk by chunk (a log-prob pass's full logits were the largest tensor of a run on
    24 GiB); the output layer is the model's own again afterwards."""
    samples = make_samples(LENGTHS)

    def grads(fused, with_entropy):
        log_probs, entropy = forward_log_probs(
            model, samples, 0.7, packed, with_entropy, fused=fused
        )
        assert (entropy is None) != with_entropy
        (log_probs.sum() + (entropy.sum() if with_entropy else 0)).backward()
        out = [log_probs.detach()] + ([entropy.detach()] if with_entropy else [])
        out += [p.grad.clone() for p in model.parameters()]
        model.zero_grad()
        return out

    for with_entropy in (True, False):
        for a, e in zip(grads(True, with_entropy), grads(False, with_entropy)):
            close(a, e, atol=1e-5)
    chunked = []
    apply = ops.ChunkedLogProbs.apply
    monkeypatch.setattr(ops.ChunkedLogProbs, "apply", lambda *a: chunked.append(1) or apply(*a))
    with torch.no_grad():
        a = forward_log_probs(model, samples, 0.7, packed, True, fused=True)
        e = forward_log_probs(model, samples, 0.7, packed, True)
    assert chunked == [1]
    for x, y in zip(a, e):
        close(x, y, atol=1e-5)
    assert "forward" not in model.get_output_embeddings().__dict__
    logits = model(input_ids=torch.tensor([[1, 2, 3]])).logits
    assert logits.shape[-1] == model.config.vocab_size


def test_the_log_prob_pass_takes_the_output_layer_the_flags_name(model, monkeypatch):
    """log_prob_pass (phase 3's old and reference log-probs) runs the output layer chunk by chunk
    under --use_fused_kernels, one chunked call per micro-batch, and gives what the logits give."""
    samples = make_samples(LENGTHS)
    T = max(len(r) for _, r in samples)
    chunked = []
    apply = ops.ChunkedLogProbs.apply
    monkeypatch.setattr(ops.ChunkedLogProbs, "apply", lambda *a: chunked.append(1) or apply(*a))
    out = {}
    for fused in (True, False):
        args = SimpleNamespace(
            use_dynamic_bsz=False,
            log_prob_max_token_len_per_gpu=None,
            log_prob_micro_batch_size_per_gpu=2,
            use_remove_padding=True,
            temperature=0.7,
            use_fused_kernels=fused,
        )
        out[fused] = passes.log_prob_pass(model, samples, T, args, with_entropy=True)
    assert len(chunked) == -(-len(samples) // 2)
    for x, y in zip(out[True], out[False]):
        close(x, y, atol=1e-5)


@pytest.mark.parametrize(
    "change",
    [
        {"final_logit_softcapping": 30.0},  # Gemma 2
        {"logit_scale": 0.0625},  # Cohere
        {"logits_scaling": 8.0},  # Granite
        "bias",  # Phi, GPT-J
    ],
)
def test_fused_log_probs_refuse_an_output_layer_they_would_get_wrong(model, change):
    """A bias, soft-capped or scaled logits would be silently dropped: refused, naming the flag
    (`plain_output_layer`, which --warm_compile_caches' eager step asks too); a scale of 1 is
    plain."""
    import copy

    m = copy.deepcopy(model)
    assert ops.plain_output_layer(m)
    m.config.logits_scaling = 1.0
    assert ops.plain_output_layer(m)
    if change == "bias":
        head = m.get_output_embeddings()
        head.bias = torch.nn.Parameter(torch.zeros(head.out_features))
    else:
        for k, v in change.items():
            setattr(m.config, k, v)
    assert not ops.plain_output_layer(m)
    with pytest.raises(ValueError, match="--use_fused_kernels"):
        forward_log_probs(m, make_samples(LENGTHS), 1.0, True, True, fused=True)


REFERENCE_SHARES_GRAPHS = """
import os, sys, torch, torch.distributed as dist
sys.path.insert(0, os.getcwd())
import checkpoint, compile_ahead, models, ops, passes, sharding  # noqa: F401
import train_grpo
import train_ppo
from torch._dynamo.utils import counters
from bench.tiny import make_tiny_model
dist.init_process_group("gloo", rank=0, world_size=1)
path = make_tiny_model(sys.argv[1])
args = train_grpo.Args(model=path, compile_layers=True)
device = torch.device("cpu")
actor = models.load(models.Model("actor", path, "old_log_prob"), device, args)
ref = models.load(models.Model("ref", path, "ref", trained=False), device, args)
samples = [([5, 6, 7], [8, 9]), ([1, 2], [3, 4, 5, 6])]
passes.batched_log_probs(actor, samples, 8, 1.0, True, 4)
graphs = counters["stats"]["unique_graphs"]
passes.batched_log_probs(ref, samples, 8, 1.0, True, 4)
assert graphs > 0 and counters["stats"]["unique_graphs"] == graphs, (
    graphs, counters["stats"]["unique_graphs"])
assert not ref.training and all(p.grad is None for p in ref.parameters())
print("OK")
"""


def test_the_reference_reuses_the_actors_compiled_layers(tmp_path):
    """load_policy leaves the frozen reference's parameters as the actor's (requires_grad): its
    no-grad pass runs the graphs the actor's compiled, none of its own."""
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29741"}
    proc = subprocess.run(
        [sys.executable, "-c", REFERENCE_SHARES_GRAPHS, str(tmp_path / "model")],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0 and "OK" in proc.stdout, proc.stdout[-2000:] + proc.stderr[-3000:]


TRACED_FLASH_ATTENTION = """
import os, sys, torch
sys.path.insert(0, os.getcwd())
import checkpoint, compile_ahead, models, ops, passes, sharding  # noqa: F401
from torch._dynamo.utils import counters
from tests.tiny_model import make_samples, tiny_policy

# flash attention's varlen op has no CPU kernel: these stand in for it (and for its gradient), each
# segment through sdpa in fp32, so that the compiled path runs here as it does on a GPU
def attend(q, k, v, cu, scale):
    r = q.shape[1] // k.shape[1]
    outs, lses = [], []
    for a, b in zip(cu.tolist()[:-1], cu.tolist()[1:]):
        qs, ks, vs = (t[a:b].transpose(0, 1) for t in (q, k, v))
        ks, vs = ks.repeat_interleave(r, 0), vs.repeat_interleave(r, 0)
        scores = (qs @ ks.transpose(1, 2)) * scale
        causal = torch.ones(b - a, b - a, dtype=torch.bool).tril()
        scores = scores.masked_fill(~causal, float("-inf"))
        outs.append((scores.softmax(-1) @ vs).transpose(0, 1))
        lses.append(scores.logsumexp(-1))
    return torch.cat(outs), torch.cat(lses, 1)

def forward(q, k, v, cu_q, cu_k, max_q, max_k, dropout_p, is_causal, debug_mask, *, scale=None,
            **unused):
    assert torch.equal(cu_q, cu_k) and is_causal and dropout_p == 0
    out, lse = attend(q.float(), k.float(), v.float(), cu_q, scale)
    return (out.to(q.dtype), lse, torch.zeros(2, dtype=torch.uint64),
            torch.zeros((), dtype=torch.uint64), torch.empty(0, dtype=q.dtype))

def backward(grad, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, dropout_p, is_causal, seed,
             offset, *, scale=None, **unused):
    # by hand (autograd is off inside a kernel): P = softmax(S), S = scale Q K^T, O = P V
    dtype = q.dtype
    q, k, v, grad = q.float(), k.float(), v.float(), grad.float()
    r = q.shape[1] // k.shape[1]
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    for a, b in zip(cu_q.tolist()[:-1], cu_q.tolist()[1:]):
        qs, ks, vs, go = (t[a:b].transpose(0, 1) for t in (q, k, v, grad))
        ks, vs = ks.repeat_interleave(r, 0), vs.repeat_interleave(r, 0)
        causal = torch.ones(b - a, b - a, dtype=torch.bool).tril()
        p = ((qs @ ks.transpose(1, 2)) * scale).masked_fill(~causal, float("-inf")).softmax(-1)
        dp = go @ vs.transpose(1, 2)
        ds = p * (dp - (dp * p).sum(-1, keepdim=True))
        dq[a:b] = (scale * ds @ ks).transpose(0, 1)
        # the r query heads of a kv head add their gradients
        dk[a:b] = (scale * ds.transpose(1, 2) @ qs).unflatten(0, (-1, r)).sum(1).transpose(0, 1)
        dv[a:b] = (p.transpose(1, 2) @ go).unflatten(0, (-1, r)).sum(1).transpose(0, 1)
    return dq.to(dtype), dk.to(dtype), dv.to(dtype)

lib = torch.library.Library("aten", "IMPL")
lib.impl("_flash_attention_forward", forward, "CPU")
lib.impl("_flash_attention_backward", backward, "CPU")
ops.probe_flash_varlen(torch.device("cpu"))
assert "cpu" not in ops.FLASH_VARLEN  # the probe asks GPUs only
ops.FLASH_VARLEN["cpu"] = True

eager = tiny_policy().to(torch.bfloat16)
compiled = ops.compile_layers(tiny_policy().to(torch.bfloat16), with_grad=True)
lengths = [[(5, 3), (9, 6), (3, 1)], [(7, 4), (2, 9)], [(11, 5), (4, 4), (6, 2), (3, 3)]]
batches = [make_samples(each, seed=i) for i, each in enumerate(lengths)]
for samples in batches:
    for model in (eager, compiled):
        model.zero_grad()
    with torch.no_grad():
        want = passes.forward_log_probs(eager, samples, 1.0, True)[0]
        got = passes.forward_log_probs(compiled, samples, 1.0, True)[0]
    torch.testing.assert_close(got.float(), want.float(), atol=0.05, rtol=0.0)
    for model in (eager, compiled):
        passes.forward_log_probs(model, samples, 1.0, True)[0].float().sum().backward()
    for (name, e), c in zip(eager.named_parameters(), compiled.parameters()):
        if e.grad is not None and e.dim() == 2 and "layers" in name:
            rel = ((c.grad.float() - e.grad.float()).norm() / e.grad.float().norm()).item()
            assert rel < 0.05, (name, rel)
# one graph with gradients and one without, whatever the lengths: no break at attention, no
# recompiling for another micro-batch
assert counters["stats"]["unique_graphs"] == 2, dict(counters["stats"])
assert not counters["graph_break"], dict(counters["graph_break"])
print("OK")
"""


def test_compiled_layers_trace_packed_attention_into_one_graph(tmp_path):
    """Where flash attention's varlen kernel runs, a compiled decoder layer is one graph with
    packed attention in it, one with gradients and one without, for micro-batches of any lengths,
    and it computes what the eager layers do (bf16 log-probs and the layers' gradients). The
    kernel is a GPU's; here a CPU stand-in (per-segment attention) is registered in its place."""
    proc = subprocess.run(
        [sys.executable, "-c", TRACED_FLASH_ATTENTION],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0 and "OK" in proc.stdout, proc.stdout[-2000:] + proc.stderr[-3000:]


FUSED_UNDER_FSDP2 = """
import os, sys, torch, torch.distributed as dist
sys.path.insert(0, os.getcwd())
import checkpoint, compile_ahead, models, ops, passes, sharding  # noqa: F401
import train_grpo
import train_ppo
from tests.tiny_model import make_samples
from bench.tiny import make_tiny_model
dist.init_process_group("gloo")
rank = dist.get_rank()
for tie in (True, False):
    path = os.path.join(sys.argv[1], f"tie_{tie}")
    if rank == 0:
        make_tiny_model(path, tie=tie)
    dist.barrier()
    actor = models.load(models.Model("actor", path, "old_log_prob"), torch.device("cpu"),
                        train_grpo.Args(model=path))
    samples = make_samples([(5, 3), (9, 6)] if rank == 0 else [(3, 1), (7, 4), (2, 5)],
                           seed=rank)
    grads = []
    for fused in (False, True):
        log_probs, entropy = passes.forward_log_probs(actor, samples, 0.7, True, True,
                                                        fused=fused)
        (log_probs.sum() + 0.1 * entropy.sum()).backward()
        grads.append({n: p.grad.full_tensor() for n, p in actor.named_parameters()})
        actor.zero_grad(set_to_none=True)
    assert grads[0].keys() == grads[1].keys() and any("embed" in n for n in grads[0])
    for n in grads[0]:
        torch.testing.assert_close(grads[1][n], grads[0][n], atol=1e-5, rtol=1e-5, msg=n)
        assert grads[0][n].abs().sum() > 0, n
# a file each: two ranks' prints can interleave
open(os.path.join(sys.argv[1], f"ok{rank}"), "w").close()
"""


def test_fused_log_probs_under_fsdp2_on_two_ranks(tmp_path):
    """--use_fused_kernels under FSDP2 with two gloo ranks, tied and untied output layers: the
    output layer runs inside the root unit's forward, so its gathered weight is the one used and its
    gradient is reduced as the logits path's is. The full gradients of every parameter agree."""
    port = str(free_port())
    script = tmp_path / "fused_fsdp2.py"
    script.write_text(FUSED_UNDER_FSDP2)
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc_per_node=2",
            "--master_port",
            port,
            str(script),
            str(tmp_path),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0 and (tmp_path / "ok0").exists() and (tmp_path / "ok1").exists(), (
        proc.stdout[-2000:] + proc.stderr[-3000:]
    )


def test_micro_batches_by_count_and_by_token_budget():
    seqs = lambda lengths: [([0] * (n - 1), [0]) for n in lengths]  # noqa: E731  (prompt, response) of n tokens
    assert passes.micro_batches(seqs([5] * 5), 2) == [[0, 1], [2, 3], [4]]
    # 30 tokens, budget 15: two groups; longest first into the lighter group:
    # 10 -> A, 8 -> B, 7 -> B (15), 3 -> A (13), 2 -> A (15)
    assert passes.micro_batches(seqs([10, 3, 7, 2, 8]), 2, max_tokens=15) == [[0, 1, 3], [2, 4]]
    # 18 tokens would fit 2 x 10, but two 6-token sequences do not: the count grows until each group
    # fits
    assert passes.micro_batches(seqs([6, 6, 6]), 2, max_tokens=10) == [[0], [1], [2]]
    assert passes.micro_batches(seqs([4, 4, 4, 4]), 1, max_tokens=100) == [[0, 1, 2, 3]]


def test_packed_attention_equals_a_block_diagonal_mask():
    """ops.packed_attention on 3 segments (grouped-query heads, 4 query / 2 kv) equals sdpa
    with the block-diagonal causal mask written out by hand, in value and in gradient."""
    torch.manual_seed(0)
    lens, L, D = [3, 5, 2], 10, 8
    q = torch.randn(1, 4, L, D, requires_grad=True)
    k, v = (torch.randn(1, 2, L, D, requires_grad=True) for _ in range(2))
    seg = torch.tensor([i for i, n in enumerate(lens) for _ in range(n)])
    allowed = (seg[:, None] == seg[None, :]) & torch.ones(L, L, dtype=torch.bool).tril()
    # (1, L, 4, D)
    expected = torch.nn.functional.scaled_dot_product_attention(
        q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1), attn_mask=allowed
    ).transpose(1, 2)
    cu = torch.tensor([0, 3, 8, 10], dtype=torch.int32)
    out, _ = ops.packed_attention(
        None, q, k, v, None, scaling=D**-0.5, cu_seq_lens=cu, max_seq_len=max(lens)
    )
    close(out, expected, atol=1e-6)
    grads = torch.autograd.grad(
        (out * torch.arange(L * 4 * D).reshape(out.shape).sin()).sum(), (q, k, v)
    )
    expected_grads = torch.autograd.grad(
        (expected * torch.arange(L * 4 * D).reshape(out.shape).sin()).sum(), (q, k, v)
    )
    for g, e in zip(grads, expected_grads):
        close(g, e, atol=1e-5)
    # a packed row without segment bounds would attend across sequences: refused
    with pytest.raises(ValueError, match="cu_seq_lens"):
        ops.packed_attention(
            SimpleNamespace(is_causal=True),
            q,
            k,
            v,
            None,
            position_ids=torch.tensor([[0, 1, 2, 0, 1, 2, 3, 4, 0, 1]]),
        )


# --- the optimizer step ---------------------------------------------------------------------------


def test_a_non_finite_gradient_stops_before_the_update():
    model = torch.nn.Linear(3, 1)
    before = [p.detach().clone() for p in model.parameters()]
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    (model(torch.ones(1, 3)) * float("nan")).sum().backward()
    with pytest.raises(FloatingPointError, match="step 7: non-finite gradient norm.*--actor_lr"):
        passes.clip_and_step(model, optimizer, torch.tensor(1.0), 1.0, 7, "--actor_lr")
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))  # no update happened


def test_a_non_finite_loss_stops_before_the_update():
    model = torch.nn.Linear(3, 1)
    before = [p.detach().clone() for p in model.parameters()]
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.ones(1, 3)).sum().backward()  # a finite gradient: the loss alone stops it
    loss = torch.tensor(float("inf"))
    with pytest.raises(
        FloatingPointError, match="step 3: non-finite loss inf.*--critic_lr or check"
    ):
        passes.clip_and_step(model, optimizer, loss, 1.0, 3, "--critic_lr")
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))


def test_clip_and_step_clips_and_steps():
    model = torch.nn.Linear(2, 1, bias=False)
    with torch.no_grad():
        model.weight.copy_(torch.tensor([[1.0, 1.0]]))
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    # grad (3, 4): norm 5 -> clipped to (0.6, 0.8)
    model(torch.tensor([[3.0, 4.0]])).sum().backward()
    loss = torch.tensor(2.0)
    assert passes.clip_and_step(model, optimizer, loss, 1.0, 1, "--actor_lr") == pytest.approx(5.0)
    assert torch.allclose(model.weight, torch.tensor([[0.4, 0.2]]))  # 1 - 0.6, 1 - 0.8
    assert model.weight.grad is None  # zeroed for the next mini-batch


# --- the value model on a tiny body ---------------------------------------------------------------


@pytest.fixture(scope="module")
def critic():
    return tiny_critic()


@torch.no_grad()
def test_packed_values_equal_padded_and_a_loop(critic):
    samples = make_samples(LENGTHS)
    packed = forward_values(critic, samples, packed=True)  # (N, T)
    padded = forward_values(critic, samples, packed=False)
    assert packed.shape == padded.shape == (4, 6)
    close(packed, padded)
    mask = passes.response_targets(samples, 6, "cpu")[1]
    assert torch.equal(packed * (1 - mask), torch.zeros_like(packed))
    # each sequence alone: the value of response token t is the head's output at position |p| - 1
    # + t
    for i, (p, r) in enumerate(samples):
        expected = critic(input_ids=torch.tensor([p + r])).logits[0, len(p) - 1 : -1, 0]
        close(packed[i, : len(r)], expected)
    # batched_values pads every micro-batch to the batch's T
    close(passes.batched_values(critic, samples, 3, True, 6), packed)


def test_load_critic_turns_the_heads_dropout_off(tmp_path, monkeypatch):
    """The value head's dropout (transformers' default 0.1) is off: the update runs in train mode,
    where it would act, and the values it regresses were computed without it."""
    from bench.tiny import make_tiny_model

    path = make_tiny_model(str(tmp_path / "tiny"))
    monkeypatch.setattr(models, "apply_fsdp2", lambda model, **_: model)  # no process group here
    args = train_ppo.Args(model=path, critic_model=path)
    (spec,) = [m for m in train_ppo.models(args) if m and m.role == "critic"]
    critic = models.load(spec, torch.device("cpu"), args)
    rates = [m.p for m in critic.modules() if isinstance(m, torch.nn.Dropout)]
    assert rates and all(p == 0 for p in rates)


def test_optimizer_state_made_up_front_trains_as_adamw_does():
    """AdamW's state made before the first step (its memory resident from step 1) changes nothing:
    the parameters after three steps with weight decay and a schedule are those of a fresh AdamW,
    bit for bit."""
    torch.manual_seed(0)
    linears = [torch.nn.Linear(4, 3), torch.nn.Linear(4, 3)]
    linears[1].load_state_dict(linears[0].state_dict())
    optimizers = [torch.optim.AdamW(m.parameters(), lr=0.1, weight_decay=0.1) for m in linears]
    schedulers = [torch.optim.lr_scheduler.LambdaLR(o, lambda s: 0.5 + 0.1 * s) for o in optimizers]
    sharding.init_optimizer_state(optimizers[1])
    state = optimizers[1].state[linears[1].weight]
    assert (
        float(state["step"]) == 0 and not state["exp_avg"].any() and not state["exp_avg_sq"].any()
    )
    assert torch.equal(linears[0].weight, linears[1].weight)  # the step at lr 0 moved nothing
    assert optimizers[1].param_groups[0]["lr"] == pytest.approx(0.05)  # the schedule's, restored
    assert not optimizers[0].state  # AdamW itself makes it at the first step
    for x in torch.randn(3, 2, 4):
        for model, optimizer, scheduler in zip(linears, optimizers, schedulers):
            (model(x) ** 2).sum().backward()
            optimizer.step()
            optimizer.zero_grad()
            scheduler.step()
    for a, b in zip(linears[0].parameters(), linears[1].parameters()):
        assert torch.equal(a, b)
    sharding.init_optimizer_state(optimizers[1])  # a state that exists (a checkpoint's) is kept
    assert float(optimizers[1].state[linears[1].weight]["step"]) == 3


def test_one_layer_copies_keep_every_shape_but_the_depth(tmp_path, monkeypatch):
    """--warm_compile_caches' helper compiles on randomly initialised one-layer copies of the run's
    models: a decoder layer of the same shapes, whose compiled graph every layer of the real model
    reuses, the same embedding and heads."""
    from bench.tiny import make_tiny_model

    path = make_tiny_model(str(tmp_path / "tiny"))
    monkeypatch.setattr(models, "apply_fsdp2", lambda model, **_: model)  # no process group here
    args = train_ppo.Args(model=path, critic_model=path)
    cpu = torch.device("cpu")
    specs = {m.role: m for m in train_ppo.models(args) if m}
    loads = {
        "policy": lambda **kw: models.load(specs["actor"], cpu, args, **kw),
        "critic": lambda **kw: models.load(specs["critic"], cpu, args, **kw),
    }
    for name, load in loads.items():
        real, few = load(), load(layers=1)
        assert real.config.num_hidden_layers > 1 and few.config.num_hidden_layers == 1
        # the real model's parameters but those of its layers after the first
        kept = {
            n: p.shape for n, p in real.named_parameters() if not re.search(r"\.layers\.[1-9]", n)
        }
        assert {n: p.shape for n, p in few.named_parameters()} == kept, name
