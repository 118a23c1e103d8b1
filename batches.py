"""A step's batch, what phases 1 and 2 of a train script (generate, score) hand on; validation.

`Batches.next(step, timer)` returns the step's `Batch`: B groups of n scored responses, the same on
every rank, and this rank's share of them as tensors (its sequences, their response mask, scores
and the engine's own log-probs). `Batches.push_weights(timer)` is phase 6, the updated policy into
the engine. Behind these two calls sit the options that change how a batch is made, not the
algorithm that trains on it:
- DAPO's dynamic sampling (Yu et al. 2025, `--filter_groups`): groups whose responses all scored
  alike carry no advantage, so they are dropped and more prompts generated, in rounds, until B
  groups vary;
- GRESO's selective rollout (Zheng et al. 2025, `--skip_all_equal`): skip, before generating, a
  prompt whose latest groups were all-equal (the filter would likely drop it again);
- one-step off-policy generation (`--one_step_off_policy`, verl's recipe): the next step's batch is
  generated in a second thread while this one trains, with the weights from before its update.
`importance_weights` corrects the update for the engine's sampling distribution (`--rollout_is`);
`validate` scores greedy (or sampled) responses to the validation prompts, with their dumps.
"""

import concurrent.futures
import json
import math
import os
import random
import time
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

import reward
from data.dataset import PromptOrder
from passes import response_targets
from rollout import exclusive_tracing, group_share, logprob_gap, turn_to_generate
from sharding import all_sum, gather_objects, iter_full_tensors


@dataclass
class Batch:
    """A step's batch. `groups` (all ranks', in order): per prompt a dict of example, samples
    (rollout.Sample), texts, scores, flexible (GSM8K's last-number score, NaN elsewhere) and the
    reward function's numeric extras. The rest is this rank's share, on the device."""

    groups: list
    # rounds, prompts generated, all-equal / unsolved / solved groups, tokens, errors, skips
    counts: dict
    epoch: int
    seconds: float  # the generation's own time (beside the training with one_step_off_policy)
    samples: list  # (prompt_ids, response_ids) of this rank's N/world sequences
    response_mask: torch.Tensor  # (N/world, T)
    scores: torch.Tensor  # (N/world,)
    # (rows checked, T): what the engine reported for the sampled tokens
    rollout_log_probs: torch.Tensor
    checked: list  # the rows of `samples` the engine reported them for


def score(examples, outs, n, tokenizer, reward_fn, args):
    """Decode the n responses of each example and score them: (texts, scores, flexible, extras,
    n_errors), one entry per response. flexible is GSM8K's last-number score (NaN for a data source
    without a built-in scorer), the reward function's extras and errors as reward.score_batch's."""
    texts = tokenizer.batch_decode(
        [s.token_ids for out in outs for s in out], skip_special_tokens=True
    )
    sources = [e.data_source for e in examples for _ in range(n)]
    truths = [e.ground_truth for e in examples for _ in range(n)]
    infos = [e.extra_info for e in examples for _ in range(n)]
    scores, extras, n_errors = reward.score_batch(
        reward_fn, sources, texts, truths, infos, args.reward_errors
    )
    flexible = [
        reward.compute_score(s, t, g, i, method="flexible") if s in reward.SCORERS else float("nan")
        for s, t, g, i in zip(sources, texts, truths, infos)
    ]
    return texts, scores, flexible, extras, n_errors


def rollout(engine, examples, args, tokenizer, reward_fn, seed, n, temperature, group=None):
    """Generate n responses per prompt and score them; returns the groups of all ranks, in order.

    Each tensor-parallel group generates its share of `examples` (the same list on every rank);
    each rank decodes and scores its own slice, then all slices are gathered, so every rank
    holds the whole batch, in the global order, and computes identical batch statistics.
    """
    rank, world = dist.get_rank(), dist.get_world_size()
    mine, my_slice = group_share(examples, rank, world, engine.tp)
    per_rank, k = len(examples) // world, args.logprob_check_prompts
    # the first k prompts of each rank's share; all of them when the update weighs by the engine's
    # log-probs
    check = [args.rollout_is is not None or k < 0 or i % per_rank < k for i in range(len(mine))]
    outs = engine.generate(
        [e.prompt_ids for e in mine],
        n=n,
        temperature=temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        max_tokens=args.max_response_length,
        seed=seed,
        logprobs=check,
    )
    mine, outs = mine[my_slice], outs[my_slice]
    texts, scores, flexible, extras, n_errors = score(mine, outs, n, tokenizer, reward_fn, args)
    groups = []
    for i, (e, out) in enumerate(zip(mine, outs)):
        k = slice(i * n, (i + 1) * n)
        groups.append(
            dict(
                example=e,
                samples=out,
                texts=texts[k],
                scores=scores[k],
                flexible=flexible[k],
                extras={key: v[k] for key, v in extras.items()},
            )
        )
    gathered = gather_objects((groups, n_errors), group)
    return [g for gs, _ in gathered for g in gs], sum(e for _, e in gathered)


