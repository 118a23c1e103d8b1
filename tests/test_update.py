"""Each train script's update against computations that share none of its code: the loss written
out term by term on a plain model and differentiated by autograd, a step on the KL term alone, and
the update on two ranks against one rank on all the samples.

The bugs these are for: a loss not multiplied by the world size before backward() (FSDP2 averages
gradients over ranks), a token or sequence count taken on one rank, a KL term with the wrong sign,
a clip or dual-clip that binds the wrong way, an importance weight or entropy bonus left out, in
either script's copy of the update (tests/test_shared_math.py holds the copied math by hand).
"""

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoModelForTokenClassification

import passes
import train_grpo
import train_ppo
from tests.dist.update_checks import MODES
from tests.tiny_model import GradRecorder, make_samples, tiny_critic, tiny_policy, torchrun

SCRIPTS = {"grpo": train_grpo, "ppo": train_ppo}
LENGTHS = [(5, 6), (4, 2), (7, 5), (3, 4)]  # 2 prompts x n = 2; T = 6
T = 6


def plain_copy(model, kind=AutoModelForCausalLM):
    """The same weights in a model of transformers' own attention, unsharded: nothing of the
    project's passes (packing, compiled math, fused output layer) between it and autograd."""
    plain = kind.from_config(model.config, dtype=torch.float32, attn_implementation="eager")
    plain.load_state_dict(model.state_dict())
    return plain


def response_rows(model, prompt, response):
    """Row t holds the model's output where response token t is predicted: (|response|, out)."""
    out = model(input_ids=torch.tensor([prompt + response])).logits[0]
    return out[len(prompt) - 1 : len(prompt) + len(response) - 1]


def hand_actor_loss(model, samples, old, ref, adv, weights, args):
    """update_actor's loss on one mini-batch of all `samples`, token-mean:

    ratio = pi / pi_old,  obj = min(ratio A, clip(ratio, 1 - 0.2, 1 + 0.28) A), and for A < 0
    obj = max(obj, 3 A);  pg = -w obj;  kl = pi_ref / pi - log(pi_ref / pi) - 1 (k3);
    H = -sum_v p_v log p_v;  loss = mean(pg) + 0.1 mean(kl) - 0.01 mean(H)
    """
    pg, kl, entropy = [], [], []
    for i, (p, r) in enumerate(samples):
        log_p = torch.log_softmax(response_rows(model, p, r) / args.temperature, -1)  # (|r|, V)
        lp = log_p[torch.arange(len(r)), r]
        a, k = adv[i, : len(r)], len(r)
        ratio = torch.exp(lp - old[i, :k])
        obj = torch.minimum(ratio * a, torch.clamp(ratio, 0.8, 1.28) * a)
        obj = torch.where(a < 0, torch.maximum(obj, 3.0 * a), obj)
        pg.append(-weights[i, :k] * obj)
        d = ref[i, :k] - lp
        kl.append(torch.exp(d) - d - 1)
        entropy.append(-(log_p.exp() * log_p).sum(-1))
    tokens = sum(len(r) for _, r in samples)
    mean = lambda xs: torch.cat(xs).sum() / tokens  # noqa: E731
    return mean(pg) + 0.1 * mean(kl) - 0.01 * mean(entropy)


def actor_inputs(model):
    """Old log-probs moved so that ratios clip above and below, one token with a ratio past the
    dual-clip bound under a negative advantage; reference log-probs apart from the policy's;
    advantages of both signs; importance weights around 1."""
    samples = make_samples(LENGTHS, seed=21)
    _, mask = passes.response_targets(samples, T, "cpu")
    with torch.no_grad():
        log_probs, _ = passes.forward_log_probs(model, samples, 1.0, True)
    g = torch.Generator().manual_seed(22)
    old = log_probs + 0.8 * (torch.rand(4, T, generator=g) - 0.5)
    old[1, 0] = log_probs[1, 0] - 1.5  # ratio e^1.5 = 4.5 > 3
    adv = train_grpo.compute_grpo_outcome_advantage(torch.tensor([1.0, 0.0, 0.0, 1.0]), mask, n=2)
    ref = log_probs + 0.5 * torch.randn(4, T, generator=g)
    weights = 0.5 + torch.rand(4, T, generator=g)
    return samples, old * mask, ref * mask, adv, weights * mask, mask


