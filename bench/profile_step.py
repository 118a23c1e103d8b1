"""Where the log-prob and update passes spend their time: achieved TFLOP/s and the top kernels.

    torchrun --nproc_per_node=1 bench/profile_step.py --model M [--out DIR]

Builds GSM8K-shaped sequences (prompts of 105 tokens, responses of 20-512 tokens, mean 266, random
ids), loads the policy as train_grpo.py does (FSDP2, bf16 compute, packed sequences with varlen
attention) and measures, per token budget of a micro-batch:
- the log-prob pass over all sequences (no gradient), as `old_log_prob` runs it;
- forward + backward of a GRPO-like loss over a mini-batch, as `update_actor` runs it (no optimizer
  step);
each as TFLOP/s and MFU with the trainer's own FLOP count (metrics.phase_perf), once per --modes
entry:
`eager` (no torch.compile), `logits` (--use_torch_compile: the log-prob / entropy math compiled),
`all` (that and --compile_layers). Both compile the log-prob math in every pass (with its gradient
by hand, ops.CompiledLogProbs) and the rest only where it runs without gradients (the trainer's
choice, see ops.no_grad_compiled). `train` compiles as `all` does and the update's layers'
forward and backward too (--compile_update); `fused` compiles as `all` does and computes the
update's log-probs from the output layer chunk by chunk (--use_fused_kernels). A budget that runs
out of memory prints as such.
Per mode, one update micro-batch at the largest budget that fitted runs under the profiler: device
time against host time says whether the GPU waits on Python. For the last mode, the operators that
take the most device time in each pass are printed (and written to --out as profile_*.txt). On CPU
it runs the same code on whatever --model is, for a smoke test.
"""

import argparse
import functools
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import metrics  # noqa: E402
import models  # noqa: E402
import ops  # noqa: E402
import passes  # noqa: E402
import run  # noqa: E402
import train_grpo  # noqa: E402


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def make_samples(n, vocab, max_response_length, seed=0):
    """n (prompt, response) pairs: 105-token prompts, responses uniform in
    20..max_response_length."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(20, max_response_length + 1, (n,), generator=g)
    return [
        (
            torch.randint(100, vocab, (105,), generator=g).tolist(),
            torch.randint(100, vocab, (int(k),), generator=g).tolist(),
        )
        for k in lengths
    ]


def log_prob_pass(model, samples, budget, device):
    sync(device)
    t = time.perf_counter()
    T = max(len(r) for _, r in samples)
    passes.batched_log_probs(model, samples, 8, 1.0, True, T, budget, with_entropy=True)
    sync(device)
    return time.perf_counter() - t


def update_pass(model, samples, budget, device, fused=False):
    """Forward + backward of a token-mean loss on every micro-batch (gradients accumulate)."""
    # as update_actor: gradient checkpointing (--gradient_checkpointing) acts only in train mode
    model.train()
    sync(device)
    t = time.perf_counter()
    for idx in passes.micro_batches(samples, 8, budget):
        log_probs, _ = passes.forward_log_probs(
            model, [samples[i] for i in idx], 1.0, True, fused=fused
        )
        (-log_probs.sum() / 1e6).backward()
    sync(device)
    dt = time.perf_counter() - t
    model.zero_grad(set_to_none=True)
    model.eval()
    return dt


def profiled(fn, device):
    """Run `fn` once under torch.profiler; returns the profile's operator averages."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        fn()
        sync(device)
    return prof.key_averages()


def top_ops(averages, device, path, rows=25):
    key = "cuda_time_total" if device.type == "cuda" else "cpu_time_total"
    table = averages.table(sort_by=key, row_limit=rows)
    if path:
        with open(path, "w") as f:
            f.write(table)
    return table


def host_and_device_ms(averages):
    """Self host (CPU) and self device time of a profile, in ms (the profiler adds host time of its
    own)."""
    host = sum(e.self_cpu_time_total for e in averages) / 1e3
    dev = (
        sum(
            getattr(e, "self_device_time_total", getattr(e, "self_cuda_time_total", 0))
            for e in averages
        )
        / 1e3
    )
    return host, dev


def load(a, mode, device):
    """The policy as train_grpo.py loads it, with the torch.compile choices of `mode`."""
    ops.LOGITS_MATH.update(log_probs=ops.token_log_probs)  # eager
    if mode != "eager":
        ops.compile_logits_math()
    args = train_grpo.Args(
        model=a.model,
        enable_gradient_checkpointing=a.gradient_checkpointing,
        compile_layers=mode in ("all", "train", "fused"),
        compile_update=mode == "train",
    )
    return models.load(models.Model("actor", a.model, "old_log_prob"), device, args)


