"""Realistic one-line bugs, each made alone in a copy of the tree, and the tests that fail on it.

A test is for a bug; this list says which. Each entry is a mistake a contributor could make (a sign,
a missing factor, a count on one rank, a tensor the push forgets), the file and text it changes, and
the tests of `make test` meant to catch it. The script copies the tree (the files git tracks or
would track), checks that those tests pass there as it is, then makes each bug in turn, runs its
tests and puts the file back. A bug its tests do not notice is a hole in the suite: the script
lists it and exits 1.

    python tests/mutations.py             # the fast tier: bugs caught by unit and two-rank tests
    python tests/mutations.py --all       # every bug, those only the end-to-end runs catch too
    python tests/mutations.py --list      # the list, without running anything
    python tests/mutations.py NAME ...    # these bugs only (their names as --list prints them)
    make mutate / make mutate-all         # the same two tiers, with the project's interpreter

`tests/test_mutations.py` (in `make test`) checks that every entry still applies: its text occurs
exactly once where it says, and its tests exist.
"""

import argparse
import dataclasses
import os
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


@dataclasses.dataclass(frozen=True)
class Mutation:
    """`old` -> `new` in `path` (inside the top-level function `function` when given: `old` must
    occur there exactly once); `tests`, pytest node ids, must fail on it. `slow`: they launch the
    train scripts (a minute or more each)."""

    name: str
    bug: str
    path: str
    old: str
    new: str
    tests: tuple
    function: str | None = None
    slow: bool = False


def both(name, bug, old, new, tests, function=None, slow=False):
    """The same bug in each train script's copy (train_grpo.py, train_ppo.py); `tests` as node ids
    with {script} for grpo or ppo."""
    return [
        Mutation(
            f"{name}[{s}]",
            bug,
            f"train_{s}.py",
            old,
            new,
            tuple(t.format(script=s) for t in tests),
            function,
            slow,
        )
        for s in ("grpo", "ppo")
    ]


SHARED = "tests/test_shared_math.py::"
UPDATE = "tests/test_update.py::"
GRPO = "tests/test_grpo_math.py::"
PPO = "tests/test_ppo_math.py::"
TWO_RANKS = UPDATE + "test_two_ranks_take_the_steps_of_one_rank_on_all_the_samples"
HAND = UPDATE + "test_update_actor_gradient_equals_the_loss_written_out[{script}]"
KL_STEP = (
    UPDATE + "test_a_step_on_the_kl_term_alone_moves_the_policy_toward_the_reference[{script}]"
)
CRITIC_HAND = UPDATE + "test_update_critic_gradient_equals_the_value_loss_written_out"
E2E_GRPO = "tests/test_train_grpo.py::test_two_steps_log_every_metric_and_change_the_policy"
E2E_PPO = "tests/test_train_ppo.py::test_two_steps_log_every_metric_and_change_actor_and_critic"

