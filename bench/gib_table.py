"""One row per GPU size of `bash bench/gpu_all.sh gib_24 gib_40 ...`: did the run go through, the
GPU memory all its processes held by the driver's count against the size, each phase's peak
against the plan, the step time and its speed of light.

    python bench/gib_table.py OUT [--plain_tok_s N | --plain_tok_s OUT/bench_engine.json]

OUT holds each part's PART.jsonl (the run's metrics), PART.nvml.json (bench/nvml_peak.py) and
PART.log (its output, which gpu_all.sh ends with the part's exit status: "through" is 0, the steps,
validation, checkpoint and export all done). Phases are compared after the first
step (its own plan, where it had one, is bench/plan_table.py's), the final export's from the log's
last line; "lowest" and "highest" are the smallest and largest measured / planned over the phases
the run went through, against the plan (every response at the length limit) and against its
arithmetic at the lengths of the step that measured each peak (a model that answers shorter than
the limit measures less than the plan: the second pair tests the arithmetic).
"""

import json
import os
import re
import statistics

from phase_table import command, speed_of_light
from plan_table import compare, export_peak


def size(part):
    """The GPU size a part ran as, its name's last field (gib_ppo_24: 24 GiB; none: the GPU's)."""
    g = part.rsplit("_", 1)[-1]
    return "the GPU's own" if g == "none" else f"{g} GiB"


def row(out, part, plain_tok_s=None):
    """The row of one part, as a dict of strings."""
    rows = []
    if os.path.exists(f"{out}/{part}.jsonl"):
        rows = [r for r in map(json.loads, open(f"{out}/{part}.jsonl")) if "timing_s/step" in r]
    status, log = "-", ""
    if os.path.exists(f"{out}/{part}.log"):
        log = open(f"{out}/{part}.log", errors="replace").read()
        ended = re.findall(r"^== \S+: exit (\d+)$", log, re.M)
        if "OutOfMemoryError" in log or "CUDA out of memory" in log:
            status = "out of memory"
        elif ended:
            status = "through" if ended[-1] == "0" else f"exit {ended[-1]}"
    nvml = "-"
    if os.path.exists(f"{out}/{part}.nvml.json"):
        p = json.load(open(f"{out}/{part}.nvml.json"))
        nvml = f"{p['peak_gib']:.1f}"
    r = dict(part=part, gpu=size(part), status=status, nvml=nvml)
    later = [x for x in rows if x["step"] > 1] or rows
    # against the plan (every response at the length limit), and against its arithmetic at the
    # lengths of the step that measured the peak, as bench/plan_table.py sets them side by side
    compared = compare(later, export_peak(log)) if later else []
    for name, column in (("", 1), ("at_", 3)):
        ratios = {c[0]: c[2] / c[column] for c in compared if c[2] is not None and c[column]}
        if ratios:
            lo, hi = min(ratios, key=ratios.get), max(ratios, key=ratios.get)
            r[f"{name}lowest"] = f"{ratios[lo]:.2f} ({lo})"
            r[f"{name}highest"] = f"{ratios[hi]:.2f} ({hi})"
    # the same steps' times: a one-step run's (the qwen3_gib parts) its first, which compiles
    if later:
        step = statistics.median(x["timing_s/step"] for x in later)
        r["step"] = f"{step:.1f}" + (" (step 1)" if later[0]["step"] == 1 else "")
        if "perf/peak_tflops" in later[0]:
            sol = statistics.median(speed_of_light(x, plain_tok_s) for x in later)
            r["sol"] = f"{step / sol:.2f}x"
    if rows and "timing_s/since_launch" in rows[0]:
        r["first"] = f"{rows[0]['timing_s/since_launch']:.0f}"
    return r


COLUMNS = [
    ("part", "part"),
    ("gpu", "as a GPU of"),
    ("status", "run"),
    ("nvml", "all processes GiB"),
    ("lowest", "lowest measured/planned"),
    ("highest", "highest measured/planned"),
    ("at_lowest", "lowest at its lengths"),
    ("at_highest", "highest at its lengths"),
    ("step", "step s"),
    ("sol", "x speed of light"),
    ("first", "step 1 ended s"),
]


def main(out, plain_tok_s=None):
    logs = [re.fullmatch(r"((?:qwen3_)?gib_\w+)\.log", f) for f in os.listdir(out)]
    parts = sorted(m.group(1) for m in logs if m)
    rows = [row(out, p, plain_tok_s) for p in parts]
    print("| " + " | ".join(title for _, title in COLUMNS) + " |")
    print("|" + "---|" * len(COLUMNS))
    for r in rows:
        print("| " + " | ".join(r.get(k, "-") for k, _ in COLUMNS) + " |")


if __name__ == "__main__":
    command(main, "out")
