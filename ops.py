"""The ops of a step's passes: packed attention, the log-prob math compiled or chunked with
gradients written by hand, and compiled decoder layers (the speed flags' choices).

- `packed_attention` (`PACKED_ATTENTION`): attention for packed sequences (`--use_remove_padding`),
  flash attention over variable-length segments on a GPU, so no (L, L) mask is ever built.
- `compiled_log_probs` (`--use_torch_compile`): log softmax at the taken tokens, and the entropy,
  from whole logits in one compiled kernel, its gradient written by hand, so the update reuses the
  kernel the passes without gradients compiled; `token_log_probs` is the eager math.
- `fused_log_probs` (`--use_fused_kernels`): the output layer returns the log-probs of given tokens,
  chunk by chunk, so a training forward never holds the logits over the whole vocabulary.
- `compile_layers` (`--compile_layers`, `--compile_update`): each decoder layer through
  torch.compile.
"""

import contextlib
import functools

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

import shapes
from sharding import decoder_layers

PACKED_ATTENTION = "packed_varlen"  # load models with attn_implementation=PACKED_ATTENTION


# per device type, whether flash attention's varlen kernel runs here: found by the first packed call
# there (`probe_flash_varlen` makes that call before anything compiles)
FLASH_VARLEN = {}


def packed_attention(
    module,
    query,
    key,
    value,
    attention_mask,
    scaling=None,
    dropout=0.0,
    cu_seq_lens=None,
    max_seq_len=None,
    **kwargs,
):
    """Causal attention inside each segment of a packed row, none across segments.

    Called by transformers' attention layers with query (1, Hq, L, D), key/value (1, Hkv, L, D).
    `cu_seq_lens` (int32, [0, l1, l1+l2, ..., L]) and `max_seq_len` come from the forward call's
    keyword arguments (`collate` adds them). On GPU the flash-attention varlen kernel does only the
    L_i^2 / 2 work of each segment; transformers' own sdpa path for packed rows builds a dense
    block-diagonal (L, L) mask and spends sum_i L * L_i on it. On CPU (or in fp32, or where the
    kernel is missing) each segment runs through sdpa on its own.
    Without `cu_seq_lens` (padded batches, generation) this is transformers' sdpa attention.

    Where the kernel is known to run, torch.compile traces this call (an aten op with a fake
    kernel, a gradient and inductor's fallback), so a compiled decoder layer (`compile_layers`) is
    one graph; everything else runs eager (`_attention_eager`), which splits the layer in two
    graphs around it and makes Dynamo trace the layer again at the split.
    """
    if (
        cu_seq_lens is not None
        and query.dtype in (torch.bfloat16, torch.float16)
        and FLASH_VARLEN.get(query.device.type)
    ):
        q, k, v = (t[0].transpose(0, 1) for t in (query, key, value))  # (L, H, D)
        return _flash_varlen(q, k, v, cu_seq_lens, max_seq_len, scaling)[None], None
    return _attention_eager(
        module,
        query,
        key,
        value,
        attention_mask,
        scaling,
        dropout,
        cu_seq_lens,
        max_seq_len,
        **kwargs,
    )


def _flash_varlen(q, k, v, cu_seq_lens, max_seq_len, scaling):
    """The kernel behind torch.nn.attention.varlen (whose Python signature changed across torch
    releases; this op's did not) on (L, H, D) tensors. It is differentiable in q, k and v and takes
    grouped-query heads as they are (Hq a multiple of Hkv), without copies of k and v."""
    return torch.ops.aten._flash_attention_forward(
        q, k, v, cu_seq_lens, cu_seq_lens, max_seq_len, max_seq_len, 0.0, True, False, scale=scaling
    )[0]


