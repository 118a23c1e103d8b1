"""Per-phase time of each step of a run, from its metrics.jsonl:  python bench/phase_table.py RUN/metrics.jsonl"""

import json
import sys

PHASES = ["gen", "old_log_prob", "ref", "adv", "update_actor", "update_weights", "step"]


def main(path):
    rows = [r for r in map(json.loads, open(path)) if "timing_s/step" in r]
    print(f"{'step':>4} " + " ".join(f"{p:>14}" for p in PHASES) + f" {'gen tok/s':>10} {'MFU actor':>9} "
          f"{'score':>6} {'resp len':>8} {'peak GiB':>8}")
    for r in rows:
        print(f"{r['step']:>4} " + " ".join(f"{r.get('timing_s/' + p, 0):>14.2f}" for p in PHASES)
              + f" {r['perf/gen_tokens_per_s']:>10.0f} {r['perf/mfu/actor']:>9.3f} {r['critic/score/mean']:>6.3f}"
              f" {r['response_length/mean']:>8.1f} {r['perf/max_memory_allocated_gb']:>8.1f}")


if __name__ == "__main__":
    main(sys.argv[1])
