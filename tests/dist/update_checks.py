"""Each train script's own updates on two ranks against one rank, on CPU (gloo, FSDP2, fp32).

Run by tests/test_update.py, twice with the same WORKDIR:
    torchrun --nproc_per_node=2 tests/dist/update_checks.py WORKDIR
    torchrun --nproc_per_node=1 tests/dist/update_checks.py WORKDIR
Both build the same batch: 4 prompts x 2 responses, the first rank's share with long responses and
the second's with short ones, so a token count or a mean taken on one rank instead of over all
would be wrong. The world of two gives each rank its share; the world of one takes every sample, in
the order that makes its mini-batches the union of the two ranks' (mini-batch j of the whole batch
is rank 0's j-th and rank 1's j-th). Each script's `update_actor` (GRPO's, PPO's copy) and PPO's
`update_critic` then run on a sharded tiny model for two epochs of two mini-batches, stepping SGD;
the optimizer records every parameter's full gradient before each step. Rank 0 writes the gradients
and the returned metrics to WORKDIR/updates_world{W}.pt for the test to compare.
"""

import copy
import os
import sys
import traceback

import torch
import torch.distributed as dist

import passes
import sharding
import train_grpo
import train_ppo
from tests.tiny_model import make_samples, tiny_critic, tiny_policy

# 4 prompts x n = 2; rows 0-3 are rank 0's share at world 2 (long responses), rows 4-7 rank 1's
LENGTHS = [(5, 9), (7, 8), (4, 7), (6, 9), (3, 2), (5, 1), (4, 3), (6, 2)]
N, T, RANKS = len(LENGTHS), 9, 2
MODES = ("token-mean", "seq-mean-token-mean")


class RecordingSGD(torch.optim.SGD):
    """SGD that keeps each parameter's whole gradient (gathered from its FSDP2 shards) at each step,
    before stepping."""

    def __init__(self, model, lr=0.1):
        super().__init__(model.parameters(), lr=lr)
        self.names = [sharding.hf_name(n) for n, _ in model.named_parameters()]
        self.grads = []

    def step(self, closure=None):
        grads = {}
        for name, p in zip(self.names, self.param_groups[0]["params"]):
            g = p.grad.full_tensor() if isinstance(p.grad, sharding.DTensor) else p.grad
            grads[name] = g.detach().clone()
        self.grads.append(grads)
        return super().step(closure)


def batch():
    """The whole batch, the same on every rank: samples, response mask, old and reference
    log-probs (the policy's own, moved so that ratios clip both ways), advantages, old values and
    returns."""
    samples = make_samples(LENGTHS, seed=11)
    _, mask = passes.response_targets(samples, T, "cpu")
    g = torch.Generator().manual_seed(12)
    with torch.no_grad():
        log_probs, _ = passes.forward_log_probs(tiny_policy(), samples, 1.0, True)
        values = passes.forward_values(tiny_critic(), samples, True)
    old = (log_probs + 0.6 * (torch.rand(N, T, generator=g) - 0.5)) * mask
    ref = (log_probs + 0.3 * torch.randn(N, T, generator=g)) * mask
    advantages = train_grpo.compute_grpo_outcome_advantage(
        torch.tensor([1.0, 0.0, 0.3, 0.9, 0.0, 1.0, 0.5, 0.2]), mask, n=2
    )
    values = (values + 0.4 * torch.randn(N, T, generator=g)) * mask
    returns = torch.randn(N, T, generator=g) * mask
    return samples, mask, old, ref, advantages, values, returns


def rows(rank, world):
    """This rank's rows of the whole batch, in the order its mini-batches take them: its share at
    world 2, or at world 1 the two ranks' mini-batches one after the other."""
    share = N // RANKS
    if world == RANKS:
        return list(range(rank * share, (rank + 1) * share))
    mini = 2  # sequences per mini-batch per rank at world 2 (ppo_mini_batch_size 2 x n 2 / 2)
    order = [(j, r, i) for j in range(share // mini) for r in range(RANKS) for i in range(mini)]
    return [r * share + j * mini + i for j, r, i in order]


def run(script, update, mode, mine, data):
    samples, mask, old, ref, advantages, values, returns = (
        [data[0][i] for i in mine],
        *(x[mine] for x in data[1:]),
    )
    args = script.Args(
        rollout_n=2,
        train_batch_size=4,
        ppo_mini_batch_size=2,
        ppo_micro_batch_size_per_gpu=1,
        ppo_epochs=2,
        loss_agg_mode=mode,
        clip_ratio_high=0.28,
        use_kl_loss=True,
        kl_loss_coef=0.1,
        entropy_coeff=0.01,
        grad_clip=1e9,  # clipping would hide a gradient's scale
        max_response_length=T,
    )
    if update == "update_critic":
        args.critic_ppo_micro_batch_size_per_gpu, args.critic_grad_clip = 1, 1e9
        args.cliprange_value = 0.2
        model = sharding.apply_fsdp2(tiny_critic(), param_dtype=torch.float32)
        optimizer = RecordingSGD(model)
        metrics = script.update_critic(
            critic=model,
            optimizer=optimizer,
            samples=samples,
            values=values,
            returns=returns,
            response_mask=mask,
            args=args,
            step=1,
            device=torch.device("cpu"),
        )
    else:
        model = sharding.apply_fsdp2(tiny_policy(), param_dtype=torch.float32)
        optimizer = RecordingSGD(model)
        metrics = script.update_actor(
            actor=model,
            optimizer=optimizer,
            samples=samples,
            old_log_probs=old,
            ref_log_probs=ref,
            advantages=advantages,
            response_mask=mask,
            args=args,
            step=1,
            device=torch.device("cpu"),
        )
    return {"grads": optimizer.grads, "metrics": metrics}


def main(work):
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(1)
    data = batch()
    mine = rows(rank, world)
    results = {}
    for name, script, update in (
        ("grpo", train_grpo, "update_actor"),
        ("ppo", train_ppo, "update_actor"),
        ("ppo", train_ppo, "update_critic"),
    ):
        for mode in MODES:
            results[f"{name}.{update}.{mode}"] = run(script, update, mode, mine, copy.copy(data))
    if rank == 0:
        torch.save(results, os.path.join(work, f"updates_world{world}.pt"))


if __name__ == "__main__":
    try:
        main(sys.argv[1])
        code = 0
    except BaseException:  # noqa: BLE001 - any failure ends this rank now, as engine_checks.py
        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
