"""World size 1 side of the checkpoint and export checks: run after tests/dist/engine_checks.py
with the same WORKDIR, as torchrun --nproc_per_node=1 tests/dist/load_checks.py WORKDIR.

Loads the checkpoint that 2 ranks saved into a 1-rank FSDP2 model, AdamW and LR scheduler and
compares outputs, optimizer state and one more training step with what the 2 ranks recorded in
reference.pt; then opens the exported Hugging Face folders with transformers and with a new vLLM
engine. Results go to WORKDIR/load_checks.json for tests/test_engine.py to assert on.
"""

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
from tests.dist.engine_checks import (
    MAX_TOKENS,
    batch,
    greedy,
    hf_greedy,
    make_optim,
    nll_sum,
    probe_logits,
)


def tensors_equal(a, b) -> bool:
    """Nested optimizer state dicts hold identical tensors and values."""
    if isinstance(a, dict):
        return (
            isinstance(b, dict)
            and a.keys() == b.keys()
            and all(tensors_equal(a[k], b[k]) for k in a)
        )
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(tensors_equal(x, y) for x, y in zip(a, b))
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and torch.equal(a, b)
    return a == b


def main(work: str) -> dict:
    dist.init_process_group("gloo")
    assert dist.get_world_size() == 1
    ref = torch.load(os.path.join(work, "reference.pt"), weights_only=False)
    r = {}

    # --- 5. a world-size-2 checkpoint resumes at world size 1
    model = AutoModelForCausalLM.from_pretrained(os.path.join(work, "tiny"), dtype=torch.float32)
    sharding.apply_fsdp2(model, param_dtype=torch.float32, reduce_dtype=torch.float32)
    opt, sched = make_optim(model)
    latest = checkpoint.latest_checkpoint(os.path.join(work, "ckpt"))
    r["latest"] = os.path.relpath(latest, work)
    with open(os.path.join(latest, "trainer_state.json")) as f:
        r["saved_world_size"] = json.load(f)["world_size"]
    state = checkpoint.load_checkpoint(
        os.path.join(work, "ckpt", "global_step_2"),
        {"actor": model},
        {"actor": opt},
        {"actor": sched},
    )
    r["trainer_state"] = state
    r["trainer_state_expected"] = {"global_step": 2, "world_size": 2, **ref["trainer_state"]}
    full_optim = get_optimizer_state_dict(
        model, opt, options=StateDictOptions(full_state_dict=True)
    )
    r["logits_diff"] = (probe_logits(model) - ref["logits_step2"]).abs().max().item()
    r["optim_equal"] = tensors_equal(full_optim, ref["optim"])
    r["optim_has_moments"] = all(
        {"exp_avg", "exp_avg_sq", "step"} <= s.keys() for s in full_optim["state"].values()
    )
    r["sched_equal"] = sched.state_dict() == ref["sched"]
    # step 3 on the whole global batch, accumulated over the two ranks' halves in their order
    input_ids, loss_mask = batch(3, 2)
    for ids, mask in zip(input_ids.chunk(2), loss_mask.chunk(2)):
        (nll_sum(model, ids, mask) / loss_mask[:, 1:].sum()).backward()
    opt.step()
    sched.step()
    opt.zero_grad()
    r["logits_step3_diff"] = (probe_logits(model) - ref["logits_step3"]).abs().max().item()

    # --- 7. the exported folders load in transformers and in vLLM and generate as the trained model
    prompts = ref["prompts"]
    exported = AutoModelForCausalLM.from_pretrained(os.path.join(work, "export"))
    r["export_dtype"] = str(exported.dtype)
    r["export_tied"] = exported.lm_head.weight is exported.model.embed_tokens.weight
    r["export_hf_greedy"] = hf_greedy(exported, prompts) == ref["greedy_tokens"]
    r["export_logits_diff"] = (probe_logits(exported) - ref["logits_step2"]).abs().max().item()
    exported_bf16 = AutoModelForCausalLM.from_pretrained(os.path.join(work, "export_bf16"))
    r["export_bf16_dtype"] = str(exported_bf16.dtype)
    fp32_weights = exported.state_dict()
    r["export_bf16_weights"] = all(
        torch.equal(t, fp32_weights[k].bfloat16()) for k, t in exported_bf16.state_dict().items()
    )
    engine = rollout.VLLMEngine(
        os.path.join(work, "export"), max_model_len=256, seed=0, max_num_seqs=16, **rollout.ON_CPU
    )
    tokens, _ = greedy(engine, prompts)
    r["export_vllm_greedy"] = tokens == ref["greedy_tokens"]
    # the engine that was pushed the trained weights holds what this one loaded from their export
    loaded = engine.llm.apply_model(
        lambda m: {n: p.detach().clone() for n, p in m.named_parameters()}
    )[0]
    pushed = ref["engine_weights"]
    r["engine_weight_names_equal"] = sorted(loaded) == sorted(pushed)
    r["engine_weights_max_diff"] = max(
        (loaded[k].float() - pushed[k].float()).abs().max().item()
        for k in loaded
        if k in pushed and loaded[k].numel()  # vLLM keeps a few empty placeholders
    )
    r["max_tokens"] = MAX_TOKENS
    return r


if __name__ == "__main__":
    work = sys.argv[1]
    try:
        result = main(work)
        with open(os.path.join(work, "load_checks.json"), "w") as f:
            json.dump(result, f, indent=1)
        code = 0
    except BaseException:  # noqa: BLE001 - report any failure as a non-zero exit
        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # skip vLLM's atexit shutdown, as in engine_checks.py
