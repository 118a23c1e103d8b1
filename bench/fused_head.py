"""Peak memory and time of the update's output layer, forward and backward, with and without
--use_fused_kernels, at the shape of a real model; with --no_grad, of a pass without gradients (the
old and reference log-prob passes).

    python bench/fused_head.py [--tokens 4096 12288] [--hidden 896] [--vocab 151936] [--dtype
    bfloat16]
                               [--ways logits fused] [--no_grad]

For each token count, each way runs in a fresh process: the hidden states (K, H) and the output
layer's weight (V, H) are random; the loss weighs the log-probs of random targets and the entropy,
as an update with an entropy bonus does. `logits`: the trainer's path without the flag (the logits
(K, V), then ops.token_log_probs with the entropy); `fused`: ops.ChunkedLogProbs. With --no_grad:
the forward alone, timed on its second call, the `logits` way's math compiled on a GPU
(ops.compiled_log_probs, as the passes run by default there). Peak: torch's allocator counter on a
GPU, the process's maximum resident memory on a CPU (which includes the ~0.4 GB of the interpreter
and torch). Reported beside it: the inputs' own size, and the largest difference between the two
ways: of the gradients, or with --no_grad of the log-probs. A way that runs out of GPU memory prints
as such.
"""

import argparse
import contextlib
import json
import os
import resource
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def one(way, tokens, hidden_size, vocab, dtype, out, no_grad=False):
    """Run one way in this process and write its numbers (and the gradients, or with `no_grad`
    the log-probs) to `out`."""
    import torch

    sys.path.insert(0, ROOT)
    import ops

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = getattr(torch, dtype)
    g = torch.Generator(device=device).manual_seed(0)
    hidden = (
        (torch.randn(tokens, hidden_size, generator=g, device=device) * 0.5)
        .to(dtype)
        .requires_grad_(not no_grad)
    )
    weight = (
        (torch.randn(vocab, hidden_size, generator=g, device=device) * 0.05)
        .to(dtype)
        .requires_grad_(not no_grad)
    )
    targets = torch.randint(0, vocab, (tokens,), generator=g, device=device)
    log_probs_of = ops.token_log_probs
    if no_grad and device.type == "cuda":
        log_probs_of = ops.compiled_log_probs

    def run():
        if way == "fused":
            return ops.ChunkedLogProbs.apply(hidden, weight, targets, 1.0, max(1, 2**28 // vocab))
        return log_probs_of(hidden @ weight.T, targets, 1.0, with_entropy=True)

    try:
        with torch.no_grad() if no_grad else contextlib.nullcontext():
            if no_grad:
                run()  # compiled on its first call
            if device.type == "cuda":
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
            start = time.perf_counter()
            log_probs, entropy = run()
            if not no_grad:
                (log_probs.exp().sum() + 0.01 * entropy.sum()).backward()
    except torch.OutOfMemoryError:
        with open(out, "w") as f:
            json.dump({"oom": True, "device": device.type}, f)
        return
    if device.type == "cuda":
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated()
    else:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB
    seconds = time.perf_counter() - start
    if no_grad:
        compared = {"log_probs": log_probs.float().cpu(), "entropy": entropy.float().cpu()}
    else:
        compared = {"hidden": hidden.grad.float().cpu(), "weight": weight.grad.float().cpu()}
    torch.save(compared, out + ".pt")
    inputs = (hidden.numel() + weight.numel()) * hidden.element_size()
    with open(out, "w") as f:
        json.dump({"peak": peak, "seconds": seconds, "inputs": inputs, "device": device.type}, f)


def main(a):
    import tempfile

    import torch

    what = "forward (no gradients)" if a.no_grad else "forward + backward"
    print(f"output layer ({a.vocab} x {a.hidden}, {a.dtype}), {what} of log-probs and entropy")
    diff_name = "max |diff|" if a.no_grad else "max |grad diff|"
    print(
        f"{'tokens':>7} {'way':>7} {'peak GB':>8} {'inputs GB':>9} {'seconds':>8} {diff_name:>16}"
    )
    with tempfile.TemporaryDirectory() as tmp:
        for tokens in a.tokens:
            results = {}
            for way in a.ways:
                out = os.path.join(tmp, f"{way}_{tokens}.json")
                subprocess.run(
                    [
                        sys.executable,
                        __file__,
                        "--one",
                        way,
                        "--tokens",
                        str(tokens),
                        "--hidden",
                        str(a.hidden),
                        "--vocab",
                        str(a.vocab),
                        "--dtype",
                        a.dtype,
                        "--out",
                        out,
                        *(["--no_grad"] if a.no_grad else []),
                    ],
                    check=True,
                )
                r = json.load(open(out))
                if r.get("oom"):
                    print(f"{tokens:>7} {way:>7} out of memory", flush=True)
                    continue
                results[way] = r, torch.load(out + ".pt")
            diff = float("nan")
            if len(results) == 2:
                diff = max(
                    (results["fused"][1][k] - results["logits"][1][k]).abs().max().item()
                    for k in results["fused"][1]
                )
            for way, (r, _) in results.items():
                print(
                    f"{tokens:>7} {way:>7} {r['peak'] / 1e9:>8.2f} {r['inputs'] / 1e9:>9.2f} "
                    f"{r['seconds']:>8.2f} {diff if way == 'fused' else 0.0:>16.3g}",
                    flush=True,
                )
            print(f"# peak on {r['device']}", flush=True)


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--tokens", type=int, nargs="+", default=[2048, 4096])
    p.add_argument("--hidden", type=int, default=896, help="Qwen2.5-0.5B's; Qwen3-1.7B: 2048")
    p.add_argument("--vocab", type=int, default=151936)
    p.add_argument(
        "--dtype",
        default="float32",
        help="float32 on CPU; bfloat16 as the trainer computes on a GPU",
    )
    p.add_argument(
        "--ways",
        nargs="+",
        choices=["logits", "fused"],
        default=["logits", "fused"],
        help="leave out `logits` at token counts whose logits do not fit",
    )
    p.add_argument(
        "--no_grad", action="store_true", help="the passes without gradients: the forward alone"
    )
    p.add_argument("--one", choices=["logits", "fused"], help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.one:
        one(a.one, a.tokens[0], a.hidden, a.vocab, a.dtype, a.out, a.no_grad)
    else:
        main(a)
