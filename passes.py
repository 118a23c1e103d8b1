"""A step's passes over a rank's sequences: packing them, cutting them into micro-batches, the
log-probs and values without gradients (phase 3), the update's forward and its optimizer step
(phase 5).

A train script's phases run these over a rank's share of the batch, a list of (prompt_ids,
response_ids) pairs ("samples"); results are (N, T) tensors, T the longest response of the share.
All ranks call them together: a micro-batch's forward is a collective under FSDP2, so every rank
cuts its share into the same number of micro-batches.
"""

import torch
import torch.distributed as dist

import ops
from sharding import compute_device


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
    None), with a gradient where one is recorded. `fused` (--use_fused_kernels): both from the
    output layer chunk by chunk (fused_log_probs), never the whole (K, V) logits, in the passes
    without a gradient too (their logits are a pass's largest tensor: 7.5 GiB at a 26k-token
    micro-batch and a 152k vocabulary)."""
    device = compute_device(model)  # not the parameters' under --param_offload
    batch = collate(samples, packed, device)
    rows, cols, b, T = batch.pop("unpack")
    targets = torch.tensor([t for _, r in samples for t in r], device=device)
    # one row per response token, (K, ...): packed rows already are; padded ones drop the last
    # position (position t predicts token t+1) and the padding
    select = (lambda x: x[0]) if packed else (lambda x: x[:, :-1][rows, cols])  # noqa: E731
    if fused:
        with ops.fused_log_probs(model, select, targets, temperature) as head:
            model(**batch, use_cache=False)
        flat, flat_entropy = head["log_probs"], head["entropy"]
    else:
        logits = select(model(**batch, use_cache=False).logits)  # (K, V)
        flat, flat_entropy = ops.LOGITS_MATH["log_probs"](
            logits, targets, temperature, with_entropy
        )
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
    model, samples, micro, temperature, packed, T, max_tokens=None, with_entropy=False, fused=False
):
    """Log-probs (N, T) of a rank's sequences, in micro-batches, and their entropy (N, T) if asked
    (else None), from the same read of the logits (`fused`: of the output layer chunk by chunk)."""

    def forward(s):
        log_probs, entropy = forward_log_probs(model, s, temperature, packed, with_entropy, fused)
        return (log_probs, entropy) if with_entropy else (log_probs,)

    outs = batched(forward, samples, micro, T, max_tokens)
    return outs[0], outs[1] if with_entropy else None


def log_prob_pass(model, samples, T, args, with_entropy=False):
    """`batched_log_probs` with the flags' micro-batches (--log_prob_micro_batch_size_per_gpu, or
    --log_prob_max_token_len_per_gpu tokens with --use_dynamic_bsz), temperature, packing and
    output layer (--use_fused_kernels)."""
    budget = args.log_prob_max_token_len_per_gpu if args.use_dynamic_bsz else None
    micro, packed = args.log_prob_micro_batch_size_per_gpu, args.use_remove_padding
    return batched_log_probs(
        model,
        samples,
        micro,
        args.temperature,
        packed,
        T,
        budget,
        with_entropy=with_entropy,
        fused=args.use_fused_kernels,
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


def value_pass(model, samples, T, args, micro, budget):
    """`batched_values` in micro-batches of `micro` sequences, or of `budget` tokens with
    --use_dynamic_bsz (the value model's own flags), packed as the flags say."""
    budget = budget if args.use_dynamic_bsz else None
    return batched_values(model, samples, micro, args.use_remove_padding, T, budget)


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
