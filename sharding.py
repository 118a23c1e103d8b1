"""FSDP2 plumbing shared by every train script: wrap, stream full tensors, checkpoint, export.

- `apply_fsdp2` shards a Hugging Face causal LM (or a value model on the same body) with
  `fully_shard`, one unit per decoder layer plus the root, as torchtitan does.
- `iter_full_tensors` is the local resharding function of the hybrid engine: it all-gathers one
  parameter at a time from the FSDP2 shards and yields it under its Hugging Face name, so vLLM's
  loaders cut their own tensor-parallel slices and the full state dict never exists at once.
- `save_checkpoint` / `load_checkpoint` use torch.distributed.checkpoint (sharded, loadable at
  another world size), written to a temporary folder and renamed, so a crash mid-save leaves the
  last good checkpoint as it was. Folders follow verl's layout: `global_step_{N}` plus the tracker
  file `latest_checkpointed_iteration.txt`. A save that fails (a full disk) removes its
  half-written folder and says what to do.
- `export_hf` writes a folder that `transformers` and vLLM load directly.
- `PACKED_ATTENTION` is an attention implementation for packed sequences (`--use_remove_padding`):
  flash attention over variable-length segments on GPU, so no (L, L) mask is ever built.
- `compile_layers`, `no_grad_compiled` and `compiled_log_probs` are the torch.compile choices of the
  scripts' speed flags; `compiled_log_probs` writes the gradient of the log-probs (and entropy) by
  hand, so the update reuses the kernel the passes without gradients compiled.
- `fused_log_probs` makes the output layer return the log-probs of given tokens, chunk by chunk,
  so a training forward never holds the logits over the whole vocabulary (`--use_fused_kernels`).
- The passes of a train step over a rank's sequences: `collate` packs them (or pads them),
  `micro_batches` cuts them by count or by token budget, `batched_log_probs` and `batched_values`
  run the frozen passes; `forward_log_probs` / `forward_values` are the update's forward.
  `load_policy` and `load_critic` load and shard the models, `compile_ahead` compiles a step's
  passes before step 1.
All ranks must call every function here (they are collectives); only rank 0 writes shared files.
The checkpoint folder must be on a file system every rank sees (any single node; NFS or similar
across nodes).
"""

import contextlib
import errno
import functools
import json
import os
import re
import shutil
import sys
import time
from collections.abc import Iterator

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.fsdp import (
    CPUOffloadPolicy,
    FSDPModule,
    MixedPrecisionPolicy,
    OffloadPolicy,
    fully_shard,
)
from torch.distributed.tensor import DTensor
from transformers import (
    AttentionInterface,
    AutoConfig,
    AutoModelForCausalLM,
    AutoModelForTokenClassification,
)
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

TRACKER = "latest_checkpointed_iteration.txt"  # verl's name for "which global_step_N is the latest"
_WRAPPER_PREFIXES = re.compile(r"(_checkpoint_wrapped_module|_fsdp_wrapped_module|_orig_mod)\.")


def rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def decoder_layers(model: torch.nn.Module) -> torch.nn.ModuleList:
    """The repeated blocks of a Hugging Face model: `model.model.layers` for Qwen2/Qwen3/Llama and
    for their token-classification (value) variants, which keep the body under the same name."""
    for path in ("model.layers", "transformer.h", "layers"):
        module = model
        for attr in path.split("."):
            module = getattr(module, attr, None)
        if isinstance(module, torch.nn.ModuleList):
            return module
    raise ValueError(
        f"{type(model).__name__}: no decoder layers found under model.layers / transformer.h / "
        f"layers"
    )


# --- packed sequences: variable-length attention ------------------------------------------------

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


def apply_fsdp2(
    model: torch.nn.Module,
    *,
    param_dtype: torch.dtype = torch.bfloat16,
    reduce_dtype: torch.dtype = torch.float32,
    gradient_checkpointing: bool = False,
    cpu_offload: bool = False,
    mesh=None,
) -> torch.nn.Module:
    """Shard `model` in place: `fully_shard` on each decoder layer, then on the root.

    Parameters stay in their stored dtype (fp32 masters for training) and are cast to `param_dtype`
    for compute; gradients are reduced in `reduce_dtype`. `cpu_offload` keeps parameters, gradients
    and the optimizer step on the CPU (verl's `param_offload`). Gradient checkpointing uses the
    model's own non-reentrant checkpointing, which leaves parameter names untouched; as Hugging
    Face's, it acts in train mode only, which the scripts' updates switch to (and back to eval).
    """
    if gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.config.use_cache = False
    kwargs = dict(
        mesh=mesh,
        mp_policy=MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype),
        offload_policy=CPUOffloadPolicy() if cpu_offload else OffloadPolicy(),
    )
    for layer in decoder_layers(model):
        fully_shard(layer, **kwargs)
    # The root unit holds the embeddings, final norm and head. FSDP2 never reshards the root after
    # forward (backward would gather it again at once): see `reshard`.
    fully_shard(model, **kwargs)
    return model


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


# --- the policy's output layer without whole logits (--use_fused_kernels) ------------------------


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
    config = model.config.get_text_config()
    scaled = (
        getattr(config, "final_logit_softcapping", None)
        or getattr(config, "logit_scale", 1.0) not in (None, 1.0)
        or getattr(config, "logits_scaling", 1.0) not in (None, 1.0)
    )
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