def actor_args(script, **kw):
    kw = (
        dict(
            rollout_n=2,
            train_batch_size=2,
            ppo_mini_batch_size=2,  # one mini-batch: one optimizer step
            ppo_micro_batch_size_per_gpu=1,
            clip_ratio_high=0.28,
            use_kl_loss=True,
            kl_loss_coef=0.1,
            entropy_coeff=0.01,
            grad_clip=1e9,  # clipping would hide a gradient's scale
            max_response_length=T,
        )
        | kw
    )
    return script.Args(**kw)


def update_actor(script, model, optimizer, samples, old, ref, adv, mask, args, weights=None):
    model.zero_grad(set_to_none=True)  # the trainer enters each update with no gradients
    return script.update_actor(
        actor=model,
        optimizer=optimizer,
        samples=samples,
        old_log_probs=old,
        ref_log_probs=ref,
        advantages=adv,
        response_mask=mask,
        args=args,
        step=1,
        device=torch.device("cpu"),
        is_weights=weights,
    )


@pytest.mark.parametrize("name", SCRIPTS)
def test_update_actor_gradient_equals_the_loss_written_out(name, monkeypatch):
    script = SCRIPTS[name]
    monkeypatch.setattr(script.dist, "get_world_size", lambda: 1)
    model = tiny_policy()
    samples, old, ref, adv, weights, mask = actor_inputs(model)
    plain = plain_copy(model)
    args = actor_args(script)
    hand_actor_loss(plain, samples, old, ref, adv, weights, args).backward()
    recorder = GradRecorder(model)
    metrics = update_actor(script, model, recorder, samples, old, ref, adv, mask, args, weights)
    (grads,) = recorder.steps
    for n, p in plain.named_parameters():
        torch.testing.assert_close(grads[n], p.grad, rtol=1e-4, atol=1e-6, msg=n)
    norm = torch.cat([p.grad.flatten() for p in plain.parameters()]).norm()
    assert metrics["actor/grad_norm"] == pytest.approx(norm.item(), rel=1e-4)


def kl_to(model, samples, ref, mask):
    """The mean k3 estimate of KL(pi || pi_ref) over the response tokens."""
    with torch.no_grad():
        log_probs, _ = passes.forward_log_probs(model, samples, 1.0, True)
    d = (ref - log_probs) * mask
    return ((torch.exp(d) - d - 1) * mask).sum() / mask.sum()


@pytest.mark.parametrize("name", SCRIPTS)
def test_a_step_on_the_kl_term_alone_moves_the_policy_toward_the_reference(name, monkeypatch):
    """Advantages of 0 and no entropy bonus leave the KL loss as the only term: one SGD step must
    lower the KL to the reference (a flipped sign raises it)."""
    script = SCRIPTS[name]
    monkeypatch.setattr(script.dist, "get_world_size", lambda: 1)
    model = tiny_policy()
    samples, _, ref, _, _, mask = actor_inputs(model)
    with torch.no_grad():
        old, _ = passes.forward_log_probs(model, samples, 1.0, True)
    before = kl_to(model, samples, ref, mask)
    args = actor_args(script, kl_loss_coef=1.0, entropy_coeff=0.0)
    sgd = torch.optim.SGD(model.parameters(), lr=3e-3)
    zero = torch.zeros_like(mask)
    metrics = update_actor(script, model, sgd, samples, old, ref, zero, mask, args)
    after = kl_to(model, samples, ref, mask)
    assert metrics["actor/kl_loss"] == pytest.approx(before.item(), rel=1e-5)
    assert metrics["actor/pg_loss"] == 0
    assert after < 0.5 * before, (before, after)  # 0.091 -> 0.024; with the sign flipped: 0.21


