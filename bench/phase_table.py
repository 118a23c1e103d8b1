"""Per-phase time of each step of a run, from its metrics.jsonl, and the step against its speed of
light.

    python bench/phase_table.py RUN/metrics.jsonl [--plain_tok_s N | --plain_tok_s
    OUT/bench_engine.json]

Speed of light of a step: its generated tokens at standalone vLLM's rate (`--plain_tok_s`, measured
by bench/bench_engine.py; without it, our engine's own rate) plus the FLOPs of its models' passes
(log-probs, values, the updates) at 40% of the measured bf16 matmul peak (a step that overlaps them,
--one_step_off_policy, can take less). Metrics logged before 2026-12-05 hold no FLOPs of PPO's
critic: its speed of light then counts the actor's and the reference's passes alone. The median is
over steps after the first (warm-up).
Then each phase's peak GPU memory (`perf/max_memory_allocated_gb/<phase>`), its median over the same
steps: the trainer's own in the phases that run while the engine sleeps, the engine's memory
included in those where it is awake (gen, update_weights).
"""

import argparse
import json
import statistics

PHASES = [
    "gen",
    "gen_background",
    "old_log_prob",
    "ref",
    "values",
    "adv",
    "update_critic",
    "update_actor",
    "update_weights",
    "step",
]
# each model's passes as perf/mfu/<name> names them, and the phase whose time they took
MFU = {
    "old_log_prob": "old_log_prob",
    "ref": "ref",
    "values": "values",
    "actor": "update_actor",
    "critic": "update_critic",
}


PLAIN_HELP = "tokens/s of standalone vLLM, or a bench_engine.json"


def plain_rate(value):
    """--plain_tok_s: a rate, a bench_engine.json holding one (`plain_tok_s`), or None."""
    if value is None or not value.endswith(".json"):
        return value and float(value)
    return json.load(open(value)).get("plain_tok_s")


def speed_of_light(row, plain_tok_s):
    # --one_step_off_policy: timing_s/gen is the wait for a batch generated beside the training,
    # whose own time is timing_s/gen_background; the speed of light still adds generation and
    # training (no overlap)
    tokens = row["perf/gen_tokens_per_s"] * row.get("timing_s/gen_background", row["timing_s/gen"])
    flops = sum(
        row[f"perf/tflops/{m}"] * row[f"timing_s/{p}"] * 1e12
        for m, p in MFU.items()
        if f"perf/tflops/{m}" in row
    )
    return tokens / (plain_tok_s or row["perf/gen_tokens_per_s"]) + flops / (
        0.4 * row["perf/peak_tflops"] * 1e12
    )


def main(path, plain_tok_s=None):
    rows = [r for r in map(json.loads, open(path)) if "timing_s/step" in r]
    if not rows:
        print(f"{path}: no step ended")
        return
    phases = [p for p in PHASES if any(f"timing_s/{p}" in r for r in rows)]
    mfus = [m for m in MFU if any(f"perf/mfu/{m}" in r for r in rows)]
    print(
        f"{'step':>4} "
        + " ".join(f"{p:>14}" for p in phases)
        + f" {'gen tok/s':>10} "
        + " ".join(f"{'MFU ' + m:>16}" for m in mfus)
        + f" {'sync GB/s':>9} {'score':>6} {'resp len':>8}"
        f" {'peak GiB':>8}"
    )
    for r in rows:
        print(
            f"{r['step']:>4} "
            + " ".join(f"{r.get('timing_s/' + p, 0):>14.2f}" for p in phases)
            + f" {r['perf/gen_tokens_per_s']:>10.0f} "
            + " ".join(f"{r.get('perf/mfu/' + m, float('nan')):>16.3f}" for m in mfus)
            + f" {r.get('perf/weight_sync_gb_s', float('nan')):>9.1f} "
            f"{r['critic/score/mean']:>6.3f} {r['response_length/mean']:>8.1f} "
            f"{r['perf/max_memory_allocated_gb']:>8.1f}"
        )
    if rows and "timing_s/since_launch" in rows[0]:
        print(
            f"step {rows[0]['step']} ended {rows[0]['timing_s/since_launch']:.0f} s after launch "
            f"({rows[0]['timing_s/step']:.0f} s of it in the step)"
        )
    steady = rows[1:] or rows
    if steady and "perf/peak_tflops" in steady[0]:
        step = statistics.median(r["timing_s/step"] for r in steady)
        sol = statistics.median(speed_of_light(r, plain_tok_s) for r in steady)
        source = f"plain vLLM at {plain_tok_s:.0f} tok/s" if plain_tok_s else "our engine's rate"
        print(
            f"median step {step:.1f} s; speed of light {sol:.1f} s (generation at {source} + "
            f"training FLOPs at 40% of {steady[0]['perf/peak_tflops']:.0f} TFLOP/s): "
            f"{step / sol:.2f}x (target <= 1.5x)"
        )
    peaks = {
        p: statistics.median(r[f"perf/max_memory_allocated_gb/{p}"] for r in steady)
        for p in PHASES
        if all(f"perf/max_memory_allocated_gb/{p}" in r for r in steady)
    }
    if steady and peaks:
        print("median peak GiB per phase: " + ", ".join(f"{p} {v:.1f}" for p, v in peaks.items()))


def command(main, positional):
    """`main(<positional>, plain_tok_s)` from the command line (this table's and gib_table's)."""
    p = argparse.ArgumentParser()
    p.add_argument(positional)
    p.add_argument("--plain_tok_s", default=None, help=PLAIN_HELP)
    a = p.parse_args()
    main(getattr(a, positional), plain_rate(a.plain_tok_s))


if __name__ == "__main__":
    command(main, "metrics")