def round_size(missing, kept, generated, G, world):
    """Prompts a --filter_groups generation round generates, of the G it looks at.

    The whole batch while nothing has been kept this step (the first round, or rounds that kept
    nothing). After that, enough prompts for the `missing` groups at the share of groups kept so
    far, 20% over, rounded up to a multiple of the ranks: generating the whole batch would only make
    groups that are dropped once the step has its train_batch_size. The rest stay next in the
    epoch's order (PromptOrder). Example: 26 groups missing after 230 of 512 were kept: 26 * 512
    / 230 * 1.2 = 69.5, so 70 prompts.
    """
    if kept == 0:
        return G
    k = -(-missing * generated * 6 // (kept * 5))  # ceil(missing / (kept / generated) * 1.2)
    return min(G, -(-k // world) * world)


def selective_rollout(indices, streak, explore, seed, world):
    """GRESO's pre-rollout skip (Zheng et al. 2025): the prompts of `indices` to generate.

    A prompt whose last z groups in a row scored all-equal (`streak[i]` = z) is kept with
    probability explore**z, any other always; the draw is seeded, so every rank keeps the same
    prompts. The kept ones are cut to a multiple of the ranks (each generates an equal share), in
    their order. Example: streaks [0, 1, 2] with explore 0.5 keep the first always, the second half
    the time and the third a quarter of the time.
    """
    draw = random.Random(seed)
    kept = [i for i in indices if streak[i] == 0 or draw.random() < explore ** streak[i]]
    return kept[: len(kept) // world * world]


class Batches:
    """Each step's batch from the training prompts of `run` (a run.Run), in the order
    `data.dataset.PromptOrder` keeps (resumed from a checkpoint's trainer state `state`), generated
    by `engine` and scored by the run's reward function. The engine sleeps while the step trains;
    `push_weights` hands it the updated policy (`actor`'s). The extras of the module's docstring
    follow their flags (flags.RunArgs), all off by default."""

    def __init__(self, run, engine, actor, state):
        args, self.run, self.engine, self.actor, self.args = run.args, run, engine, actor, run.args
        self.train, self.device, self.n = run.train, run.device, args.rollout_n
        self.G = args.gen_batch_size or args.train_batch_size  # prompts per generation round
        # checkpoints before the cursor counted whole rounds of their --gen_batch_size
        offset = state.get(
            "data_offset",
            state.get("batch_idx", 0) * state.get("gen_batch_size", args.train_batch_size),
        )
        self.order = PromptOrder(len(self.train), args.seed, state.get("epoch", 0), offset)
        # per train prompt: how many of its latest groups in a row scored all-equal on filtering
        # steps
        self.streak = [0] * len(self.train)
        # JSON made the prompt indices strings
        for i, z in state.get("all_equal_streak", {}).items():
            if int(i) < len(self.streak):  # (--train_files may have changed since)
                self.streak[int(i)] = z
        # one_step_off_policy: the batch of step k+1 is generated, in a second thread, while step k
        # trains. The engine then holds the weights from before step k's update; they are pushed
        # once that batch is done (`stale` until then), so each batch is trained on one update after
        # the weights that sampled it.
        self.overlap, self.pool = args.one_step_off_policy, None
        # (CUDA's current device is per thread: the second one would start on GPU 0)
        if self.overlap:
            cuda = run.device.type == "cuda"
            init = (torch.cuda.set_device, (run.device,)) if cuda else (None, ())
            self.pool = concurrent.futures.ThreadPoolExecutor(1, "rollout", *init)
            # the trainer's compiles and that thread's generations take turns (rollout.py)
            if engine.in_process:
                exclusive_tracing()
        # that thread gathers the ranks' groups over a group of its own: the trainer's collectives
        # run meanwhile
        self.gen_group = dist.new_group(backend="gloo") if self.overlap else None
        # the next batch; the data position before it
        self.pending, self.stale, self.drawn_from = None, False, None
        self.push_dtype = torch.bfloat16 if run.device.type == "cuda" else torch.float32

    def next(self, step, timer):
        """Step `step`'s batch (phases 1 and 2, timed as "gen"), the engine asleep afterwards; with
        one_step_off_policy the batch generated during the last step, and the next one started with
        this step's weights."""
        # with one_step_off_policy: the wait for the batch generated during the last step
        with timer("gen"):
            batch = self.pending.result() if self.pending else self.generate(step)
            self.pending = None
        if self.overlap:
            if self.stale:  # the engine is idle now: the last update's weights go in
                with timer("update_weights"):
                    self._push()
                self.stale = False
            # and generate the next batch with them while this one trains
            if step < self.run.total_steps:
                self.drawn_from = self.position()
                # the push's copies are done before the other thread reads them
                if self.device.type == "cuda":
                    torch.cuda.synchronize()
                self.pending = self.pool.submit(self._generate_beside, step + 1)
        else:
            self.engine.sleep()
        # the responses this step trains on, as text
        if self.args.rollout_data_dir and dist.get_rank() == 0:
            dump_generations(
                self.args.rollout_data_dir,
                str(step),
                generation_rows(batch["groups"], self.run.tokenizer, step),
            )
        return self.share(batch)

    def push_weights(self, timer):
        """Phase 6: FSDP2 shards -> full tensors -> the engine's loaders (with one_step_off_policy
        once the engine has generated the next batch: at the next step's start)."""
        if self.overlap:
            self.stale = True
            return
        with timer("update_weights"):
            self._push()

    def settle(self, metrics, timer):
        """Before a validation: the engine idle and holding this step's weights. With
        one_step_off_policy, the wait for the batch in flight and the push count as this step's."""
        if not self.overlap:
            return
        before = dict(metrics)
        with timer("gen"):
            if self.pending:
                self.pending.result()
        if self.stale:
            with timer("update_weights"):
                self._push()
            self.stale = False
        metrics["timing_s/step"] += sum(
            metrics[k] - before.get(k, 0.0)
            for k in ("timing_s/gen", "timing_s/update_weights")
            if k in metrics
        )

    def position(self):
        """Where the data stands, for a checkpoint: a resume draws the next prompts from there (with
        a batch in flight, from before it: the resumed run generates it again)."""
        if self.pending:
            return self.drawn_from
        return {
            "epoch": self.order.epoch,
            "data_offset": self.order.offset,
            "all_equal_streak": {i: z for i, z in enumerate(self.streak) if z},
        }

    def close(self, wait=True):
        """A batch still generating ends before the engine does; or, `wait` false (a stop, its
        checkpoint written), is left to end with the process."""
        if self.pool:
            self.pool.shutdown(wait=wait, cancel_futures=not wait)

    def _push(self):
        self.engine.update_weights(
            iter_full_tensors(self.actor, dtype=self.push_dtype, device=self.device)
        )

    def _generate_beside(self, step):
        with turn_to_generate(self.engine):
            return self.generate(step)

    def generate(self, step):
        """B groups of n scored responses, in generation rounds until B groups are kept (when
        filtering, only groups whose scores vary), and the rollout counts. With one_step_off_policy
        it runs in the second thread, beside the previous step's training."""
        args, order, streak, B, n = (
            self.args,
            self.order,
            self.streak,
            self.args.train_batch_size,
            self.n,
        )
        world = dist.get_world_size()
        t0 = time.perf_counter()
        groups, rounds = [], 0
        names = "n_errors n_prompts n_all_equal n_none n_all gen_tokens n_drawn n_skipped"
        c = dict.fromkeys(names.split(), 0)
        filtering = args.filter_groups and step >= args.filter_groups_from_step
        while len(groups) < B:
            rounds += 1
            look = order.peek(self.G if filtering else B)  # the next prompts of the epoch
            kept = look
            if filtering and args.skip_all_equal:  # skip what the filter would likely drop
                seed = hash((args.seed, step, rounds)) % 2**31
                kept = selective_rollout(look, streak, args.skip_explore_prob, seed, world)
            # the rounds after the first generate only what the step still needs; the round moves
            # past the prompts it used: all it looked at, or, when it generates only some, up to the
            # last of those
            indices = (
                kept[: round_size(B - len(groups), len(groups), c["n_prompts"], self.G, world)]
                if filtering
                else kept
            )
            pos = {i: j for j, i in enumerate(look)}
            used = len(look) if len(indices) == len(kept) else pos[indices[-1]] + 1
            order.advance(used)
            c["n_drawn"] += used
            c["n_skipped"] += used - sum(pos[i] < used for i in kept)
            c["n_prompts"] += len(indices)
            new, errs = (
                rollout(
                    self.engine,
                    [self.train[i] for i in indices],
                    args,
                    self.run.tokenizer,
                    self.run.reward_fn,
                    seed=hash((args.seed, step, rounds, self.engine.dp_rank)) % 2**31,
                    n=n,
                    temperature=args.temperature,
                    group=self.gen_group,
                )
                if indices
                else ([], 0)
            )
            c["n_errors"] += errs
            # kept or not
            c["gen_tokens"] += sum(len(s.token_ids) for g in new for s in g["samples"])
            equal = [len(set(g["scores"])) == 1 for g in new]  # zero advantage: nothing to learn
            c["n_all_equal"] += sum(equal)
            # too hard for the policy, for now
            c["n_none"] += sum(max(g["scores"]) <= 0 for g in new)
            c["n_all"] += sum(min(g["scores"]) >= 1 for g in new)  # learned
            if filtering:  # DAPO's dynamic sampling: keep the others, generate more
                # each prompt's all-equal streak, for skip_all_equal
                for i, e in zip(indices, equal):
                    streak[i] = streak[i] + 1 if e else 0
                new = [g for g, e in zip(new, equal) if not e]
                if 0 < args.max_num_gen_batches <= rounds and len(groups) + len(new) < B:
                    raise RuntimeError(
                        f"step {step}: --filter_groups kept {len(groups) + len(new)} of {B} groups "
                        f"after {rounds} generation rounds (--max_num_gen_batches); all-equal "
                        "scores dominate: check the reward, raise --rollout_n or "
                        "--max_num_gen_batches, or start filtering once the reward varies "
                        "(--filter_groups_from_step)"
                    )
            groups += new
        return dict(
            groups=groups[:B],
            counts=c | {"rounds": rounds},
            epoch=order.epoch,
            seconds=time.perf_counter() - t0,
        )

    def share(self, batch):
        """The Batch, with this rank's share of its groups as tensors on the device."""
        rank, world, device = dist.get_rank(), dist.get_world_size(), self.device
        per_rank = self.args.train_batch_size // world
        mine = batch["groups"][rank * per_rank : (rank + 1) * per_rank]
        # N/world
        samples = [(g["example"].prompt_ids, s.token_ids) for g in mine for s in g["samples"]]
        T = max(max(len(r) for _, r in samples), 1)
        _, response_mask = response_targets(samples, T, device)  # (N/world, T)
        # the engine's own log-probs of the sampled tokens, for the sync check (rows `checked`; all
        # with rollout_is)
        sampled = [s for g in mine for s in g["samples"]]
        checked = [i for i, s in enumerate(sampled) if s.logprobs is not None]
        rollout_log_probs = torch.tensor(
            [s.logprobs + [0.0] * (T - len(s.logprobs)) for s in sampled if s.logprobs is not None],
            device=device,
        ).reshape(len(checked), T)
        scores = torch.tensor([s for g in mine for s in g["scores"]], device=device)  # (N/world,)
        return Batch(
            batch["groups"],
            batch["counts"],
            batch["epoch"],
            batch["seconds"],
            samples,
            response_mask,
            scores,
            rollout_log_probs,
            checked,
        )


def batch_metrics(batch, old_log_probs, gen_seconds):
    """The metrics of a step's batch, as verl names them: scores, response and prompt lengths, the
    sync check (the engine's log-probs against the trainer's, `rollout/logprob_gap_mean`), reward
    errors, the generation's rate and the reward function's extras."""
    groups = batch.groups
    n = len(groups[0]["samples"])
    lengths = torch.tensor(
        [len(s.token_ids) for g in groups for s in g["samples"]], dtype=torch.float
    )
    all_scores = torch.tensor([s for g in groups for s in g["scores"]])
    prompt_tokens = sum(len(g["example"].prompt_ids) for g in groups) * n
    metrics = {
        "critic/score/mean": all_scores.mean().item(),
        "critic/score/max": all_scores.max().item(),
        "critic/score/min": all_scores.min().item(),
        "response_length/mean": lengths.mean().item(),
        "response_length/max": lengths.max().item(),
        "response_length/clip_ratio": float(
            np.mean([s.finish_reason == "length" for g in groups for s in g["samples"]])
        ),
        "response_length/empty": float((lengths == 0).sum().item()),
        "prompt_length/mean": prompt_tokens / len(lengths),
        "rollout/logprob_gap_mean": logprob_gap(
            old_log_probs[batch.checked],
            batch.rollout_log_probs,
            batch.response_mask[batch.checked],
        ),
        "reward/errors": float(batch.counts["n_errors"]),
        "perf/gen_tokens_per_s": batch.counts["gen_tokens"] / gen_seconds,
    }
    if any(g["example"].data_source in reward.SCORERS for g in groups):  # a flexible scorer too
        flexible = [f for g in groups for f in g["flexible"]]
        metrics["critic/score_flexible/mean"] = float(np.nanmean(flexible))
    for key in {k for g in groups for k in g["extras"]}:
        metrics[f"critic/score/{key}/mean"] = float(
            np.mean([x for g in groups for x in g["extras"].get(key, [])])
        )
    return metrics


def round_metrics(batch):
    """rollout/*: how a step's batch was made in rounds (dynamic sampling, the skip) and how its
    groups scored: all-equal groups carry no advantage, unsolved ones are too hard for now, solved
    ones learned."""
    c = batch.counts
    return {
        "rollout/gen_rounds": float(c["rounds"]),
        "rollout/gen_prompts": float(c["n_prompts"]),
        "rollout/all_equal_groups": c["n_all_equal"] / c["n_prompts"],
        "rollout/solve_none": c["n_none"] / c["n_prompts"],
        "rollout/solve_all": c["n_all"] / c["n_prompts"],
        "rollout/skipped_prompts": c["n_skipped"] / c["n_drawn"],
    }


# --- the engine's sampling distribution against the trainer's (--rollout_is) ----------------------


def rollout_is_weights(old_log_probs, rollout_log_probs, response_mask, level, threshold):
    """Truncated importance weights from the engine's sampling distribution to the trainer's (N, T).

    The batch was sampled by the engine (pi_rollout), but PPO's ratio is taken against the trainer's
    recomputed pi_old: an unbiased gradient weights each token by rho = pi_old / pi_rollout.
    Truncated at C (Ionides 2008; Yao et al. 2025 for LLM RL): min(rho, C), trading a little bias
    for bounded variance. token: rho_t per token; sequence: prod_t rho_t, one weight for all of a
    response's tokens. log rho is clamped to [-20, 20] first, as verl does, so exp() cannot
    overflow. Zero on padding; no gradient flows through the weights. Also returns the rho before
    truncation.
    """
    log_rho = (old_log_probs - rollout_log_probs) * response_mask
    if level == "sequence":
        log_rho = log_rho.sum(-1, keepdim=True).expand_as(log_rho)
    elif level != "token":
        raise ValueError(f"--rollout_is {level!r} is not one of token, sequence")
    rho = log_rho.clamp(-20.0, 20.0).exp() * response_mask
    return rho.clamp(max=threshold).detach(), rho.detach()


def rollout_is_metrics(is_weights, rho, response_mask, threshold, device):
    """rollout_corr/* as verl names them, over all ranks' response tokens: the weights' mean, min
    and max (after truncation), and the share of tokens whose weight was truncated."""
    mask = response_mask.bool()
    total, n_tokens, n_high = all_sum(
        is_weights[mask].sum().item(),
        mask.sum().item(),
        (rho[mask] > threshold).sum().item(),
        device=device,
    )
    w = is_weights[mask] if mask.any() else torch.ones(1, device=device)
    # the min as a max of negatives: one reduction
    lo_hi = torch.stack([-w.min(), w.max()]).double()
    if dist.is_initialized():
        dist.all_reduce(lo_hi, op=dist.ReduceOp.MAX)
    return {
        "rollout_corr/rollout_is_mean": total / max(n_tokens, 1),
        "rollout_corr/rollout_is_min": -lo_hi[0].item(),
        "rollout_corr/rollout_is_max": lo_hi[1].item(),
        "rollout_corr/rollout_is_ratio_fraction_high": n_high / max(n_tokens, 1),
    }


def importance_weights(old_log_probs, batch, args, device):
    """--rollout_is: the truncated importance weights (N/world, T) of this rank's tokens and their
    rollout_corr/* metrics; (None, {}) without the flag."""
    if not args.rollout_is:
        return None, {}
    is_weights, rho = rollout_is_weights(
        old_log_probs,
        batch.rollout_log_probs,
        batch.response_mask,
        args.rollout_is,
        args.rollout_is_threshold,
    )
    return is_weights, rollout_is_metrics(
        is_weights, rho, batch.response_mask, args.rollout_is_threshold, device
    )


# --- validation and the dumps of responses -------------------------------------------------------


def generation_rows(groups, tokenizer, step):
    """One row per response, as verl's rollout_data_dir and validation_data_dir write them: the
    prompt and the response as text, the ground truth, the score, the step; then the flexible score
    (GSM8K) and the reward function's numeric extras."""
    rows = []
    for g in groups:
        prompt = tokenizer.decode(g["example"].prompt_ids, skip_special_tokens=True)
        for i, text in enumerate(g["texts"]):
            row = {
                "input": prompt,
                "output": text,
                "gts": g["example"].ground_truth,
                "score": g["scores"][i],
                "step": step,
            }
            if not math.isnan(g["flexible"][i]):
                row["score_flexible"] = g["flexible"][i]
            rows.append(row | {key: v[i] for key, v in g["extras"].items()})
    return rows


def dump_generations(directory, name, rows):
    """DIRECTORY/NAME.jsonl, one JSON object per row, written whole (a temporary file renamed) or
    not at all."""
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, f"{name}.jsonl")
    with open(path + ".tmp", "w") as f:
        f.writelines(json.dumps(row, ensure_ascii=False) + "\n" for row in rows)
    os.replace(path + ".tmp", path)


def validate(engine, val, args, tokenizer, reward_fn, step, n=1, temperature=0.0):
    """Greedy mean@1 (strict: the training reward; flexible: the last number) per data source, and
    with n > 1 sampled mean@n and pass@k for k = 1, 2, 4, ..., n; the reward function's numeric
    extras as val-aux/<source>/<key>/mean@n, and "acc", verl's name for a correctness flag, as
    val-core with its pass@k (reward.validation_metrics). Uneven shares are fine: groups generate
    independently. With --validation_data_dir, every response goes to a file, in the data's
    order."""
    examples = val.examples[: args.max_val_samples] if args.max_val_samples else val.examples
    share = examples[engine.dp_rank :: engine.dp_size]
    outs = engine.generate(
        [e.prompt_ids for e in share],
        n=n,
        temperature=temperature,
        top_p=1.0,
        top_k=-1,
        max_tokens=args.max_response_length,
        seed=args.seed,
        logprobs=False,
    )
    texts, strict, flex, extras, _ = score(share, outs, n, tokenizer, reward_fn, args)
    # (index in the data, group) from every rank, then rank 0 writes them in order
    if args.validation_data_dir:
        groups = [
            (
                engine.dp_rank + i * engine.dp_size,
                dict(
                    example=e,
                    texts=texts[k],
                    scores=strict[k],
                    flexible=flex[k],
                    extras={key: v[k] for key, v in extras.items()},
                ),
            )
            for i, e in enumerate(share)
            for k in [slice(i * n, (i + 1) * n)]
        ]
        groups = sorted(
            (g for gs in gather_objects(groups if engine.tp_rank == 0 else []) for g in gs),
            key=lambda g: g[0],
        )
        if dist.get_rank() == 0:
            dump_generations(
                args.validation_data_dir,
                str(step) if n == 1 else f"{step}_n{n}",
                generation_rows([g for _, g in groups], tokenizer, step),
            )
    rows = [
        (
            e.data_source,
            {key: v[k] for key, v in extras.items()}
            | dict(reward=strict[k], reward_flexible=flex[k]),
            [len(s.token_ids) for s in outs[i]],
        )
        for i, e in enumerate(share)
        for k in [slice(i * n, (i + 1) * n)]
    ]
    return reward.validation_metrics(
        [r for rs in gather_objects(rows if engine.tp_rank == 0 else []) for r in rs], n
    )