# left to eager under `compile_layers`: its kernel choice and fallback are Python
@torch.compiler.disable
def _attention_eager(
    module, query, key, value, attention_mask, scaling, dropout, cu_seq_lens, max_seq_len, **kwargs
):
    """`packed_attention` without a traced kernel: sdpa for padded batches, the first packed call on
    a device (which tries the flash kernel and notes whether it ran), and attention segment by
    segment where the kernel does not run."""
    if cu_seq_lens is None:
        pos = kwargs.get("position_ids")
        if (
            attention_mask is None
            and pos is not None
            and pos.shape[-1] > 1
            and int((pos[0] == 0).sum()) > 1
        ):
            raise ValueError(
                "packed sequences (positions restart within a row) need cu_seq_lens and max_seq_len"
            )
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs
        )
    assert query.shape[0] == 1, "packed attention expects one row"
    q, k, v = (t[0].transpose(0, 1) for t in (query, key, value))  # (L, H, D)
    out = None
    kind = q.device.type
    if q.is_cuda and q.dtype in (torch.bfloat16, torch.float16) and FLASH_VARLEN.get(kind, True):
        try:
            out = _flash_varlen(q, k, v, cu_seq_lens, max_seq_len, scaling)
        except (RuntimeError, TypeError) as e:  # e.g. a GPU without flash attention
            print(
                f"packed_attention: flash varlen attention unavailable ({e}); attending per "
                f"sequence instead",
                flush=True,
            )
        FLASH_VARLEN[kind] = out is not None
    if out is None:
        # grouped-query attention: kv head j serves query heads j*r..j*r+r-1
        if k.shape[1] != q.shape[1]:
            k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
            v = v.repeat_interleave(q.shape[1] // v.shape[1], dim=1)
        bounds = cu_seq_lens.tolist()
        out = torch.cat(
            [
                torch.nn.functional.scaled_dot_product_attention(
                    q[a:b].transpose(0, 1),
                    k[a:b].transpose(0, 1),
                    v[a:b].transpose(0, 1),
                    is_causal=True,
                    scale=scaling,
                ).transpose(0, 1)
                for a, b in zip(bounds[:-1], bounds[1:])
            ]
        )
    return out[None], None  # (1, L, Hq, D), as transformers' attention functions return


def probe_flash_varlen(device):
    """One packed call on tiny bf16 tensors, eager, so that `FLASH_VARLEN` knows this device before
    torch.compile traces a layer: otherwise the first compiled pass would trace the eager path and
    compile again once the kernel had run."""
    if device.type == "cuda" and device.type not in FLASH_VARLEN:
        qkv = torch.zeros(3, 1, 1, 4, 64, dtype=torch.bfloat16, device=device)
        cu = torch.tensor([0, 2, 4], dtype=torch.int32, device=device)
        with torch.no_grad():
            packed_attention(None, *qkv, None, scaling=0.125, cu_seq_lens=cu, max_seq_len=2)


def _packed_mask(*args, attention_mask=None, **kwargs):
    """No mask for packed rows (the segments say it all); padded batches get sdpa's mask."""
    return (
        None
        if attention_mask is None
        else sdpa_mask(*args, attention_mask=attention_mask, **kwargs)
    )


AttentionInterface.register(PACKED_ATTENTION, packed_attention)
ALL_MASK_ATTENTION_FUNCTIONS.register(PACKED_ATTENTION, _packed_mask)


def gpu_default(flag, device):
    """A speed flag left unset (None) is on exactly when training on a GPU."""
    return device.type == "cuda" if flag is None else flag


def compiles(args, device):
    """Whether a step's passes compile (the layers, or the log-prob math), so that they can be
    compiled ahead of the first step (`compile_ahead`)."""
    return gpu_default(args.compile_layers, device) or gpu_default(args.use_torch_compile, device)


def no_grad_compiled(fn, with_grad: bool = False):
    """`fn` through `torch.compile` (dynamic shapes) when no gradient is recorded, `fn` itself when
    one is, unless `with_grad` (the scripts' --compile_update): then always. Measured on one H200
    with Qwen2.5-0.5B (docs/benchmarks.md): compiled, the no-grad log-prob passes ran at 37% MFU
    instead of 24%. The training forward + backward gains only once its micro-batches are large: at
    12k tokens it waits on the CPU (Python, autograd, kernel launches) compiled or not; at 49k it
    ran at 38% compiled, where eager layers peaked at 23-28% (24k). Compiling it costs about 30 s of
    the first step on a fresh machine (107-125 s before the log-prob gradient was written by hand,
    `CompiledLogProbs`), so it is a choice, off by default."""
    compiled = torch.compile(fn, dynamic=True)

    @functools.wraps(fn)
    def call(*args, **kwargs):
        return (
            fn(*args, **kwargs)
            if torch.is_grad_enabled() and not with_grad
            else compiled(*args, **kwargs)
        )

    return call


def compile_layers(model: torch.nn.Module, with_grad: bool = False) -> torch.nn.Module:
    """Regional compilation of each decoder layer's forward, for the passes without gradients (old
    and reference log-probs, values; see `no_grad_compiled`).

    Eager PyTorch runs each RMSNorm, rotary embedding, SiLU-and-multiply and residual add as its own
    kernels, each a full pass over the activations; at a hidden size of 896 (Qwen2.5-0.5B) those
    passes cost about as much as the matmuls. Compiled, they fuse into a few kernels. All layers of
    a model share one compiled graph (same code, parameters passed as inputs), and so do other
    models of the same architecture whose parameters agree in requires_grad (the train scripts leave
    the frozen reference's on for that reason; a mismatch compiles again). Packed attention is
    part of the graph where its flash kernel runs (`packed_attention`), and FSDP2's hooks run in
    the module call around the compiled forward. Parameter names are unchanged. Call before
    sharding. `with_grad`: compile the training passes too (see `no_grad_compiled`).
    """
    for layer in decoder_layers(model):
        layer.forward = no_grad_compiled(layer.forward, with_grad)
    return model


def entropy_from_logits(logits):
    """H = logsumexp(z) - sum_v softmax(z)_v z_v, per position: logits (..., V) -> (...). At most
    one (..., V) tensor beside the logits: logsumexp's, then the softmax (the sum is a dot product
    per position, einsum, with no product tensor)."""
    lse = torch.logsumexp(logits, -1)
    return lse - torch.einsum("...v,...v->...", torch.softmax(logits, -1), logits)


def token_log_probs(logits, targets, temperature, with_entropy=False):
    """log softmax(z / T) at the taken tokens and, if asked, the entropy of softmax(z / T), in fp32:
    logits (K, V), targets (K,) -> (K,), (K,) or None. Gather minus logsumexp: no (K, V) log-prob
    tensor is made."""
    z = logits.float() / temperature  # verl scales by T too
    log_probs = z.gather(-1, targets[:, None]).squeeze(-1) - torch.logsumexp(z, -1)
    return log_probs, entropy_from_logits(z) if with_entropy else None


def _log_probs_and_lse(logits, targets, temperature, with_entropy):
    """log softmax(z) at `targets`, logsumexp(z) and, if asked, the entropy of softmax(z), for
    z = logits / T in fp32: (K, V), (K,) -> (K,), (K,), (K,) or None. One read of the logits."""
    z = logits.float() / temperature
    lse = torch.logsumexp(z, -1)
    log_p = z - lse[:, None]
    # a sum of terms >= 0: no cancellation
    entropy = -(log_p.exp() * log_p).sum(-1) if with_entropy else None
    return z.gather(-1, targets[:, None]).squeeze(-1) - lse, lse, entropy


def _log_probs_backward(logits, targets, lse, entropy, grad_log_probs, grad_entropy, temperature):
    """dL/dlogits = (g_lp (onehot(y) - p) - g_H p (log p + H)) / T for p = softmax(logits / T), in
    logits' dtype: (K, V). A gradient that is None (an output no loss used) drops its term."""
    log_p = logits.float() / temperature - lse[:, None]
    p = log_p.exp()
    dz = 0.0
    if grad_log_probs is not None:
        hit = torch.arange(logits.shape[-1], device=logits.device) == targets[:, None]
        dz = (hit.float() - p) * grad_log_probs[:, None]
    if grad_entropy is not None:
        dz = dz - p * (log_p + entropy[:, None]) * grad_entropy[:, None]
    return (dz / temperature).to(logits.dtype)


_COMPILED_LOG_PROBS = {}  # compiled on first use: the forward and the backward kernel


class CompiledLogProbs(torch.autograd.Function):
    """log softmax(logits / T) at the target tokens from whole logits (K, V) -> (K,) fp32 and, with
    `with_entropy`, that softmax's entropy (K,) fp32 (the scripts' `token_log_probs` under
    `--use_torch_compile`), through two compiled kernels and a gradient written by hand: for
    z = logits / T, p = softmax(z) and H = -sum_v p_v log p_v,
        d log p_y / dz = onehot(y) - p        dH / dz = -p (log p + H)
    (`ChunkedLogProbs` uses the same two, chunk by chunk).

    The forward is the graph the passes without gradients use (old and reference log-probs), so the
    update adds only the small backward graph to compile, where compiling the whole with autograd
    costs a joint graph (about 40 s of the first step on one H200; docs/benchmarks.md). It keeps the
    bf16 logits and a logsumexp (and entropy) per row for the backward, where eager autograd keeps
    their fp32 copy. torch.compile specializes on `with_entropy` and on which gradients are None:
    each combination a run uses is one graph.
    """

    @staticmethod
    def forward(ctx, logits, targets, temperature, with_entropy):
        if not _COMPILED_LOG_PROBS:
            _COMPILED_LOG_PROBS.update(
                forward=torch.compile(_log_probs_and_lse, dynamic=True),
                backward=torch.compile(_log_probs_backward, dynamic=True),
            )
        # detached: the graph of the passes without gradients guards on requires_grad, and would
        # compile again
        log_probs, lse, entropy = _COMPILED_LOG_PROBS["forward"](
            logits.detach(), targets, temperature, with_entropy
        )
        ctx.save_for_backward(logits, targets, lse, entropy)
        ctx.temperature = temperature
        # an output no loss uses (the entropy as a metric) gets None
        ctx.set_materialize_grads(False)
        return log_probs, entropy

    @staticmethod
    def backward(ctx, grad_log_probs, grad_entropy):
        logits, targets, lse, entropy = ctx.saved_tensors
        grad = _COMPILED_LOG_PROBS["backward"](
            logits.detach(), targets, lse, entropy, grad_log_probs, grad_entropy, ctx.temperature
        )
        return grad, None, None, None


def compiled_log_probs(logits, targets, temperature, with_entropy=False):
    """`CompiledLogProbs` as a function: log softmax(logits / T) at `targets` and, if asked, its
    entropy: (K, V), (K,) -> (K,) fp32, (K,) fp32 or None."""
    return CompiledLogProbs.apply(logits, targets, temperature, with_entropy)


# The math over the (K, V) logits. Eagerly it runs as several kernels, each writing a (K, V) fp32
# tensor; at a vocabulary of 152k that costs more than the lm_head matmul itself (on one H200, ~0.5
# s of a 2.45 s log-prob pass over a GRPO step's 1,280 responses; docs/benchmarks.md).
# `--use_torch_compile` (verl's flag) swaps in CompiledLogProbs in every pass: the same math in
# one compiled kernel that reads the bf16 logits once, its gradient written by hand.
LOGITS_MATH = {"log_probs": token_log_probs}


def compile_logits_math(on=True):
    """--use_torch_compile's log-prob math in every pass, or (`on` False) the eager math back:
    --warm_compile_caches' eager first step runs `token_log_probs`, whose memory its plan holds,
    not the compiled function run eager (which keeps the fp32 log-softmax and its exponential over
    the whole vocabulary: out of memory on an H200 at 65,536-token micro-batches)."""
    LOGITS_MATH.update(log_probs=compiled_log_probs if on else token_log_probs)


class ChunkedLogProbs(torch.autograd.Function):
    """log softmax(h W^T / T) at the target tokens, and that softmax's entropy, `chunk` rows at a
    time.

    hidden (K, H), weight (V, H), targets (K,) -> log_probs (K,), entropy (K,), in fp32 (or the
    inputs' dtype where that is wider). Forward keeps only each row's logsumexp and entropy;
    backward computes each chunk's logits again. So the (K, V) logits, their fp32 copy and their
    gradient never exist whole: at a 12k-token micro-batch and a 152k vocabulary those are ~7.5 GB
    each in fp32. The gradient is worked out by hand, with
    z = h W^T / T, p = softmax(z) and H = -sum_v p_v log p_v:
        d log p_y / dz = onehot(y) - p        dH / dz = -p (log p + H)
    and dz / dh = W / T, dz / dW = h / T. The cost is one more (K, H) x (H, V) matmul (the
    recompute).
    """

    @staticmethod
    def forward(ctx, hidden, weight, targets, temperature, chunk):
        acc = torch.promote_types(hidden.dtype, torch.float32)
        lse = torch.empty(hidden.shape[0], device=hidden.device, dtype=acc)  # (K,)
        log_probs, entropy = torch.empty_like(lse), torch.empty_like(lse)
        for a in range(0, hidden.shape[0], chunk):
            rows = slice(a, a + chunk)
            z = (hidden[rows] @ weight.T).to(acc) / temperature  # (c, V)
            lse[rows] = torch.logsumexp(z, -1)
            log_probs[rows] = z.gather(-1, targets[rows, None]).squeeze(-1) - lse[rows]
            # H = lse - sum_v p_v z_v; in place, so a chunk costs two (c, V) tensors at a time
            entropy[rows] = lse[rows] - (z - lse[rows, None]).exp_().mul_(z).sum(-1)
            del z  # before the next chunk's
        ctx.save_for_backward(hidden, weight, targets, lse, entropy)
        ctx.temperature, ctx.chunk = temperature, chunk
        ctx.set_materialize_grads(False)  # an output no loss uses (the entropy metric) gets None
        return log_probs, entropy

    @staticmethod
    def backward(ctx, grad_log_probs, grad_entropy):
        hidden, weight, targets, lse, entropy = ctx.saved_tensors
        grad_hidden = torch.empty_like(hidden) if ctx.needs_input_grad[0] else None
        # summed over chunks in fp32
        grad_weight = (
            torch.zeros(weight.shape, device=weight.device, dtype=lse.dtype)
            if ctx.needs_input_grad[1]
            else None
        )
        for a in range(0, hidden.shape[0], ctx.chunk):
            rows = slice(a, a + ctx.chunk)
            # (c, V)
            log_p = (hidden[rows] @ weight.T).to(lse.dtype) / ctx.temperature - lse[rows, None]
            p = log_p.exp()
            # dz = g_lp (onehot - p) - g_H p (log p + H), built in place in log_p and p
            dz = (
                log_p.add_(entropy[rows, None])
                .mul_(p)
                .mul_(-grad_entropy[rows, None].to(lse.dtype))
                if grad_entropy is not None
                else log_p.zero_()
            )
            if grad_log_probs is not None:
                g = grad_log_probs[rows, None].to(lse.dtype)
                dz.sub_(p.mul_(g)).scatter_add_(-1, targets[rows, None], g)
            del p
            dlogits = dz.div_(ctx.temperature).to(hidden.dtype)
            if grad_hidden is not None:
                grad_hidden[rows] = dlogits @ weight
            if grad_weight is not None:
                grad_weight += (dlogits.T @ hidden[rows]).to(lse.dtype)
        return (
            grad_hidden,
            None if grad_weight is None else grad_weight.to(weight.dtype),
            None,
            None,
            None,
        )


def plain_output_layer(model):
    """Whether `model`'s output layer is a bias-free linear layer whose logits the model returns
    unchanged (no soft-capping, as Gemma 2's, no scaling, as Cohere's): what `fused_log_probs`
    needs, which reads the log-probs from the layer itself."""
    head = model.get_output_embeddings()
    scaled = shapes.scaled_logits(model.config)
    return isinstance(head, torch.nn.Linear) and head.bias is None and not scaled


@contextlib.contextmanager
def fused_log_probs(model, select, targets, temperature, chunk_elements=2**28):
    """While the block runs `model`'s forward, its output layer returns, instead of logits over the
    vocabulary, the log-probs of `targets` (K,) at the positions `select` picks from the hidden
    states it receives (-> (K, H)), through `ChunkedLogProbs` with chunks of `chunk_elements` logits
    (1 GiB in fp32 by default). Yields a dict that then holds "log_probs" and "entropy" (K,).

    The layer runs where the model calls it, inside its forward: under FSDP2 the root unit's
    parameters are gathered there, and their gradients are reduced as usual. Only a bias-free linear
    output layer whose logits the model returns as they are qualifies (`plain_output_layer`)."""
    head = model.get_output_embeddings()
    if not plain_output_layer(model):
        raise ValueError(
            f"--use_fused_kernels: {type(model).__name__}'s output layer is not a bias-free linear "
            "layer whose logits the model returns unchanged; run without --use_fused_kernels"
        )
    out = {}

    def forward(hidden):
        out["log_probs"], out["entropy"] = ChunkedLogProbs.apply(
            select(hidden),
            head.weight,
            targets,
            temperature,
            max(1, chunk_elements // head.weight.shape[0]),
        )
        return out["log_probs"]

    head.forward = forward
    try:
        yield out
    finally:
        del head.forward  # the class's forward again