def test_update_critic_gradient_equals_the_value_loss_written_out(monkeypatch):
    """vf = 0.5 max((V - R)^2, (V_old + clip(V - V_old, -0.2, 0.2) - R)^2), token-mean, x vf_coef,
    where V of token t is the score head's output at the position that predicts it."""
    monkeypatch.setattr(train_ppo.dist, "get_world_size", lambda: 1)
    critic = tiny_critic()
    plain = plain_copy(critic, AutoModelForTokenClassification)
    samples = make_samples(LENGTHS, seed=23)
    _, mask = passes.response_targets(samples, T, "cpu")
    g = torch.Generator().manual_seed(24)
    with torch.no_grad():
        values = passes.forward_values(critic, samples, True)
    old = (values + 0.4 * torch.randn(4, T, generator=g)) * mask
    returns = torch.randn(4, T, generator=g) * mask
    losses = []
    for i, (p, r) in enumerate(samples):
        v, k = response_rows(plain, p, r)[:, 0], len(r)
        clipped = old[i, :k] + torch.clamp(v - old[i, :k], -0.2, 0.2)
        ret = returns[i, :k]
        losses.append(0.5 * torch.maximum((v - ret) ** 2, (clipped - ret) ** 2))
    (0.5 * torch.cat(losses).sum() / mask.sum()).backward()
    args = train_ppo.Args(
        rollout_n=2,
        train_batch_size=2,
        ppo_mini_batch_size=2,
        critic_ppo_micro_batch_size_per_gpu=1,
        critic_grad_clip=1e9,
        cliprange_value=0.2,
        vf_coef=0.5,
    )
    recorder = GradRecorder(critic)
    critic.zero_grad(set_to_none=True)
    metrics = train_ppo.update_critic(
        critic=critic,
        optimizer=recorder,
        samples=samples,
        values=old,
        returns=returns,
        response_mask=mask,
        args=args,
        step=1,
        device=torch.device("cpu"),
    )
    (grads,) = recorder.steps
    for n, p in plain.named_parameters():
        torch.testing.assert_close(grads[n], p.grad, rtol=1e-4, atol=1e-6, msg=n)
    assert metrics["critic/vf_clipfrac"] > 0  # the clip bound somewhere


# --- two ranks against one ---------------------------------------------------------------------

CASES = [
    f"{name}.{update}.{mode}"
    for name, update in [
        ("grpo", "update_actor"),
        ("ppo", "update_actor"),
        ("ppo", "update_critic"),
    ]
    for mode in MODES
]


@pytest.fixture(scope="module")
def updates(tmp_path_factory):
    """tests/dist/update_checks.py's results at a world of two and of one."""
    work = tmp_path_factory.mktemp("updates")
    for nproc in (2, 1):
        torchrun(nproc, "tests/dist/update_checks.py", work)
    return {w: torch.load(work / f"updates_world{w}.pt", weights_only=False) for w in (1, 2)}


@pytest.mark.parametrize("case", CASES)
def test_two_ranks_take_the_steps_of_one_rank_on_all_the_samples(updates, case):
    two, one = updates[2][case], updates[1][case]
    assert len(two["grads"]) == len(one["grads"]) == 4  # 2 epochs x 2 mini-batches
    for step, (a, b) in enumerate(zip(two["grads"], one["grads"])):
        assert a.keys() == b.keys()
        for n in b:
            # fp32 sums in another order: up to ~2e-6 of a tensor's largest entry by step 4
            scale = b[n].abs().max().item()
            torch.testing.assert_close(a[n], b[n], rtol=0, atol=1e-5 * scale + 1e-6, msg=n)
    assert two["metrics"].keys() == one["metrics"].keys()
    for k, v in one["metrics"].items():
        assert two["metrics"][k] == pytest.approx(v, rel=1e-4, abs=1e-6), k
    grad_norm = [k for k in one["metrics"] if k.endswith("/grad_norm")]
    assert grad_norm and all(one["metrics"][k] > 0 for k in grad_norm)