MUTATIONS = [
    # --- GRPO's advantage ---
    Mutation(
        "grpo-advantage-batch-mean",
        "the baseline is the batch's mean score instead of the group's",
        "train_grpo.py",
        "adv = grouped - grouped.mean(-1, keepdim=True)",
        "adv = grouped - grouped.mean()",
        (GRPO + "test_groups_are_consecutive_rows_and_equal_scores_give_zero",),
    ),
    Mutation(
        "grpo-advantage-biased-std",
        "the group's std without Bessel's correction (verl divides by n - 1)",
        "train_grpo.py",
        "adv = adv / (grouped.std(-1, keepdim=True) + eps)",
        "adv = adv / (grouped.std(-1, keepdim=True, correction=0) + eps)",
        (GRPO + "test_grpo_advantage_group_of_three",),
    ),
    # --- the math both scripts copy ---
    *both(
        "agg-token-mean-local",
        "token-mean divides by this micro-batch's tokens, not the mini-batch's over all ranks",
        "return masked.sum() / num_tokens",
        "return masked.sum() / response_mask.sum()",
        (SHARED + "test_agg_loss_by_hand[{script}-token-mean]",),
    ),
    *both(
        "agg-seq-mean-token-mean-local",
        "seq-mean-token-mean averages this micro-batch's sequences, not the mini-batch's",
        "return (masked.sum(-1) / response_mask.sum(-1).clamp(min=1)).sum() / num_seqs",
        "return (masked.sum(-1) / response_mask.sum(-1).clamp(min=1)).mean()",
        (SHARED + "test_agg_loss_by_hand[{script}-seq-mean-token-mean]",),
    ),
    *both(
        "agg-sum-norm-padded-length",
        "Dr.GRPO's seq-mean-token-sum-norm divides by the padded length, not max_response_length",
        "return masked.sum() / (num_seqs * max_response_length)",
        "return masked.sum() / (num_seqs * response_mask.shape[-1])",
        (SHARED + "test_agg_loss_by_hand[{script}-seq-mean-token-sum-norm]",),
    ),
    *both(
        "surrogate-max-for-min",
        "the clipped surrogate takes the max of the two terms: the pessimistic bound is lost",
        "surrogate = torch.min(ratio * advantages, clipped_ratio * advantages)",
        "surrogate = torch.max(ratio * advantages, clipped_ratio * advantages)",
        (SHARED + "test_policy_loss_clip_and_dual_clip_by_hand[{script}]",),
    ),
    *both(
        "ratio-inverted",
        "the ratio pi_old / pi instead of pi / pi_old",
        "log_ratio = (log_probs - old_log_probs).clamp(-20.0, 20.0)",
        "log_ratio = (old_log_probs - log_probs).clamp(-20.0, 20.0)",
        (SHARED + "test_policy_loss_clip_and_dual_clip_by_hand[{script}]",),
    ),
    *both(
        "clip-bounds-swapped",
        "clip-higher's bounds swapped: 1 - eps_high below, 1 + eps_low above",
        "clipped_ratio = ratio.clamp(1 - clip_ratio_low, 1 + clip_ratio_high)",
        "clipped_ratio = ratio.clamp(1 - clip_ratio_high, 1 + clip_ratio_low)",
        (SHARED + "test_clip_higher_uses_asymmetric_bounds[{script}]",),
    ),
    *both(
        "dual-clip-min",
        "the dual clip takes the min: a bad token's huge ratio is no longer capped",
        "dual = torch.max(surrogate, clip_ratio_c * advantages)",
        "dual = torch.min(surrogate, clip_ratio_c * advantages)",
        (SHARED + "test_dual_clip_caps_huge_ratio_at_c_times_advantage[{script}]",),
    ),
    *both(
        "dual-clip-positive-advantages",
        "the dual clip applied to positive advantages instead of negative ones",
        "objective = torch.where(advantages < 0, dual, surrogate)",
        "objective = torch.where(advantages > 0, dual, surrogate)",
        (SHARED + "test_policy_loss_clip_and_dual_clip_by_hand[{script}]",),
    ),
    *both(
        "is-weights-ignored",
        "--rollout_is weights computed but never applied to the loss",
        "pg_losses = -objective if is_weights is None else -objective * is_weights",
        "pg_losses = -objective",
        (SHARED + "test_policy_loss_with_is_weights_scales_each_tokens_loss[{script}]",),
    ),
    *both(
        "k3-ratio-inverted",
        "k3 with the ratio inverted: pi / pi_ref - 1 - log(pi / pi_ref)",
        "neg = (-log_ratio).clamp(-20.0, 20.0)",
        "neg = log_ratio.clamp(-20.0, 20.0)",
        (SHARED + "test_kl_estimators_by_hand[{script}-k3]",),
    ),
    *both(
        "k2-without-half",
        "k2 (mse) without its 1/2",
        "return 0.5 * log_ratio.square()",
        "return log_ratio.square()",
        (SHARED + "test_kl_estimators_by_hand[{script}-k2]",),
    ),
    *both(
        "score-on-first-token",
        "the score placed on the first response token instead of the last",
        "last = (response_mask.sum(-1).long() - 1).clamp(min=0)",
        "last = torch.zeros(len(scores), dtype=torch.long)",
        (SHARED + "test_each_score_sits_on_its_responses_last_token[{script}]",),
    ),
    # --- the updates ---
    *both(
        "kl-loss-sign",
        "the KL loss subtracted: the policy is pushed away from the reference",
        "loss = loss + args.kl_loss_coef * kl_loss",
        "loss = loss - args.kl_loss_coef * kl_loss",
        (HAND, KL_STEP),
        "update_actor",
    ),
    *both(
        "entropy-bonus-sign",
        "the entropy bonus added to the loss: entropy is penalised",
        "loss = loss - args.entropy_coeff * agg_loss(entropy, mask, *agg)",
        "loss = loss + args.entropy_coeff * agg_loss(entropy, mask, *agg)",
        (HAND,),
        "update_actor",
    ),
    *both(
        "loss-not-times-world",
        "the loss not multiplied by the world size: FSDP2's average halves the gradient on 2 ranks",
        "(loss * world).backward()",
        "loss.backward()",
        (TWO_RANKS,),
        "update_actor",
    ),
    *both(
        "tokens-on-one-rank",
        "the mini-batch's token count taken on this rank instead of summed over ranks",
        "tokens = sharding.all_sum(response_mask[start:stop].sum().item(), device=device)[0]",
        "tokens = response_mask[start:stop].sum().item()",
        (TWO_RANKS,),
        "update_actor",
    ),
    *both(
        "sequences-on-one-rank",
        "the mini-batch's sequence count taken on this rank (seq-mean-* modes)",
        "agg = args.loss_agg_mode, tokens, (stop - start) * world, args.max_response_length",
        "agg = args.loss_agg_mode, tokens, stop - start, args.max_response_length",
        (TWO_RANKS,),
        "update_actor",
    ),
    *both(
        "mini-batch-not-per-rank",
        "the mini-batch's size not divided by the world size: half the optimizer steps on 2 ranks",
        "mini = args.ppo_mini_batch_size * args.rollout_n // world",
        "mini = args.ppo_mini_batch_size * args.rollout_n",
        (TWO_RANKS,),
        "update_actor",
    ),
    Mutation(
        "critic-loss-not-times-world",
        "the critic's loss not multiplied by the world size",
        "train_ppo.py",
        "(loss * world).backward()",
        "loss.backward()",
        (TWO_RANKS,),
        "update_critic",
    ),
    Mutation(
        "critic-tokens-on-one-rank",
        "the critic's token count taken on this rank",
        "train_ppo.py",
        "tokens = sharding.all_sum(response_mask[start:stop].sum().item(), device=device)[0]",
        "tokens = response_mask[start:stop].sum().item()",
        (TWO_RANKS,),
        "update_critic",
    ),
    Mutation(
        "critic-value-coef-ignored",
        "--vf_coef not applied to the critic's loss",
        "train_ppo.py",
        "loss = args.vf_coef * vf_loss",
        "loss = vf_loss",
        (CRITIC_HAND,),
        "update_critic",
    ),
    # --- PPO's advantages, values and KL controller ---
    Mutation(
        "gae-without-gamma",
        "GAE's recursion drops gamma: A_t = delta_t + lam A_t+1",
        "train_ppo.py",
        "next_adv = m * (delta + gamma * lam * next_adv) + (1 - m) * next_adv",
        "next_adv = m * (delta + lam * next_adv) + (1 - m) * next_adv",
        (PPO + "test_gae_by_hand_gamma_09_lam_095",),
    ),
    Mutation(
        "gae-delta-sign",
        "GAE's TD error adds V_t instead of subtracting it",
        "train_ppo.py",
        "delta = token_level_rewards[:, t] + gamma * next_values - values[:, t]",
        "delta = token_level_rewards[:, t] + gamma * next_values + values[:, t]",
        (PPO + "test_gae_by_hand_gamma_lam_one",),
    ),
    Mutation(
        "gae-padding-leaks",
        "GAE bootstraps from the padding's values past a response's end",
        "train_ppo.py",
        "next_values = m * values[:, t] + (1 - m) * next_values",
        "next_values = values[:, t]",
        (PPO + "test_gae_ignores_whatever_the_padding_holds",),
    ),
    Mutation(
        "whiten-over-padding",
        "the advantages whitened over the padding too",
        "train_ppo.py",
        "valid = advantages[response_mask.bool()]",
        "valid = advantages.flatten()",
        (PPO + "test_whitened_advantages_have_mean_0_var_1_over_valid_tokens",),
    ),
    Mutation(
        "value-loss-min",
        "the clipped value loss takes the min of its two terms: optimistic, not pessimistic",
        "train_ppo.py",
        "return 0.5 * torch.max(vf_losses1, vf_losses2), {",
        "return 0.5 * torch.min(vf_losses1, vf_losses2), {",
        (PPO + "test_value_loss_clip_by_hand",),
    ),
    Mutation(
        "value-clip-around-returns",
        "the new value clipped around the returns instead of the old value",
        "train_ppo.py",
        "vpredclipped = values + (vpreds - values).clamp(-cliprange_value, cliprange_value)",
        "vpredclipped = returns + (vpreds - returns).clamp(-cliprange_value, cliprange_value)",
        (PPO + "test_value_loss_clip_by_hand",),
    ),
    Mutation(
        "explained-variance-of-values",
        "explained variance from Var[values] instead of Var[returns - values]",
        "train_ppo.py",
        "return (1 - (returns - values)[mask].var() / (returns[mask].var() + 1e-5)).item()",
        "return (1 - values[mask].var() / (returns[mask].var() + 1e-5)).item()",
        (PPO + "test_explained_variance_by_hand",),
    ),
    Mutation(
        "adaptive-kl-backwards",
        "the adaptive KL controller raises beta when the KL is below target",
        "train_ppo.py",
        "proportional_error = min(max(current_kl / target - 1, -0.2), 0.2)",
        "proportional_error = min(max(1 - current_kl / target, -0.2), 0.2)",
        (PPO + "test_adaptive_kl_coef_by_hand",),
    ),
    Mutation(
        "kl-in-reward-sign",
        "the KL penalty added to the reward instead of subtracted",
        "train_ppo.py",
        "return token_level_scores - beta * kl, current_kl",
        "return token_level_scores + beta * kl, current_kl",
        (PPO + "test_apply_kl_penalty_by_hand",),
    ),
    # --- the passes, the push, the checkpoint, the schedule ---
    Mutation(
        "packed-logits-off-by-one",
        "packed sequences read each response token's log-prob one position late",
        "passes.py",
        "keep += range(len(ids) + len(p) - 1, len(ids) + len(p) + len(r) - 1)",
        "keep += range(len(ids) + len(p), len(ids) + len(p) + len(r))",
        ("tests/test_sharding.py::test_packed_log_probs_equal_padded_and_a_loop",),
    ),
    Mutation(
        "micro-batches-drop-a-sequence",
        "token-budget micro-batches leave the shortest sequence out",
        "passes.py",
        "for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):",
        "for i in sorted(range(len(lengths)), key=lambda i: -lengths[i])[:-1]:",
        ("tests/test_sharding.py::test_micro_batches_by_count_and_by_token_budget",),
    ),
    Mutation(
        "push-skips-the-last-tensor",
        "the push streams every parameter but the last (model.norm.weight of a tied model)",
        "sharding.py",
        "for name, param in model.named_parameters():",
        "for name, param in list(model.named_parameters())[:-1]:",
        ("tests/test_engine.py::test_a_push_of_the_trainers_full_tensors_reaches_every_parameter",),
        "iter_full_tensors",
    ),
    Mutation(
        "engine-accepts-a-partial-push",
        "the engine loads what it is given without counting it",
        "rollout.py",
        "    if not (missing or unknown):\n        return\n",
        "    return\n",
        (
            "tests/test_engine.py::"
            "test_hf_engine_holds_exactly_the_pushed_tensors_and_refuses_a_partial_push",
        ),
        "check_push",
    ),
    Mutation(
        "logprob-gap-signed",
        "the engine/trainer log-prob gap averages signed differences, which cancel",
        "rollout.py",
        "return (log_probs - rollout_log_probs).abs()[mask].mean().item()",
        "return (log_probs - rollout_log_probs)[mask].mean().item()",
        ("tests/test_engine.py::test_logprob_gap_by_hand",),
    ),
    Mutation(
        "checkpoint-without-optimizer",
        "checkpoints leave AdamW's state out: a resumed run restarts its moments",
        "checkpoint.py",
        "for k, opt in (optimizers or {}).items():",
        "for k, opt in {}.items():",
        ("tests/test_engine.py::test_checkpoint_saved_by_2_ranks_resumes_on_1",),
        "save_checkpoint",
    ),
    Mutation(
        "warmup-off-by-one",
        "the learning rate's warmup starts at 0 (step / warmup instead of (step + 1) / warmup)",
        "run.py",
        "return (step + 1) / warmup",
        "return step / warmup",
        ("tests/test_run.py::test_lr_lambda_warmup_then_cosine",),
    ),
    Mutation(
        "rollout-is-not-truncated",
        "--rollout_is weights not truncated at --rollout_is_threshold",
        "batches.py",
        "return rho.clamp(max=threshold).detach(), rho.detach()",
        "return rho.detach(), rho.detach()",
        (PPO + "test_rollout_is_weights_and_the_weighted_policy_loss_by_hand",),
    ),
    Mutation(
        "gsm8k-strict-without-space",
        "GSM8K's strict answer accepted without the space after ####",
        "reward.py",
        '_STRICT = re.compile("#### (\\\\-?[0-9\\\\.\\\\,]+)")',
        '_STRICT = re.compile("#### ?(\\\\-?[0-9\\\\.\\\\,]+)")',
        ("tests/test_reward.py::test_gsm8k_table",),
    ),
    Mutation(
        "planner-adamw-4-bytes",
        "the memory planner counts AdamW's two moments as 4 bytes a parameter instead of 8",
        "memory.py",
        "return 8 * self.params / world",
        "return 4 * self.params / world",
        ("tests/test_memory.py::test_a_plan_by_hand",),
    ),
    Mutation(
        "helper-at-the-policys-shape",
        "the compiling helper's memory counts every model at the policy's shape",
        "compile_ahead.py",
        "own = shapes.Shape.of(shapes.config_of(spec.path))",
        "own = shape",
        ("tests/test_memory.py::test_the_helper_counts_each_model_at_its_own_shape",),
    ),
    Mutation(
        "planner-ignores-sequences",
        "without --use_dynamic_bsz the planner fits token budgets the run never uses",
        "memory.py",
        "sequences=None if args.use_dynamic_bsz else micro_batch_sequences(args, specs),",
        "sequences=None,",
        ("tests/test_memory.py::test_a_run_given_sequences_per_micro_batch_is_planned_at_them",),
    ),
    # --- the loop (each train script's main), which only the end-to-end runs exercise ---
    Mutation(
        "scheduler-not-stepped",
        "GRPO's learning-rate schedule never advances: warmup stays at its first step",
        "train_grpo.py",
        "                scheduler.step()\n",
        "",
        (E2E_GRPO + "[hf_run]",),
        slow=True,
    ),
    Mutation(
        "weights-not-pushed",
        "GRPO's phase 6 forgotten: the engine samples from the starting weights every step",
        "train_grpo.py",
        "            source.push_weights(timer)\n",
        "",
        (E2E_GRPO + "[vllm_run]",),
        slow=True,
    ),
    Mutation(
        "ppo-scheduler-not-stepped",
        "PPO's actor schedule never advances",
        "train_ppo.py",
        "                    scheduler.step()\n",
        "",
        (E2E_PPO + "[hf_run]",),
        slow=True,
    ),
]