def compute_device(model: torch.nn.Module) -> torch.device:
    """The device `model`'s forward computes on, where its inputs belong. That is its parameters'
    device, except under CPU offload (`apply_fsdp2(cpu_offload=True)`): FSDP2 then keeps the shards
    on the CPU and gathers them onto its mesh's accelerator for each forward."""
    param = next(model.parameters())
    kind = param.device_mesh.device_type if isinstance(param, DTensor) else param.device.type
    if kind == param.device.type:
        return param.device
    return torch.device(kind, torch.accelerator.current_device_index())


def hf_name(name: str) -> str:
    """A parameter name as the Hugging Face checkpoint spells it (wrapper prefixes removed)."""
    return _WRAPPER_PREFIXES.sub("", name)


def reshard(model: torch.nn.Module) -> None:
    """Free every unsharded parameter copy. After a no-grad forward (log-probs, validation) the
    root unit still holds its gathered params in param_dtype (bf16) in place of the fp32 shards:
    reading or writing parameters then would see those copies."""
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()


@torch.no_grad()
def iter_full_tensors(
    model: torch.nn.Module,
    dtype: torch.dtype | None = None,
    device: torch.device | str | None = None,
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield `(hf_name, full_tensor)` for every parameter, gathered one at a time on every rank.

    Casting to `dtype` happens on the shard, before the all-gather, so a bf16 push moves half the
    bytes of an fp32 one. Tied parameters appear once (under the first name, as in the checkpoint).
    Only one gathered tensor is alive per step of the iterator if the consumer does not keep it.
    Each is a new tensor, never a view of the parameter.
    """
    reshard(model)
    for name, param in model.named_parameters():
        tensor = param.data
        if isinstance(tensor, DTensor) and tensor.device_mesh.size() == 1:
            # one rank holds all of it (a single GPU): a plain copy, no collective, no DTensor
            # dispatch (cast + all-gather through DTensor took 52 ms of a 109 ms push of 0.5B on one
            # H200)
            tensor = tensor.to_local().to(dtype or tensor.dtype, copy=True)
        elif dtype is not None:
            tensor = tensor.to(dtype)
        if isinstance(tensor, DTensor):
            if device is not None:  # CPU-offloaded shards gather over the GPU's process group
                tensor = tensor.to(device)
            tensor = tensor.full_tensor()
        elif device is not None:
            tensor = tensor.to(device)
        yield hf_name(name), tensor


@torch.no_grad()
def move_optimizer_state(optimizer: torch.optim.Optimizer, device: torch.device | str) -> None:
    """Move the optimizer's state (AdamW's two moments: 2x the parameters in fp32) to `device`:
    to the CPU between updates (verl's `optimizer_offload`), back to the GPU for the step."""
    for state in optimizer.state.values():
        for key, value in state.items():
            if isinstance(value, torch.Tensor) and key != "step":
                state[key] = value.to(device, non_blocking=True)
    if torch.cuda.is_available():
        torch.cuda.synchronize()


@torch.no_grad()
def init_optimizer_state(optimizer: torch.optim.Optimizer) -> None:
    """Make the optimizer's state now rather than at its first step (AdamW: the step count and both
    moments at 0, 2x the parameters in fp32), so step 1 holds the memory every later step holds:
    the memory plan is met, or not, from the first step on (without this, step 2 is the first to
    generate and run the log-prob passes beside AdamW's state). Made by torch's own code, as
    torch.distributed.checkpoint makes it: one step on zero gradients at learning rate 0, which
    leaves the parameters as they were (weight decay multiplies them by 1 - 0), then the step count
    back to 0; the first real step is AdamW's first step, bit for bit. No-op when a state exists (a
    resumed checkpoint's)."""
    if optimizer.state:
        return
    lrs = [group["lr"] for group in optimizer.param_groups]
    for group in optimizer.param_groups:
        group["lr"] = 0.0
        for p in group["params"]:
            if p.requires_grad:
                p.grad = torch.zeros_like(p)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    for group, lr in zip(optimizer.param_groups, lrs):
        group["lr"] = lr
    for state in optimizer.state.values():
        if torch.is_tensor(state.get("step")):
            state["step"].zero_()
        elif "step" in state:
            state["step"] = 0


# --- the passes: packing, micro-batches, log-probs and values; loading; compiling ahead -----------
#
# A train script's phases 3 and 5 run these over a rank's share of the batch, a list of (prompt_ids,
# response_ids) pairs ("samples"); results are (N, T) tensors, T the longest response of the share.


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


def gpu_default(flag, device):
    """A speed flag left unset (None) is on exactly when training on a GPU."""
    return device.type == "cuda" if flag is None else flag


def compiles(args, device):
    """Whether a step's passes compile (the layers, or the log-prob math), so that they can be
    compiled ahead of the first step (`compile_ahead`)."""
    return gpu_default(args.compile_layers, device) or gpu_default(args.use_torch_compile, device)


def collate(samples, packed, device):
    """Model inputs for a micro-batch of (prompt_ids, response_ids) pairs, and where to read back.

    Padded: prompts left-padded, responses right-padded, logits kept for the last T+1 positions.
    Packed (`--use_remove_padding`): all sequences in one row, positions restarting per sequence,
    segment bounds `cu_seq_lens` for variable-length attention (`packed_attention`), logits
    kept only where a response token is predicted. `unpack` = (rows, cols, b, T): response token k
    sits at [rows[k], cols[k]] of a (b, T) result, T = longest response, in the order of the kept
    logits.
    """
    T = max(max(len(r) for _, r in samples), 1)
    rows = torch.tensor([i for i, (_, r) in enumerate(samples) for _ in r], device=device)
    cols = torch.tensor([t for _, r in samples for t in range(len(r))], device=device)
    unpack = (rows, cols, len(samples), T)
    if packed:
        ids, pos, keep, cu = [], [], [], [0]
        for p, r in samples:
            keep += range(len(ids) + len(p) - 1, len(ids) + len(p) + len(r) - 1)
            ids += p + r
            pos += range(len(p) + len(r))
            cu.append(len(ids))
        return dict(
            input_ids=torch.tensor([ids], device=device),
            position_ids=torch.tensor([pos], device=device),
            logits_to_keep=torch.tensor(keep, device=device),
            unpack=unpack,
            cu_seq_lens=torch.tensor(cu, dtype=torch.int32, device=device),  # for packed_attention
            max_seq_len=max(b - a for a, b in zip(cu, cu[1:])),
        )
    P = max(len(p) for p, _ in samples)
    ids = [[0] * (P - len(p)) + p + r + [0] * (T - len(r)) for p, r in samples]
    attn = [[0] * (P - len(p)) + [1] * (len(p) + len(r)) + [0] * (T - len(r)) for p, r in samples]
    attn = torch.tensor(attn, device=device)
    return dict(
        input_ids=torch.tensor(ids, device=device),
        attention_mask=attn,
        position_ids=(attn.cumsum(-1) - 1).clamp(min=0),
        logits_to_keep=T + 1,
        unpack=unpack,
    )


def response_targets(samples, T, device):
    """(b, T) response token ids and response_mask."""
    ids = torch.tensor([r + [0] * (T - len(r)) for _, r in samples], device=device)
    mask = torch.tensor([[1] * len(r) + [0] * (T - len(r)) for _, r in samples], device=device)
    return ids, mask.float()


def forward_log_probs(model, samples, temperature, packed, with_entropy=False, fused=False):
    """log pi(y_t | x, y_<t) of each response token, (b, T), and the entropy (b, T) if asked (else
    None), with a gradient where one is recorded. `fused` (--use_fused_kernels), where a gradient is
    recorded: both from the output layer chunk by chunk (fused_log_probs), never the whole
    (K, V) logits."""
    device = compute_device(model)  # not the parameters' under --param_offload
    batch = collate(samples, packed, device)
    rows, cols, b, T = batch.pop("unpack")
    targets = torch.tensor([t for _, r in samples for t in r], device=device)
    # one row per response token, (K, ...): packed rows already are; padded ones drop the last
    # position (position t predicts token t+1) and the padding
    select = (lambda x: x[0]) if packed else (lambda x: x[:, :-1][rows, cols])  # noqa: E731
    if fused and torch.is_grad_enabled():
        with fused_log_probs(model, select, targets, temperature) as head:
            model(**batch, use_cache=False)
        flat, flat_entropy = head["log_probs"], head["entropy"]
    else:
        logits = select(model(**batch, use_cache=False).logits)  # (K, V)
        flat, flat_entropy = LOGITS_MATH["log_probs"](logits, targets, temperature, with_entropy)
    log_probs = torch.zeros(b, T, device=device, dtype=flat.dtype).index_put((rows, cols), flat)
    entropy = None
    if with_entropy:
        entropy = torch.zeros(b, T, device=device, dtype=flat_entropy.dtype).index_put(
            (rows, cols), flat_entropy
        )
    return log_probs, entropy


def micro_batches(samples, size, max_tokens=None):
    """Split a rank's sequences into micro-batches of indices, the same number on every rank
    (FSDP2's collectives run once per forward). Without a token budget: `size` sequences each, in
    order. With one (`--use_dynamic_bsz`): the fewest groups whose tokens fit `max_tokens` on every
    rank, filled longest sequence first into the lightest group, so a long and a short batch cost
    alike."""
    if not max_tokens:
        return [list(range(i, min(i + size, len(samples)))) for i in range(0, len(samples), size)]
    lengths = [len(p) + len(r) for p, r in samples]

    def fill(k):
        groups, loads = [[] for _ in range(k)], [0] * k
        for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
            j = loads.index(min(loads))
            groups[j].append(i)
            loads[j] += lengths[i]
        return [sorted(g) for g in groups], max(loads)

    k = max(1, -(-sum(lengths) // max_tokens))
    groups, load = fill(k)
    while k < len(lengths) and load > max_tokens:
        k += 1
        groups, load = fill(k)
    # the most groups any rank needs (never more than its sequences: equal counts)
    if dist.is_initialized():
        k_all = torch.tensor(k, device="cuda" if dist.get_backend() == "nccl" else "cpu")
        dist.all_reduce(k_all, op=dist.ReduceOp.MAX)
        if int(k_all) != k:
            groups, _ = fill(min(int(k_all), len(lengths)))
    return groups


@torch.no_grad()
def batched(forward, samples, micro, T, max_tokens=None):
    """`forward` (a list of samples -> a tuple of (b, T_b)) over a rank's sequences in micro-batches
    (same count on every rank), each output gathered into one (N, T) in the order of `samples`."""
    outs = None
    for idx in micro_batches(samples, micro, max_tokens):
        xs = forward([samples[i] for i in idx])
        outs = outs or [x.new_zeros(len(samples), T) for x in xs]
        for out, x in zip(outs, xs):
            out[idx, : x.shape[1]] = x
    return outs


def batched_log_probs(
    model, samples, micro, temperature, packed, T, max_tokens=None, with_entropy=False
):
    """Log-probs (N, T) of a rank's sequences, in micro-batches, and their entropy (N, T) if asked
    (else None), from the same read of the logits."""

    def forward(s):
        log_probs, entropy = forward_log_probs(model, s, temperature, packed, with_entropy)
        return (log_probs, entropy) if with_entropy else (log_probs,)

    outs = batched(forward, samples, micro, T, max_tokens)
    return outs[0], outs[1] if with_entropy else None


def log_prob_pass(model, samples, T, args, with_entropy=False):
    """`batched_log_probs` with the flags' micro-batches (--log_prob_micro_batch_size_per_gpu, or
    --log_prob_max_token_len_per_gpu tokens with --use_dynamic_bsz), temperature and packing."""
    budget = args.log_prob_max_token_len_per_gpu if args.use_dynamic_bsz else None
    micro, packed = args.log_prob_micro_batch_size_per_gpu, args.use_remove_padding
    return batched_log_probs(
        model, samples, micro, args.temperature, packed, T, budget, with_entropy
    )


def policy_forward(model, samples, args, with_entropy=False):
    """The update's forward: `forward_log_probs` with a gradient, at the flags' temperature, packing
    and output layer (--use_fused_kernels)."""
    fused, packed = args.use_fused_kernels, args.use_remove_padding
    return forward_log_probs(model, samples, args.temperature, packed, with_entropy, fused)


def forward_values(model, samples, packed):
    """V of each response token (b, T): the score head read where that token's log-prob is read
    (position P-1+t predicts token t), so the value of token t sees only the prompt and y_<t, as in
    verl."""
    device = compute_device(model)  # not the parameters' under --param_offload
    batch = collate(samples, packed, device)
    rows, cols, b, T = batch.pop("unpack")
    # the value model has no logits_to_keep: select after the head
    keep = batch.pop("logits_to_keep")
    out = model(**batch, use_cache=False).logits[..., 0].float()  # (1, packed length) or (b, P + T)
    flat = out[0, keep] if packed else out[:, -keep:-1][rows, cols]
    return torch.zeros(b, T, device=device, dtype=flat.dtype).index_put((rows, cols), flat)


def batched_values(model, samples, micro, packed, T, max_tokens=None):
    """Values (N, T) of a rank's sequences, in micro-batches."""
    return batched(lambda s: (forward_values(model, s, packed),), samples, micro, T, max_tokens)[0]


def value_pass(critic, samples, T, args):
    """`batched_values` with the flags' micro-batches (--critic_ppo_micro_batch_size_per_gpu, or
    --critic_ppo_max_token_len_per_gpu tokens with --use_dynamic_bsz) and packing."""
    budget = args.critic_ppo_max_token_len_per_gpu if args.use_dynamic_bsz else None
    micro = args.critic_ppo_micro_batch_size_per_gpu
    return batched_values(critic, samples, micro, args.use_remove_padding, T, budget)


def all_sum(*values, device):
    """Sum floats over ranks."""
    t = torch.tensor(values, dtype=torch.float64, device=device)
    if dist.is_initialized():
        dist.all_reduce(t)
    return t.tolist()


def gather_rows(*tensors):
    """Every rank's rows of each (b, T_rank) tensor, right-padded to the longest T, in rank order:
    the whole batch on every rank, for statistics over the batch (whitening, the controller's
    KL)."""
    parts = gather_objects([t.cpu() for t in tensors])
    T = max(p[0].shape[1] for p in parts)
    pad = torch.nn.functional.pad
    return [
        torch.cat([pad(p[k], (0, T - p[k].shape[1])) for p in parts]).to(tensors[0].device)
        for k in range(len(tensors))
    ]


def masked_mean(x, response_mask, n_tokens):
    """The mean of x (N/world, T) over the response tokens of all ranks, n_tokens of them."""
    return all_sum((x * response_mask).sum().item(), device=x.device)[0] / max(n_tokens, 1)


def gather_objects(obj, group=None):
    """Every rank's `obj`, in rank order, on every rank (over `group`, default: the default
    group)."""
    if not dist.is_initialized():
        return [obj]
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj, group=group)
    return out


def attention(args):
    """Variable-length attention for packed sequences, transformers' sdpa for padded ones."""
    return PACKED_ATTENTION if args.use_remove_padding else "sdpa"


def few_layers(config, layers):
    """`config` cut to its first `layers` decoder layers (`warm_compile_caches`' copy)."""
    config.num_hidden_layers = layers
    if getattr(config, "layer_types", None):
        config.layer_types = config.layer_types[:layers]
    return config


def load_policy(path, device, trainable, offload, args, layers=None):
    """A Hugging Face causal LM, fp32 masters, sharded with FSDP2 (bf16 compute on GPU). `layers`:
    instead, a randomly initialised copy with that many decoder layers."""
    kw = dict(dtype=torch.float32, attn_implementation=attention(args))
    if layers is None:
        model = AutoModelForCausalLM.from_pretrained(path, **kw)
    else:
        config = few_layers(AutoConfig.from_pretrained(path), layers)
        model = AutoModelForCausalLM.from_config(config, **kw)
    if device.type == "cuda" and not offload:
        model.to(device)
    if args.use_remove_padding:
        probe_flash_varlen(device)
    if gpu_default(args.compile_layers, device):
        compile_layers(model, with_grad=trainable and args.compile_update)
    apply_fsdp2(
        model,
        param_dtype=torch.bfloat16 if device.type == "cuda" else torch.float32,
        gradient_checkpointing=trainable and args.enable_gradient_checkpointing,
        cpu_offload=offload,
    )
    if not trainable:
        # Frozen: it only runs under torch.no_grad (`batched`) and no optimizer holds it. Its
        # parameters keep requires_grad=True, as the actor's: compiled layers guard on that flag,
        # and flipping it would compile every layer again for this model (14 s of the first step on
        # an H200).
        model.eval()
    return model


def load_critic(path, device, args, layers=None):
    """A value model on the policy's body, as verl builds it: AutoModelForTokenClassification with
    one label (the body under `.model`, a new linear `.score` head), fp32 masters, sharded with
    FSDP2. Dropout off (transformers' default for the head is 0.1; verl sets 0 too), so values are
    deterministic. `layers`: as `load_policy`'s."""
    config = AutoConfig.from_pretrained(path, num_labels=1)
    config.classifier_dropout = (
        0.0  # an attribute: from_pretrained drops a keyword its config class lacks
    )
    kw = dict(dtype=torch.float32, attn_implementation=attention(args))
    if layers is None:
        model = AutoModelForTokenClassification.from_pretrained(path, config=config, **kw)
    else:
        model = AutoModelForTokenClassification.from_config(few_layers(config, layers), **kw)
    if device.type == "cuda" and not args.critic_param_offload:
        model.to(device)
    if args.use_remove_padding:
        probe_flash_varlen(device)
    if gpu_default(args.compile_layers, device):
        compile_layers(model, with_grad=args.compile_update)
    apply_fsdp2(
        model,
        param_dtype=torch.bfloat16 if device.type == "cuda" else torch.float32,
        gradient_checkpointing=args.critic_enable_gradient_checkpointing,
        cpu_offload=args.critic_param_offload,
    )
    return model


def clip_and_step(model, optimizer, loss, max_norm, step, lr_flag):
    """Clip the global gradient norm and step; a non-finite loss (the mini-batch's, summed over its
    micro-batches) or gradient norm stops the run before the update, so the last checkpoint stays
    the last good state. Returns the norm before clipping."""
    if not torch.isfinite(loss):
        raise FloatingPointError(
            f"step {step}: non-finite loss {loss.item()}; stopping before the update (the last "
            f"checkpoint is untouched). Lower {lr_flag} or check the data."
        )
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    grad_norm = grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm
    if not torch.isfinite(grad_norm):
        raise FloatingPointError(
            f"step {step}: non-finite gradient norm {grad_norm.item()}; stopping before the "
            f"update (the last checkpoint is untouched). Lower {lr_flag}."
        )
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return grad_norm.item()


def made_up_batch(response_length, budget=None):
    """compile_ahead's sequences and their response length. With a token budget (--use_dynamic_bsz),
    enough sequences of 8 + response_length tokens to fill it, as a real step's micro-batches nearly
    do: inductor's code, and the guards it puts on it, change with size (past 2**31 logits it
    indexes in 64 bits; some fusions it allows only below a size), and a pass compiled on 20 tokens
    compiled again at the real 50-65k in the first step on an H200 (8 s, docs/benchmarks.md).
    Otherwise two short sequences. The last sequence is shorter than the others, and no size is 1,
    on which torch.compile would specialise."""
    R = response_length
    if not budget:
        return [(list(range(1, 9)), list(range(1, 13))), (list(range(1, 5)), list(range(1, 7)))], 12
    count = max(2, budget // (8 + R))
    response = [j % 97 + 1 for j in range(R)]
    return [(list(range(1, 9)), response)] * (count - 1) + [
        (list(range(1, 9)), response[: max(2, R // 2)])
    ], R


def compile_ahead(
    actor, ref, args, device, update_actor, critic=None, update_critic=None, tokens=None
):
    """Compile a step's passes before the first step: the old (and reference) log-prob passes and
    the update, with PPO's critic its values and its update too, on a made-up batch
    (`made_up_batch`, filling the largest token budget), the actor's update with advantages of 0,
    each with a throwaway SGD at learning rate 0, so the weights and the optimizers' state stay as
    they were. `update_actor` and `update_critic` are the train script's own. torch.compile's graphs
    take dynamic shapes: the real batches reuse them. With --engines_per_gpu the engines start in
    their own processes meanwhile, so the compiling (about 50 s of a GRPO step on an H200,
    docs/benchmarks.md) overlaps their start. `tokens`: the made-up batch's size instead
    (`warm_compile_caches`)."""
    # taken before a forward unshards the root's parameters
    no_step = torch.optim.SGD(actor.parameters(), lr=0.0)
    budgets = [args.log_prob_max_token_len_per_gpu, args.ppo_max_token_len_per_gpu]
    if critic is not None:
        no_critic_step = torch.optim.SGD(critic.parameters(), lr=0.0)
        budgets.append(args.critic_ppo_max_token_len_per_gpu)
    samples, T = made_up_batch(
        args.max_response_length, (tokens or max(budgets)) if args.use_dynamic_bsz else None
    )
    _, response_mask = response_targets(samples, T, device)
    budget = args.log_prob_max_token_len_per_gpu if args.use_dynamic_bsz else None
    old_log_probs, _ = batched_log_probs(
        actor,
        samples,
        args.log_prob_micro_batch_size_per_gpu,
        args.temperature,
        args.use_remove_padding,
        T,
        budget,
        with_entropy=True,
    )
    ref_log_probs = None
    if ref is not None:
        ref_log_probs, _ = batched_log_probs(
            ref,
            samples,
            args.log_prob_micro_batch_size_per_gpu,
            args.temperature,
            args.use_remove_padding,
            T,
            budget,
        )
    if critic is not None:
        values = batched_values(
            critic,
            samples,
            args.critic_ppo_micro_batch_size_per_gpu,
            args.use_remove_padding,
            T,
            args.critic_ppo_max_token_len_per_gpu if args.use_dynamic_bsz else None,
        )
        update_critic(
            critic,
            no_critic_step,
            samples,
            values,
            torch.zeros_like(values),
            response_mask,
            args,
            0,
            device,
        )
    update_actor(
        actor,
        no_step,
        samples,
        old_log_probs,
        ref_log_probs if args.use_kl_loss else None,
        torch.zeros_like(response_mask),
        response_mask,
        args,
        0,
        device,
    )


def small_batch_tokens(args, config):
    """The size of --warm_compile_caches' made-up batch (`made_up_batch`), where `compile_ahead`
    would fill the largest token budget: the fewest sequences past the sizes at which inductor's
    code changes (the guards it put on a made-up batch of 20 tokens, docs/benchmarks.md), so that a
    real step's micro-batches reuse the graphs: logits (K, V) past 2**31 elements, indexed in 64
    bits, and a fusion in the layers it makes only below 5,242,880 / hidden size tokens. For
    Qwen2.5-0.5B at 1,024-token responses: 15 sequences, 15,480 tokens (14,848 of them responses;
    14,134 pass 2**31 logits). At most the largest token budget (whose micro-batches never
    cross those sizes)."""
    R = args.max_response_length
    seqs = 2**31 // (config.vocab_size * R) + 2  # made_up_batch's last response is half as long
    tokens = max(seqs * (8 + R), 5_242_880 // config.hidden_size + 1)
    budgets = [args.log_prob_max_token_len_per_gpu, args.ppo_max_token_len_per_gpu]
    return min(tokens, max(budgets + [getattr(args, "critic_ppo_max_token_len_per_gpu", 0)]))


def name_globals_as_the_trainer():
    """In a process spawned from a train script: make pickle name globals as the trainer does. The
    compile caches' keys pickle globals such as torch.contiguous_format by reference, and pickle's C
    implementation names one by the first module in sys.modules that holds it: torch._utils in the
    trainer, but in a spawned process the trainer's script, imported first as __mp_main__, so every
    key would differ from the trainer's. Moved last in the order, the script is found last."""
    script = sys.modules.pop("__mp_main__", None)
    if script is not None:
        sys.modules["__mp_main__"] = script


def set_as_the_engine_will(args):
    """In --warm_compile_caches' helper: the torch settings that the in-process vLLM engine's
    worker makes in the trainer's process once it starts, and that the compile caches' keys hold
    (in AOTAutograd's, the "cuda_matmul_settings"): the float32 matmul precision, from
    VLLM_FLOAT32_MATMUL_PRECISION ("highest" unless set). Set explicitly, even to torch's own
    default, it changes every key, so without it no graph the helper compiled matched the
    trainer's (0 of 13 on an H200)."""
    if args.rollout_engine == "vllm":
        precision = os.environ.get("VLLM_FLOAT32_MATMUL_PRECISION", "highest").lower()
        torch.set_float32_matmul_precision(precision)


def warm_compile_caches(args, device, update_actor, update_critic, launched, engine_started):
    """The helper process of --warm_compile_caches (`run.Run.warm_compile_caches`), while the
    trainer loads its models, starts the in-process engine and runs its first step eager:
    `compile_ahead` on randomly initialised one-layer copies of the run's models (the actor, the
    reference where a KL term needs it, PPO's critic) and a small made-up batch, in a process group
    of its own. torch.compile keeps what it compiles in caches on disk (inductor's graphs,
    AOTAutograd's, Triton's kernels), keyed by the graph, and every decoder layer of a model shares
    one (`compile_layers`): after its first step the trainer runs `compile_ahead` on the same batch
    (little memory beside the awake engine) and loads the code instead of compiling it. Only the
    same calls in the same order hit: which sizes torch.compile makes one symbol depends on the
    sizes it has seen."""
    from rollout import TORCHRUN_ENV

    for key in TORCHRUN_ENV:  # not one of torchrun's workers
        os.environ.pop(key, None)
    name_globals_as_the_trainer()
    set_as_the_engine_will(args)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(
        "nccl" if device.type == "cuda" else "gloo",
        store=dist.HashStore(),
        rank=0,
        world_size=1,
        device_id=device if device.type == "cuda" else None,
    )
    if gpu_default(args.use_torch_compile, device):
        compile_logits_math()
    actor = load_policy(args.model, device, True, False, args, layers=1)
    ref = None
    if args.use_kl_loss or args.use_kl_in_reward:
        ref = load_policy(args.model, device, False, False, args, layers=1)
    critic = None
    if update_critic is not None:
        critic = load_critic(args.critic_model, device, args, layers=1)
    tokens = small_batch_tokens(args, AutoConfig.from_pretrained(args.model))
    started = time.time() - launched
    compile_ahead(actor, ref, args, device, update_actor, critic, update_critic, tokens)
    dist.destroy_process_group()
    print(
        f"the helper process compiled the passes {time.time() - launched:.1f} s after launch "
        f"(from {started:.1f} s)",
        flush=True,
    )
    # GPU memory freed while the trainer's vLLM engine starts would upset the engine's measure of
    # the free memory ("Error in memory profiling"): the helper ends, freeing its memory, once the
    # engine has started (or the trainer has ended)
    trainer = torch.multiprocessing.parent_process()
    while not engine_started.wait(1.0) and trainer.is_alive():
        pass


# --------------------------------------------------------------------------- checkpoints


def _step_of(folder: str) -> int | None:
    m = re.fullmatch(r"global_step_(\d+)", folder)
    return int(m.group(1)) if m else None


def list_checkpoints(root: str) -> list[int]:
    """Steps of the complete checkpoints under `root` (a `global_step_N` with its marker),
    sorted."""
    if not os.path.isdir(root):
        return []
    steps = [_step_of(f) for f in os.listdir(root)]
    done = lambda s: os.path.exists(os.path.join(root, f"global_step_{s}", "COMPLETE"))  # noqa: E731
    return sorted(s for s in steps if s is not None and done(s))


def latest_checkpoint(root: str) -> str | None:
    """The newest complete checkpoint folder under `root`, or None."""
    steps = list_checkpoints(root)
    return os.path.join(root, f"global_step_{steps[-1]}") if steps else None


def save_checkpoint(
    root: str,
    step: int,
    models: dict[str, torch.nn.Module],
    optimizers: dict[str, torch.optim.Optimizer] | None = None,
    schedulers: dict | None = None,
    trainer_state: dict | None = None,
    keep_last: int | None = None,
) -> str:
    """Save a sharded checkpoint as `root/global_step_{step}`, atomically.

    `models` / `optimizers` / `schedulers` are keyed by role ("actor", "critic", ...). Every rank
    writes its shards into `root/.tmp_global_step_{step}`; then rank 0 writes the trainer state
    (JSON: step, data position, ...) and the schedulers, marks the folder COMPLETE and renames it.
    A folder without the marker is never loaded. Keeps the newest `keep_last` checkpoints.
    No random number generator's state is kept: nothing in a step draws from one (the engines seed
    each generation from the seed, step and round, the data order from the seed and epoch), so a
    resumed run replays an uninterrupted one without it (tests/test_train_grpo.py).
    """
    final = os.path.join(root, f"global_step_{step}")
    tmp = os.path.join(root, f".tmp_global_step_{step}")
    if rank() == 0:
        os.makedirs(root, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)  # left by a save that died
        os.makedirs(tmp)
    barrier()
    state = {f"model.{k}": get_model_state_dict(m) for k, m in models.items()}
    for k, opt in (optimizers or {}).items():
        state[f"optim.{k}"] = get_optimizer_state_dict(models[k], opt)
    with _writing(tmp, root, f"checkpoint {final}"):
        dcp.save(state, checkpoint_id=tmp)
    barrier()
    if rank() == 0:
        with _writing(tmp, root, f"checkpoint {final}"):
            extra = {"schedulers": {k: s.state_dict() for k, s in (schedulers or {}).items()}}
            torch.save(extra, os.path.join(tmp, "schedulers.pt"))
            with open(os.path.join(tmp, "trainer_state.json"), "w") as f:
                json.dump(
                    {
                        "global_step": step,
                        "world_size": dist.get_world_size() if dist.is_initialized() else 1,
                        **(trainer_state or {}),
                    },
                    f,
                    indent=1,
                )
            open(os.path.join(tmp, "COMPLETE"), "w").close()
        if os.path.exists(final):
            shutil.rmtree(final)
        os.replace(tmp, final)
        tracker_tmp = os.path.join(root, TRACKER + ".tmp")
        with open(tracker_tmp, "w") as f:
            f.write(str(step))
        os.replace(tracker_tmp, os.path.join(root, TRACKER))
        if keep_last:
            for old in list_checkpoints(root)[:-keep_last]:
                shutil.rmtree(os.path.join(root, f"global_step_{old}"), ignore_errors=True)
    barrier()
    return final


@contextlib.contextmanager
def _writing(tmp, root, what):
    """A write into the folder `tmp` that becomes `what`: when it fails, the half-written folder
    goes and the error says why, a full disk by name (torch's writers report one as "unexpected pos
    704 vs 598" or "file write failed"), and what to do."""
    try:
        yield
    except Exception as error:
        shutil.rmtree(tmp, ignore_errors=True)
        try:
            free = shutil.disk_usage(root).free
        except OSError:
            free = None
        chain, e = [], error
        while e is not None and len(chain) < 8:
            chain.append(e)
            e = e.__cause__ or e.__context__
        full = any(getattr(e, "errno", None) == errno.ENOSPC for e in chain)
        full = full or any("No space left" in str(e) for e in chain)
        full = full or (free is not None and free < 256 * 2**20)
        why = (
            f"the disk holding {root} is full ({free / 2**20:.0f} MiB free)"
            if full and free is not None
            else "the disk is full"
            if full
            else f"{type(error).__name__}: {error}"
        )
        latest = latest_checkpoint(root) if os.path.isdir(root) else None
        kept = f"the last checkpoint, {latest}, is untouched" if latest else "no checkpoint before"
        raise OSError(
            errno.ENOSPC if full else errno.EIO,
            f"writing {what} failed: {why}. The half-written folder is removed and {kept}. Free "
            "space (--keep_last_checkpoints N keeps fewer checkpoints) and run the same command "
            "with --resume_mode auto",
        ) from error


class CheckpointError(Exception):
    """A checkpoint that cannot be read: the message names it and what failed."""


def load_checkpoint(
    path: str,
    models: dict[str, torch.nn.Module],
    optimizers: dict[str, torch.optim.Optimizer] | None = None,
    schedulers: dict | None = None,
) -> dict:
    """Load a checkpoint written by `save_checkpoint` (at any world size); returns the trainer
    state. One that cannot be read (truncated, damaged, of other models) raises CheckpointError;
    what it loaded so far is overwritten by the next checkpoint loaded."""
    if not os.path.exists(os.path.join(path, "COMPLETE")):
        raise FileNotFoundError(
            f"{path} is not a complete checkpoint (no COMPLETE marker); pick another "
            f"global_step_N or start fresh with --resume_mode disable"
        )
    try:  # the small files first: a damaged one fails before any weight is touched
        with open(os.path.join(path, "trainer_state.json")) as f:
            trainer_state = json.load(f)
        extra = torch.load(os.path.join(path, "schedulers.pt"), weights_only=False)
        state = {f"model.{k}": get_model_state_dict(m) for k, m in models.items()}
        for k, opt in (optimizers or {}).items():
            state[f"optim.{k}"] = get_optimizer_state_dict(models[k], opt)
        dcp.load(state, checkpoint_id=path)
    # the reader's own message rarely names the checkpoint (and dcp's error is a BaseException)
    except (Exception, dcp.api.CheckpointException) as e:
        raise CheckpointError(f"{path} cannot be read: {type(e).__name__}: {e}") from e
    for k, m in models.items():
        set_model_state_dict(m, state[f"model.{k}"])
    for k, opt in (optimizers or {}).items():
        set_optimizer_state_dict(models[k], opt, state[f"optim.{k}"])
    for k, s in (schedulers or {}).items():
        s.load_state_dict(extra["schedulers"][k])
    return trainer_state


# --------------------------------------------------------------------------- export


def export_hf(
    path: str,
    model: torch.nn.Module,
    tokenizer=None,
    dtype: torch.dtype = torch.bfloat16,
    max_shard_bytes: int = 4 << 30,
) -> str:
    """Write `model` as a Hugging Face folder (safetensors shards + index, config, generation
    config, tokenizer with its chat template), atomically, on rank 0. Collective: call on all
    ranks."""
    from safetensors.torch import save_file

    tmp = path.rstrip("/") + ".tmp"
    if rank() == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, tensor in iter_full_tensors(model, dtype=dtype):
        if rank() != 0:
            continue
        nbytes = tensor.numel() * tensor.element_size()
        if size + nbytes > max_shard_bytes and shards[-1]:
            shards.append({})
            size = 0
        shards[-1][name] = tensor.detach().to("cpu", copy=True).contiguous()
        size += nbytes
    if rank() == 0:
        root = os.path.dirname(os.path.abspath(path))
        with _writing(tmp, root, f"the final policy {path}"):
            weight_map = {}
            for i, shard in enumerate(shards):
                fname = (
                    "model.safetensors"
                    if len(shards) == 1
                    else f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
                )
                save_file(shard, os.path.join(tmp, fname), metadata={"format": "pt"})
                weight_map.update({k: fname for k in shard})
            if len(shards) > 1:
                total = sum(t.numel() * t.element_size() for s in shards for t in s.values())
                with open(os.path.join(tmp, "model.safetensors.index.json"), "w") as f:
                    json.dump(
                        {"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=1
                    )
            config = model.config.__class__.from_dict(model.config.to_dict())
            config.dtype = dtype
            config.use_cache = True
            config.save_pretrained(tmp)
            if getattr(model, "generation_config", None) is not None:
                model.generation_config.save_pretrained(tmp)
            if tokenizer is not None:
                tokenizer.save_pretrained(tmp)
        shutil.rmtree(path, ignore_errors=True)
        os.replace(tmp, path)
    barrier()
    return path
