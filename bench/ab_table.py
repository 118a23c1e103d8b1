"""Two runs of the same command side by side (A, then B: another tree or another flag), from their
metrics.jsonl: the median over the steps after the first of each phase's time, the sync check
(rollout/logprob_gap_mean, the engine's log-probs against the trainer's) and when step 1 ended.
A row either run lacks is left out (bench/trl_grpo.py's rows have the step's time and its end
after launch only).

    python bench/ab_table.py A/metrics.jsonl B/metrics.jsonl
"""

import argparse
import json
import statistics

PHASES = [
    "step",
    "gen",
    "old_log_prob",
    "ref",
    "values",
    "update_critic",
    "update_actor",
    "update_weights",
]


def medians(path):
    """{row name: median over steps 2.. (step 1 alone if it is the only one)}, and step 1's end
    after launch."""
    rows = [r for r in map(json.loads, open(path)) if "timing_s/step" in r]
    if not rows:
        raise SystemExit(f"{path}: no step ended (its run's log says why)")
    steady = rows[1:] or rows
    out = {
        f"{p} s": statistics.median(r[f"timing_s/{p}"] for r in steady)
        for p in PHASES
        if all(f"timing_s/{p}" in r for r in steady)
    }
    if all("rollout/logprob_gap_mean" in r for r in steady):
        out["logprob_gap_mean"] = statistics.median(r["rollout/logprob_gap_mean"] for r in steady)
    out["step 1 ended s"] = rows[0]["timing_s/since_launch"]
    return out, len(steady)


def main(a, b):
    (ma, na), (mb, nb) = medians(a), medians(b)
    print(
        f"{'median over steps 2..':<24} {'A (' + str(na) + ' steps)':>14} "
        f"{'B (' + str(nb) + ' steps)':>14} {'B / A':>7}"
    )
    for key in [k for k in ma if k in mb]:
        ratio = mb[key] / ma[key] if ma[key] else float("nan")
        print(f"{key:<24} {ma[key]:>14.4g} {mb[key]:>14.4g} {ratio:>7.3f}")


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("a")
    p.add_argument("b")
    args = p.parse_args()
    main(args.a, args.b)