def main(a):
    rank, world, device = run.init_distributed()
    peak = metrics.measure_peak_flops(device)
    model, reference = None, None
    print(
        f"{'mode':7s} {'pass':9s} {'tokens/micro':>12s} {'first s':>8s} {'seconds':>8s} "
        f"{'TFLOP/s':>8s} {'MFU':>6s} {'peak GB':>8s}",
        flush=True,
    )
    for mode in a.modes:
        del model
        model = load(a, mode, device)
        config = model.config
        samples = make_samples(a.sequences, config.vocab_size, a.max_response_length)
        mini = samples[: a.mini_batch]
        tokens = lambda s: sum(len(p) + len(r) for p, r in s)  # noqa: E731
        seq_len = tokens(samples) / len(samples)
        if mode == a.modes[0]:
            print(
                f"# {torch.cuda.get_device_name(0) if device.type == 'cuda' else 'CPU'}, "
                f"{a.model}, {len(samples)} sequences of mean length {seq_len:.0f}, gradient "
                f"checkpointing {a.gradient_checkpointing}, peak {peak / 1e12:.0f} TFLOP/s; 'first "
                f"s' includes compiling",
                flush=True,
            )
        # the same numbers whatever compiles: log-probs of 16 sequences against the first mode's
        with torch.no_grad():
            check = passes.forward_log_probs(model, samples[:16], 1.0, True, False)[0]
        reference = check if reference is None else reference
        diff = (check - reference).abs()
        print(
            f"# {mode}: |log-prob - {a.modes[0]}'s| over 16 sequences: max "
            f"{diff.max().item():.3g}, mean "
            f"{diff.sum().item() / max(1, int((check != 0).sum())):.3g}",
            flush=True,
        )

        def measure(name, pass_fn, seqs, budget, phase, key):
            """One row: first call (with compiling), median of --repeats, MFU, peak memory; a budget
            that does not fit prints as such and the sweep goes on. Returns whether it fitted."""
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats()
            try:
                first = pass_fn(model, seqs, budget, device)
                dt = statistics.median(
                    pass_fn(model, seqs, budget, device) for _ in range(a.repeats)
                )
            except torch.OutOfMemoryError:
                model.zero_grad(set_to_none=True)
                torch.cuda.empty_cache()
                print(f"{mode:7s} {name:9s} {budget:>12d} out of memory", flush=True)
                return False
            forward = metrics.forward_flops(
                config, seq_len, tokens(seqs), sum(len(r) for _, r in seqs)
            )
            passes = 3 if phase.startswith("update_") else 1  # forward and backward: three
            work = {phase: (key, passes * forward)}
            perf = metrics.phase_perf({f"timing_s/{phase}": dt}, work, peak, 0)
            mem = torch.cuda.max_memory_allocated() / 1e9 if device.type == "cuda" else float("nan")
            print(
                f"{mode:7s} {name:9s} {budget:>12d} {first:>8.2f} {dt:>8.2f} "
                f"{perf[f'perf/tflops/{key}']:>8.0f} {perf[f'perf/mfu/{key}']:>6.1%} {mem:>8.1f}",
                flush=True,
            )
            return True

        lp_fit = [
            b
            for b in a.log_prob_tokens
            if measure("log_prob", log_prob_pass, samples, b, "old_log_prob", "old_log_prob")
        ]
        update = functools.partial(update_pass, fused=mode == "fused")
        up_fit = [
            b
            for b in a.update_tokens
            if measure("update", update, mini, b, "update_actor", "actor")
        ]
        if not up_fit:
            continue
        up_idx = passes.micro_batches(mini, 8, max(up_fit))[0]
        # the timed pass over that one micro-batch (it fits the budget whole): train mode, as
        # update_actor
        update_profile = profiled(
            lambda: update(model, [mini[i] for i in up_idx], max(up_fit), device), device
        )
        host, dev = host_and_device_ms(update_profile)
        print(
            f"# {mode}: one update micro-batch of "
            f"{sum(len(p) + len(r) for p, r in (mini[i] for i in up_idx))} tokens under the "
            f"profiler: device {dev:.0f} ms, host {host:.0f} ms",
            flush=True,
        )
    out = a.out
    if out:
        os.makedirs(out, exist_ok=True)
    if lp_fit:
        lp_idx = passes.micro_batches(samples, 8, max(lp_fit))[0]
        with torch.no_grad():
            lp_profile = profiled(
                lambda: passes.forward_log_probs(
                    model, [samples[i] for i in lp_idx], 1.0, True, False
                ),
                device,
            )
        print(
            "\nlog-prob micro-batch, top operators by device time:\n"
            + top_ops(lp_profile, device, out and os.path.join(out, "profile_log_prob.txt")),
            flush=True,
        )
    if up_fit:
        print(
            "\nupdate micro-batch (forward + backward), top operators by device time:\n"
            + top_ops(update_profile, device, out and os.path.join(out, "profile_update.txt")),
            flush=True,
        )
    print(compile_summary(), flush=True)
    dist.destroy_process_group()


def compile_summary(top=12):
    """Where torch.compile's time went in this process: graphs compiled, and the `top` phases by
    total seconds (torch._dynamo's own timers; nested, so they overlap)."""
    from torch._dynamo.utils import compile_times, counters

    names, values = compile_times(repr="csv", aggregate=True)
    rows = sorted(((float(v), n) for n, v in zip(names, values) if v != ""), reverse=True)[:top]
    stats = dict(counters["stats"])
    return (
        f"\ntorch.compile: {stats.get('unique_graphs', 0)} graphs, "
        f"{stats.get('calls_captured', 0)} calls "
        "captured; seconds by phase (nested timers):\n"
        + "\n".join(f"{v:9.1f}  {n}" for v, n in rows)
    )


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--model", required=True)
    p.add_argument(
        "--sequences", type=int, default=1280, help="sequences of the log-prob pass (a step's)"
    )
    p.add_argument(
        "--mini_batch", type=int, default=320, help="sequences of the update pass (a mini-batch)"
    )
    p.add_argument("--log_prob_tokens", type=int, nargs="+", default=[16384, 32768, 65536])
    p.add_argument("--update_tokens", type=int, nargs="+", default=[8192, 12288, 24576])
    p.add_argument("--max_response_length", type=int, default=512)
    p.add_argument("--gradient_checkpointing", action="store_true")
    p.add_argument(
        "--modes",
        nargs="+",
        default=["eager", "logits", "all"],
        choices=["eager", "logits", "all", "train", "fused"],
    )
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", default=os.environ.get("OUT"))
    main(p.parse_args())
