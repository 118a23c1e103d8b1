"""Runs of one configuration at several GPU counts side by side: per-phase time, tokens/s per GPU
and the scaling efficiency against the first run.

    python bench/scaling_table.py GPUS:TP:RUN/metrics.jsonl [GPUS:TP:RUN/metrics.jsonl ...]

Medians over the steps after the first (warm-up). Scaling efficiency = tokens/s per GPU
(`perf/throughput`: prompt + response tokens of a step / its time / GPUs) against the first run's:
1.0 is perfect weak scaling. Also the weight sync, the sync-parity gap, the peak memory per GPU and
how long after launch the first step ended.
"""

import argparse
import json
import statistics

PHASES = [
    "gen",
    "old_log_prob",
    "ref",
    "values",
    "update_critic",
    "update_actor",
    "update_weights",
    "step",
]


def summary(path):
    """Medians of a run's steps after the first, and its peak memory."""
    rows = [r for r in map(json.loads, open(path)) if "timing_s/step" in r]
    steady = rows[1:] or rows

    def med(key):
        return statistics.median(r[key] for r in steady) if all(key in r for r in steady) else None

    out = {p: med(f"timing_s/{p}") for p in PHASES}
    out |= {
        "throughput": med("perf/throughput"),
        "gap": med("rollout/logprob_gap_mean"),
        "peak_gb": max(r["perf/max_memory_allocated_gb"] for r in rows),
        "steps": len(rows),
        "first": rows[0].get("timing_s/since_launch", float("nan")),
    }
    return out


def main(runs):
    parsed = [(int(g), int(tp), summary(p)) for g, tp, p in (r.split(":", 2) for r in runs)]
    phases = [p for p in PHASES if any(s[p] is not None for _, _, s in parsed)]
    print(
        f"{'GPUs':>4} {'TP':>3} "
        + " ".join(f"{p:>14}" for p in phases)
        + f" {'tok/s/GPU':>10} {'efficiency':>10} {'gap':>7} {'peak GB':>8} {'steps':>5} "
        f"{'first step s':>12}"
    )
    base = parsed[0][2]["throughput"]
    for gpus, tp, s in parsed:
        print(
            f"{gpus:>4} {tp:>3} "
            + " ".join(f"{s[p]:>14.2f}" if s[p] is not None else f"{'':>14}" for p in phases)
            + f" {s['throughput']:>10.0f} {s['throughput'] / base:>10.2f} "
            f"{s['gap'] or float('nan'):>7.4f} {s['peak_gb']:>8.1f} {s['steps']:>5} "
            f"{s['first']:>12.0f}"
        )


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("runs", nargs="+", help="GPUS:TP:path/to/metrics.jsonl, the reference run first")
    main(p.parse_args().runs)
