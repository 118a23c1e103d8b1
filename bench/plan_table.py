"""The memory planner's predictions against the measured peaks of a run, phase by phase.

    python bench/plan_table.py RUN/metrics.jsonl [PEAK.json [RUN.log]]

For each phase: the plan's prediction (`perf/planned_memory_gb/<phase>`), the largest measured peak
(`perf/max_memory_allocated_gb/<phase>`) over the steps after the first, and their ratio; then the
same for step 1 where it had a plan of its own (--warm_compile_caches' eager first step beside the
compiling helper), or for step 1 alone when there is no other (AdamW's state appears during it).
The plan assumes every response at the length limit: a model that answers shorter measures less.
So the last two columns set the peak beside the plan's arithmetic at the lengths of the step that
measured it (`perf/predicted_memory_gb/<phase>`, where the run logged it): the test of the
arithmetic itself. PEAK.json (bench/nvml_peak.py): the GPU memory all the run's processes held, by
the driver's count. RUN.log (the run's output): the final export's peak, from its last line
(`export: ... s, peak ... GiB`), which comes after the last row of metrics.jsonl.
"""

import json
import re
import sys


def planned(row):
    return {k.split("/")[-1]: v for k, v in row.items() if k.startswith("perf/planned_memory_gb/")}


def export_peak(text):
    """The final export's peak in GiB from a run's output, or None (no export, or not on a GPU)."""
    found = re.findall(r"^export: [\d.]+ s, peak ([\d.]+) GiB", text, re.M)
    return float(found[-1]) if found else None


def compare(rows, export=None):
    """(phase, planned, measured, at its lengths) for each phase the plan (the rows' last) has:
    the largest peak measured in the rows (None where none was), and the plan's arithmetic at the
    lengths of the step that measured it (None where not logged); `export`, the final export's
    peak, measured after them (its arithmetic the last row's)."""
    out = []
    for phase, predicted in planned(rows[-1]).items():
        key = f"perf/max_memory_allocated_gb/{phase}"
        measured = [r for r in rows if key in r]
        if phase == "export" and export is not None:
            at = rows[-1].get(f"perf/predicted_memory_gb/{phase}")
            measured = [{key: export, f"perf/predicted_memory_gb/{phase}": at}]
        if not measured:
            out.append((phase, predicted, None, None))
            continue
        row = max(measured, key=lambda r: r[key])
        out.append((phase, predicted, row[key], row.get(f"perf/predicted_memory_gb/{phase}")))
    return out


def table(title, rows, export=None):
    """Lines: each phase's prediction beside the largest peak measured in the rows, and the
    prediction at the lengths of the step that measured it (`compare`)."""
    lines = [
        title,
        f"{'phase':<15} {'planned GiB':>11} {'measured GiB':>12} {'measured/planned':>16} "
        f"{'at its lengths GiB':>18} {'measured/that':>13}",
    ]
    for phase, predicted, peak, at in compare(rows, export):
        if peak is None:
            lines.append(f"{phase:<15} {predicted:>11.1f} {'-':>12}")
            continue
        line = f"{phase:<15} {predicted:>11.1f} {peak:>12.1f} {peak / predicted:>16.2f}"
        if at:
            line += f" {at:>18.1f} {peak / at:>13.2f}"
        lines.append(line)
    return lines


def main(path, peak=None, log=None):
    rows = [r for r in map(json.loads, open(path)) if "timing_s/step" in r]
    later = [r for r in rows if r["step"] > 1]
    first = [r for r in rows if r["step"] == 1]
    export = log and export_peak(open(log, errors="replace").read())
    lines = []
    if later:
        steps = f"steps {later[0]['step']}-{later[-1]['step']}"
        lines += table(steps, later, export)
    if first and (not later or planned(first[0]) != planned(later[-1])):
        lines += table(
            "step 1" + (" (its own plan)" if later else ""), first, None if later else export
        )
    if peak:
        p = json.load(open(peak))
        lines.append(
            f"all processes (NVML): {p['peak_gib']:.1f} GiB above the {p['baseline_gib']:.1f} GiB "
            "in use before the run; the processes' own counts together "
            f"{p['peak_processes_gib']:.1f} GiB at most"
        )
    print("\n".join(lines))


if __name__ == "__main__":
    main(*sys.argv[1:4])
