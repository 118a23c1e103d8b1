"""The hybrid engine under `torchrun --nproc_per_node=2` (gloo, CPU): FSDP2 training, streaming full
tensors, pushing them into an in-process vLLM engine per rank, checkpoints and export.

Run by tests/test_engine.py: torchrun --nproc_per_node=2 tests/dist/engine_checks.py WORKDIR
Every check records numbers into WORKDIR/engine_checks.json (written by rank 0) and the pytest side
asserts on them, so one failed comparison does not hide the others. An exception on any rank exits
non-zero at once, and torchrun then stops the other rank instead of leaving it in a collective.
WORKDIR/reference.pt keeps what tests/dist/load_checks.py compares against at world size 1.
"""

import copy
import json
import os
import sys
import traceback

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict
from transformers import AutoModelForCausalLM

import checkpoint
import rollout
import sharding
from bench.tiny import make_tiny_model, make_tiny_tokenizer

B, T = 2, 24  # rows per rank, tokens per row of the training batches
LR = 1e-2  # large, so two AdamW steps move every weight (embeddings included) far from its init
PROMPTS = ["hello world", "The quick brown fox", "1 + 2 =", "tiny models say"]
MAX_TOKENS = 24


def batch(step: int, world: int):
    """The global batch of `step`, the same on every rank: (world*B, T) token ids and a loss mask
    that covers a different number of tokens per row, so a per-rank token mean would be wrong."""
    gen = torch.Generator().manual_seed(1000 + step)
    input_ids = torch.randint(0, 256, (world * B, T), generator=gen)  # (N, T)
    starts = torch.randint(1, T // 2, (world * B,), generator=gen)
    ends = torch.randint(T // 2 + 1, T + 1, (world * B,), generator=gen)
    pos = torch.arange(T)
    # (N, T), 1 on predicted tokens
    loss_mask = ((pos >= starts[:, None]) & (pos < ends[:, None])).float()
    return input_ids, loss_mask


def nll_sum(model, input_ids, loss_mask):
    """Sum of next-token negative log-likelihoods over the masked target tokens."""
    logits = model(input_ids=input_ids).logits.float()
    logp = torch.log_softmax(logits[:, :-1], -1).gather(-1, input_ids[:, 1:, None]).squeeze(-1)
    return -(logp * loss_mask[:, 1:]).sum()


def sharded_step(model, opt, sched, step, rank, world):
    """One AdamW step of the FSDP2 model on this rank's rows. The loss is divided by the global
    token count; FSDP2 averages gradients over ranks, so the local loss is scaled by the world
    size."""
    input_ids, loss_mask = batch(step, world)
    n_tokens = loss_mask[:, 1:].sum()
    rows = slice(rank * B, (rank + 1) * B)
    loss = nll_sum(model, input_ids[rows], loss_mask[rows]) / n_tokens
    (loss * world).backward()
    grads = {sharding.hf_name(n): p.grad.full_tensor() for n, p in model.named_parameters()}
    opt.step()
    sched.step()
    opt.zero_grad()
    total = loss.detach().clone()
    dist.all_reduce(total)
    return total.item(), grads


def reference_step(model, opt, sched, step, world, micro_batches=1):
    """The same step unsharded on the whole global batch, in `micro_batches` accumulated pieces."""
    input_ids, loss_mask = batch(step, world)
    n_tokens = loss_mask[:, 1:].sum()
    loss = 0.0
    for ids, mask in zip(input_ids.chunk(micro_batches), loss_mask.chunk(micro_batches)):
        micro_loss = nll_sum(model, ids, mask) / n_tokens
        micro_loss.backward()
        loss += micro_loss.item()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    opt.step()
    sched.step()
    opt.zero_grad()
    return loss, grads


def make_optim(model):
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.01)
    return opt, torch.optim.lr_scheduler.LinearLR(
        opt, start_factor=1.0, end_factor=0.5, total_iters=10
    )


def max_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys(), sorted(set(a) ^ set(b))
    return max((a[k].float() - b[k].float()).abs().max().item() for k in a)


def probe_logits(model):
    input_ids, _ = batch(99, 1)
    with torch.no_grad():
        return model(input_ids=input_ids).logits.float()


def hf_greedy(model, prompts):
    """transformers' greedy decoding, one prompt at a time (no padding)."""
    out = []
    for ids in prompts:
        gen = model.generate(
            input_ids=torch.tensor([ids]),
            attention_mask=torch.ones(1, len(ids), dtype=torch.long),
            max_new_tokens=MAX_TOKENS,
            do_sample=False,
            top_k=None,
            top_p=None,
            temperature=None,
        )
        out.append(gen[0, len(ids) :].tolist())
    return out


def rescore(model, prompts, samples, temperature):
    """Log-probs the training model gives the engine's sampled tokens, in one forward (a collective
    for FSDP2, so every rank calls it once with a batch of the same shape)."""
    seqs = [(p, s) for p, group in zip(prompts, samples) for s in group]
    width = max(len(p) for p in prompts) + MAX_TOKENS
    input_ids = torch.full((len(seqs), width), 256)  # (N, L), right-padded
    attention_mask = torch.zeros_like(input_ids)
    response_mask = torch.zeros(len(seqs), width - 1)  # (N, L-1), aligned with the predicted tokens
    rollout_log_probs = torch.zeros(len(seqs), width - 1)
    for i, (p, s) in enumerate(seqs):
        ids = p + s.token_ids
        input_ids[i, : len(ids)] = torch.tensor(ids)
        attention_mask[i, : len(ids)] = 1
        response_mask[i, len(p) - 1 : len(ids) - 1] = 1
        rollout_log_probs[i, len(p) - 1 : len(ids) - 1] = torch.tensor(s.logprobs)
    with torch.no_grad():
        logits = model(input_ids=input_ids, attention_mask=attention_mask).logits.float()
    log_probs = (
        torch.log_softmax(logits[:, :-1] / temperature, -1)
        .gather(-1, input_ids[:, 1:, None])
        .squeeze(-1)
    )
    return rollout.logprob_gap(log_probs, rollout_log_probs, response_mask)


def greedy(engine, prompts):
    samples = engine.generate(prompts, temperature=0, max_tokens=MAX_TOKENS)
    return [s[0].token_ids for s in samples], [s[0].logprobs for s in samples]


def main(work: str) -> list[dict]:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(1)  # two ranks on two cores
    r = {}
    model_dir = os.path.join(work, "tiny")
    if rank == 0:
        make_tiny_model(model_dir)
    dist.barrier()

    def load():
        return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)

    ref, model, model_gc = load(), load(), load()
    sharding.apply_fsdp2(model, param_dtype=torch.float32, reduce_dtype=torch.float32)
    sharding.apply_fsdp2(
        model_gc, param_dtype=torch.float32, reduce_dtype=torch.float32, gradient_checkpointing=True
    )
    r["sharded"] = all(isinstance(p, sharding.DTensor) for p in model.parameters())

    # --- 2. iter_full_tensors equals the unsharded state dict: names, exact values, bf16 cast
    ref_sd = ref.state_dict()
    tied_extra = {"lm_head.weight"} if ref.config.tie_word_embeddings else set()
    for tag, m in (("plain", model), ("gc", model_gc)):
        full = dict(sharding.iter_full_tensors(m))
        r[f"full_names_{tag}"] = sorted(full) == sorted(set(ref_sd) - tied_extra)
        r[f"full_exact_{tag}"] = all(torch.equal(full[k], ref_sd[k]) for k in full)
        bf16 = dict(sharding.iter_full_tensors(m, dtype=torch.bfloat16))
        r[f"full_bf16_{tag}"] = sorted(bf16) == sorted(full) and all(
            t.dtype == torch.bfloat16 and torch.equal(t, ref_sd[k].bfloat16())
            for k, t in bf16.items()
        )
    init_embed = ref_sd["model.embed_tokens.weight"].clone()
    # bf16 compute: after a no-grad forward the root (not resharded after forward) holds bf16
    # copies; the stream must still give the fp32 masters
    model_bf16 = load()
    sharding.apply_fsdp2(model_bf16, param_dtype=torch.bfloat16)
    with torch.no_grad():
        model_bf16(input_ids=torch.tensor([[1, 2, 3]]))
    full = dict(sharding.iter_full_tensors(model_bf16))
    r["full_exact_after_bf16_forward"] = all(
        t.dtype == torch.float32 and torch.equal(t, ref_sd[k]) for k, t in full.items()
    )
    del model_bf16

    # --- 1. FSDP2 training equals unsharded training in fp32 (two AdamW steps)
    # ref sees the concatenated batch; ref_mb too, as two micro-batches equal to the ranks' rows,
    # which sums gradients in the order the reduce-scatter does
    ref_mb = copy.deepcopy(ref)
    ref_opt, ref_sched = make_optim(ref)
    ref_mb_opt, ref_mb_sched = make_optim(ref_mb)
    opt, sched = make_optim(model)
    opt_gc, sched_gc = make_optim(model_gc)
    r["loss_diff"], r["grad_diff"], r["loss_diff_gc"], r["grad_diff_gc"] = 0.0, 0.0, 0.0, 0.0
    for step in (1, 2):
        ref_loss, ref_grads = reference_step(ref, ref_opt, ref_sched, step, world)
        reference_step(ref_mb, ref_mb_opt, ref_mb_sched, step, world, micro_batches=world)
        loss, grads = sharded_step(model, opt, sched, step, rank, world)
        loss_gc, grads_gc = sharded_step(model_gc, opt_gc, sched_gc, step, rank, world)
        r["loss_diff"] = max(r["loss_diff"], abs(loss - ref_loss))
        r["loss_diff_gc"] = max(r["loss_diff_gc"], abs(loss_gc - ref_loss))
        r["grad_diff"] = max(r["grad_diff"], max_diff(grads, ref_grads))
        r["grad_diff_gc"] = max(r["grad_diff_gc"], max_diff(grads_gc, ref_grads))
        r[f"loss_step{step}"] = ref_loss
    r["grad_max"] = max(g.abs().max().item() for g in ref_grads.values())
    ref_params = dict(ref.named_parameters())
    r["param_diff"] = max_diff(
        dict(sharding.iter_full_tensors(model)), {k: v.detach() for k, v in ref_params.items()}
    )
    r["param_diff_gc"] = max_diff(
        dict(sharding.iter_full_tensors(model_gc)), {k: v.detach() for k, v in ref_params.items()}
    )
    r["param_diff_mb"] = max_diff(
        dict(sharding.iter_full_tensors(model)),
        {k: v.detach() for k, v in ref_mb.named_parameters()},
    )
    del ref_mb, ref_mb_opt
    r["embed_moved"] = (ref_params["model.embed_tokens.weight"] - init_embed).abs().max().item()
    del model_gc, opt_gc

    # --- 5. (first half) save at world size 2; reference.pt holds what a world-size-1 load must see
    ckpt_root = os.path.join(work, "ckpt")
    trainer_state = {"epoch": 0, "data_index": 7}
    checkpoint.save_checkpoint(
        ckpt_root, 2, {"actor": model}, {"actor": opt}, {"actor": sched}, trainer_state
    )
    # copies: the gathered state shares its scalar `step` tensors with the live optimizer
    full_optim = copy.deepcopy(
        get_optimizer_state_dict(model, opt, options=StateDictOptions(full_state_dict=True))
    )
    sched_step2 = sched.state_dict()
    logits_step2 = probe_logits(model)

    # --- 3. push trained weights into vLLM: greedy equals transformers, sampled log-probs match
    tok = make_tiny_tokenizer()
    prompts = [tok.encode(p) for p in PROMPTS]
    engine = rollout.VLLMEngine(
        model_dir, max_model_len=256, seed=0, max_num_seqs=16, **rollout.ON_CPU
    )
    before, _ = greedy(engine, prompts)  # still the initial weights from disk
    engine.update_weights(sharding.iter_full_tensors(model))
    trained_tokens, trained_logprobs = greedy(engine, prompts)
    hf_trained = hf_greedy(ref, prompts)
    r["greedy_changed_by_push"] = trained_tokens != before
    r["greedy_equal_hf"] = trained_tokens == hf_trained
    r["greedy_tokens"] = trained_tokens
    samples = engine.generate(prompts, n=2, temperature=1.0, max_tokens=MAX_TOKENS)
    r["gap_trained"] = rescore(model, prompts, samples, 1.0)
    r["gap_trained_ref"] = rescore(ref, prompts, samples, 1.0)
    # tp=1: each rank is its own data-parallel group with its own seed, so the same prompts sample
    # differently
    all_samples = [None] * world
    dist.all_gather_object(all_samples, [[s.token_ids for s in g] for g in samples])
    r["ranks_sample_differently"] = all_samples[0] != all_samples[1]
    dp_ranks = [None] * world
    dist.all_gather_object(dp_ranks, (engine.dp_rank, engine.dp_size, engine.tp_rank))
    r["dp_layout"] = dp_ranks

    # --- 4. perturbed weights (embeddings, hence the tied lm_head, included) change the output;
    # pushing the trained weights back restores it exactly
    gen = torch.Generator().manual_seed(5)
    perturbed = {
        k: v + 0.05 * torch.randn(v.shape, generator=gen)
        for k, v in sharding.iter_full_tensors(model)
    }
    ref_pert = copy.deepcopy(ref)
    ref_pert.load_state_dict(perturbed, strict=False)
    r["pert_tied"] = ref_pert.lm_head.weight is ref_pert.model.embed_tokens.weight
    # without the tied lm_head repack, vLLM keeps the stale head: the log-prob gap check must see it
    repack = rollout._repack_tied_lm_head
    rollout._repack_tied_lm_head = lambda m: None
    try:
        engine.update_weights(iter(perturbed.items()))
        r["gap_stale_head"] = rescore(
            ref_pert, prompts, engine.generate(prompts, temperature=1.0, max_tokens=MAX_TOKENS), 1.0
        )
    finally:
        rollout._repack_tied_lm_head = repack
    engine.update_weights(iter(perturbed.items()))
    pert_tokens, _ = greedy(engine, prompts)
    r["pert_changed"] = pert_tokens != trained_tokens
    r["pert_equal_hf"] = pert_tokens == hf_greedy(ref_pert, prompts)
    r["gap_pert"] = rescore(
        ref_pert,
        prompts,
        engine.generate(prompts, n=2, temperature=1.0, max_tokens=MAX_TOKENS),
        1.0,
    )
    engine.update_weights(sharding.iter_full_tensors(model))
    restored_tokens, restored_logprobs = greedy(engine, prompts)
    r["restored_tokens"] = restored_tokens == trained_tokens
    r["restored_logprobs"] = restored_logprobs == trained_logprobs
    r["gap_restored"] = rescore(
        model, prompts, engine.generate(prompts, n=2, temperature=1.0, max_tokens=MAX_TOKENS), 1.0
    )
    # bf16 stream into the fp32 engine: the engine casts, tokens may differ but the log-probs stay
    # close
    engine.update_weights(sharding.iter_full_tensors(model, dtype=torch.bfloat16))
    r["gap_bf16_push"] = rescore(
        model, prompts, engine.generate(prompts, n=2, temperature=1.0, max_tokens=MAX_TOKENS), 1.0
    )
    # a push that leaves a tensor out is refused, naming it
    partial = [(k, v) for k, v in sharding.iter_full_tensors(model) if k != "model.norm.weight"]
    try:
        engine.update_weights(iter(partial))
        r["partial_push"] = "accepted"
    except ValueError as e:
        r["partial_push"] = str(e)
    engine.update_weights(sharding.iter_full_tensors(model))
    # the engine's own parameters (vLLM's: q/k/v and gate/up stacked, repacked for its kernels), for
    # load_checks.py to compare with an engine that loads the exported weights from disk
    engine_weights = engine.llm.apply_model(
        lambda m: {n: p.detach().clone() for n, p in m.named_parameters()}
    )[0]

    # --- 6. a save that dies midway leaves the previous checkpoint as the latest, and it loads
    real_save = checkpoint.dcp.save

    def dying_save(state, checkpoint_id):  # as torch's writer on a full disk
        os.makedirs(checkpoint_id, exist_ok=True)
        with open(os.path.join(checkpoint_id, f"__{dist.get_rank()}_0.distcp"), "w") as f:
            f.write("half written")
        raise RuntimeError("unexpected pos 704 vs 598")

    real_usage = checkpoint.shutil.disk_usage
    checkpoint.dcp.save = dying_save
    checkpoint.shutil.disk_usage = lambda path: real_usage(path)._replace(free=5 * 2**20)
    try:
        checkpoint.save_checkpoint(
            ckpt_root, 3, {"actor": model}, {"actor": opt}, {"actor": sched}, trainer_state
        )
        r["crash_raised"] = False
    except OSError as e:
        r["crash_raised"] = True
        r["crash_message"] = str(e)
    finally:
        checkpoint.dcp.save = real_save
        checkpoint.shutil.disk_usage = real_usage
    dist.barrier()
    latest = checkpoint.latest_checkpoint(ckpt_root)
    r["latest_after_crash"] = os.path.relpath(latest, work) if latest else None
    r["list_after_crash"] = checkpoint.list_checkpoints(ckpt_root)
    r["tmp_left"] = os.path.isdir(os.path.join(ckpt_root, ".tmp_global_step_3"))
    fresh = load()
    sharding.apply_fsdp2(fresh, param_dtype=torch.float32, reduce_dtype=torch.float32)
    fresh_opt, fresh_sched = make_optim(fresh)
    state = checkpoint.load_checkpoint(
        latest, {"actor": fresh}, {"actor": fresh_opt}, {"actor": fresh_sched}
    )
    r["loaded_state_ws2"] = state
    r["loaded_logits_diff_ws2"] = (probe_logits(fresh) - logits_step2).abs().max().item()
    r["loaded_lr_ws2"] = [fresh_sched.get_last_lr(), sched.get_last_lr()]
    del fresh, fresh_opt
    # the same step again after the crash, then keep_last pruning in another root
    checkpoint.save_checkpoint(ckpt_root, 3, {"actor": model}, trainer_state=trainer_state)
    r["list_after_retry"] = checkpoint.list_checkpoints(ckpt_root)
    r["tmp_left_after_retry"] = os.path.isdir(os.path.join(ckpt_root, ".tmp_global_step_3"))
    prune_root = os.path.join(work, "prune")
    for step in (1, 2, 3, 4):
        checkpoint.save_checkpoint(prune_root, step, {"actor": model}, keep_last=2)
    r["pruned"] = sorted(os.listdir(prune_root))
    with open(os.path.join(prune_root, checkpoint.TRACKER)) as f:
        r["tracker"] = f.read()

    # --- 7. export (fp32 for exact comparisons, bf16 as the default); load_checks.py opens them
    checkpoint.export_hf(os.path.join(work, "export"), model, tok, dtype=torch.float32)
    checkpoint.export_hf(os.path.join(work, "export_bf16"), model, tok)

    # --- 5. (second half) one more step from the saved state, for the world-size-1 resume to match
    sharded_step(model, opt, sched, 3, rank, world)
    logits_step3 = probe_logits(model)
    if rank == 0:
        torch.save(
            {
                "logits_step2": logits_step2,
                "logits_step3": logits_step3,
                "optim": full_optim,
                "sched": sched_step2,
                "trainer_state": trainer_state,
                "greedy_tokens": hf_trained,
                "prompts": prompts,
                "engine_weights": engine_weights,
            },
            os.path.join(work, "reference.pt"),
        )

    per_rank = [None] * world
    dist.all_gather_object(per_rank, r)
    return per_rank


if __name__ == "__main__":
    work = sys.argv[1]
    try:
        per_rank = main(work)
        if dist.get_rank() == 0:
            with open(os.path.join(work, "engine_checks.json"), "w") as f:
                json.dump(per_rank, f, indent=1)
        dist.barrier()
        code = 0
    except BaseException:  # noqa: BLE001 - any failure must end this rank now (see below)
        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    # Exit without interpreter teardown: vLLM's atexit shutdown destroys the default process group
    # and, racing the other rank, can raise "Invalid process group specified" and exit non-zero
    # after every check has passed. On failure this also stops torchrun from waiting on a
    # collective the failed rank will never join.
    os._exit(code)