def source_of(text, function):
    """The text of the top-level function `function` in a module's source (to its next top-level
    statement), and where it starts."""
    start = text.index(f"\ndef {function}(") + 1
    end = start + 1
    while True:
        end = text.find("\n", end)
        if end < 0 or end + 1 >= len(text):
            return start, len(text)
        following = text[end + 1 : end + 2]
        if following not in ("", " ", "\n", ")"):  # the next top-level line
            return start, end + 1
        end += 1


def apply(text, m):
    """`text` with the mutation made; ValueError when its text is not there exactly once."""
    lo, hi = source_of(text, m.function) if m.function else (0, len(text))
    where = text[lo:hi]
    if where.count(m.old) != 1:
        scope = f" in {m.function}()" if m.function else ""
        times = where.count(m.old)
        raise ValueError(f"{m.name}: {m.old!r} occurs {times} times in {m.path}{scope}")
    return text[:lo] + where.replace(m.old, m.new) + text[hi:]


def copy_tree(dest):
    """The files git tracks, and those it would (untracked, not ignored), into `dest`."""
    files = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard", "-z"],
        cwd=ROOT,
        capture_output=True,
        check=True,
    ).stdout.split(b"\0")
    for f in filter(None, (f.decode() for f in files)):
        if (ROOT / f).is_file():
            (dest / f).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / f, dest / f)


