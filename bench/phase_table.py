"""Per-phase time of each step of a run, from its metrics.jsonl:  python bench/phase_table.py RUN/metrics.jsonl"""

import json
import sys

PHASES = ["gen", "old_log_prob", "ref", "values", "adv", "update_critic", "update_actor", "update_weights", "step"]


def main(path):
    rows = [r for r in map(json.loads, open(path)) if "timing_s/step" in r]
    phases = [p for p in PHASES if any(f"timing_s/{p}" in r for r in rows)]
    print(f"{'step':>4} " + " ".join(f"{p:>14}" for p in phases) + f" {'gen tok/s':>10} {'MFU actor':>9} "
          f"{'score':>6} {'resp len':>8} {'peak GiB':>8}")
    for r in rows:
        print(f"{r['step']:>4} " + " ".join(f"{r.get('timing_s/' + p, 0):>14.2f}" for p in phases)
              + f" {r['perf/gen_tokens_per_s']:>10.0f} {r.get('perf/mfu/actor', float('nan')):>9.3f}"
              f" {r['critic/score/mean']:>6.3f} {r['response_length/mean']:>8.1f}"
              f" {r['perf/max_memory_allocated_gb']:>8.1f}")


if __name__ == "__main__":
    main(sys.argv[1])
