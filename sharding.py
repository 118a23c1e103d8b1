"""FSDP2: a model sharded over the ranks, and the resharding that hands the engine full tensors.

- `apply_fsdp2` shards a Hugging Face causal LM (or a value model on the same body) with
  `fully_shard`, one unit per decoder layer plus the root, as torchtitan does.
- `iter_full_tensors` is the local resharding function of the hybrid engine: it all-gathers one
  parameter at a time from the FSDP2 shards and yields it under its Hugging Face name, so vLLM's
  loaders cut their own tensor-parallel slices and the full state dict never exists at once.
- `move_optimizer_state` / `init_optimizer_state`: AdamW's state, sharded as its parameters, on the
  CPU between updates or made up front.
- `all_sum`, `gather_objects`, `gather_rows`, `masked_mean`: the sums and gathers over the ranks
  that a step's statistics take.
All ranks must call every function here (they are collectives).
"""

import re
from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch.distributed.fsdp import (
    CPUOffloadPolicy,
    FSDPModule,
    MixedPrecisionPolicy,
    OffloadPolicy,
    fully_shard,
)
from torch.distributed.tensor import DTensor

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


def all_sum(*values, device):
    """Sum floats over ranks."""
    t = torch.tensor(values, dtype=torch.float64, device=device)
    if dist.is_initialized():
        dist.all_reduce(t)
    return t.tolist()


def gather_objects(obj, group=None):
    """Every rank's `obj`, in rank order, on every rank (over `group`, default: the default
    group)."""
    if not dist.is_initialized():
        return [obj]
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj, group=group)
    return out


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