def pytest(tree, tests, timeout):
    """Run `tests` in `tree`; returns (exit code, seconds, the output's last lines)."""
    env = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1"}
    cmd = [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", *tests]
    t0 = time.time()
    try:
        proc = subprocess.run(
            cmd, cwd=tree, env=env, capture_output=True, text=True, timeout=timeout
        )
        code, out = proc.returncode, proc.stdout + proc.stderr
    except subprocess.TimeoutExpired:
        code, out = -1, "timed out"
    return code, time.time() - t0, "\n".join(out.splitlines()[-15:])


def verdict(code):
    """A mutation's tests' exit code, read: 1 (a test failed) or 2 (an import or collection error)
    catch it; 0 misses it; 4 and 5 mean the test ids are wrong."""
    return {0: "MISSED", 1: "caught", 2: "caught (collection)", -1: "TIMEOUT"}.get(
        code, f"bad test ids (pytest exit {code})"
    )


def run(mutations, jobs, timeout):
    """Each mutation in one of `jobs` copies of the tree; prints a row as each ends; returns the
    rows (mutation, verdict, seconds)."""
    tmp = Path(tempfile.mkdtemp(prefix="mutations_"))
    trees = [tmp / f"tree{i}" for i in range(jobs)]
    for tree in trees:
        copy_tree(tree)
    everything = sorted({t for m in mutations for t in m.tests})
    print(f"the tests as they are ({len(everything)}), in a copy of the tree ...", flush=True)
    code, seconds, tail = pytest(trees[0], everything, timeout * 2)
    if code != 0:
        shutil.rmtree(tmp, ignore_errors=True)
        sys.exit(f"these tests fail without any mutation (exit {code}), fix them first:\n{tail}")
    print(f"  they pass ({seconds:.0f} s)\n", flush=True)
    free = list(trees)

    def one(m):
        tree = free.pop()
        try:
            path = tree / m.path
            original = path.read_text()
            path.write_text(apply(original, m))
            try:
                code, seconds, tail = pytest(tree, m.tests, timeout)
            finally:
                path.write_text(original)
        finally:
            free.append(tree)
        row = (m, verdict(code), seconds)
        print(f"{row[1]:>10}  {seconds:5.0f} s  {m.name}: {m.bug}", flush=True)
        if code not in (1, 2):
            print("            " + tail.replace("\n", "\n            "), flush=True)
        return row

    with ThreadPoolExecutor(jobs) as pool:
        rows = list(pool.map(one, mutations))
    shutil.rmtree(tmp, ignore_errors=True)
    return rows


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("names", nargs="*", help="run these mutations only")
    parser.add_argument("--all", action="store_true", help="the slow tier too (end-to-end runs)")
    parser.add_argument("--list", action="store_true", help="list the mutations and their tests")
    parser.add_argument("--jobs", type=int, default=2, help="copies of the tree run at once")
    parser.add_argument("--timeout", type=int, default=900, help="seconds per mutation's tests")
    args = parser.parse_args(argv)
    chosen = [m for m in MUTATIONS if m.name in args.names] if args.names else MUTATIONS
    unknown = set(args.names) - {m.name for m in MUTATIONS}
    if unknown:
        sys.exit(f"no mutation named {', '.join(sorted(unknown))} (--list names them)")
    if not (args.all or args.names):
        chosen = [m for m in chosen if not m.slow]
    if args.list:
        for m in chosen:
            tier = "slow" if m.slow else "fast"
            print(f"{m.name} ({tier}, {m.path}): {m.bug}\n    " + "\n    ".join(m.tests))
        return 0
    t0 = time.time()
    rows = run(chosen, args.jobs, args.timeout)
    missed = [m.name for m, v, _ in rows if not v.startswith("caught")]
    caught = len(rows) - len(missed)
    print(f"\n{caught} of {len(rows)} mutations caught in {(time.time() - t0) / 60:.1f} minutes")
    if missed:
        print("not caught: " + ", ".join(missed))
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main())
