"""The memory planner's predictions against the measured peaks of a run, phase by phase.

    python bench/plan_table.py RUN/metrics.jsonl

For each phase: the plan's prediction (`perf/planned_memory_gb/<phase>`, the same every step), the
largest measured peak (`perf/max_memory_allocated_gb/<phase>`) over the steps after the first (step
1 alone when there is no other: AdamW's state appears during it), and their ratio. The plan assumes
every response at the length limit: a model that answers shorter measures less.
"""

import json
import sys


def main(path):
    rows = [r for r in map(json.loads, open(path)) if "timing_s/step" in r]
    later = [r for r in rows if r["step"] > 1] or rows
    phases = [k.split("/")[-1] for k in rows[0] if k.startswith("perf/planned_memory_gb/")]
    print(f"{'phase':<15} {'planned GiB':>11} {'measured GiB':>12} {'measured/planned':>16}")
    for phase in phases:
        planned = rows[0][f"perf/planned_memory_gb/{phase}"]
        key = f"perf/max_memory_allocated_gb/{phase}"
        measured = [r[key] for r in later if key in r]
        if not measured:
            print(f"{phase:<15} {planned:>11.1f} {'-':>12}")
            continue
        print(
            f"{phase:<15} {planned:>11.1f} {max(measured):>12.1f} {max(measured) / planned:>16.2f}"
        )


if __name__ == "__main__":
    main(sys.argv[1])
