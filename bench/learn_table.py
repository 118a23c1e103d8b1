"""A run's learning curve as a results table, from its metrics.jsonl: at each validation, the
training time so far, the wall time so far, and the greedy score of each validation data source
(strict reward, and flexible where it is logged); then where the run stood after a time budget of
training. Where the reward function logs "acc" (a shaped reward, such as
reward.gsm8k_partial_credit, with the strict score as "acc"), that column is the strict one and the
reward's column reads "reward".

    python bench/learn_table.py RUN/metrics.jsonl [--minutes 10]
    python bench/learn_table.py --summary RUN1.jsonl RUN2.jsonl ... [--minutes 10]

`--summary` prints one row per run instead: its first data source's strict and flexible scores at
the first validation, at the last validation within the time budget, and at the last validation of
all.

Training time is the sum of `timing_s/step` (compiling included); wall time adds validation
(`timing_s/testing`) and checkpoints (`timing_s/save_checkpoint`); neither counts start-up or the
validation before step 1. A resumed run logs the steps it ran again twice: the later line of a step
wins, so the times follow the run's checkpoint lineage.
"""

import argparse
import json
import os
import re

VAL = re.compile(r"val-core/(.+)/(acc|reward|reward_flexible)/mean@1$")


def load(path):
    """{step: metrics} of a metrics.jsonl, the later line of a repeated step winning."""
    rows = {}
    with open(path) as f:
        for n, line in enumerate(f, 1):
            if line.strip():
                try:
                    row = json.loads(line)
                except json.JSONDecodeError as e:
                    raise SystemExit(f"learn_table.py: {path}, line {n}: not JSON ({e})")
                rows[row["step"]] = row
    return rows


def curve(rows):
    """(sources, points): the validated data sources, and per validation (step, training s, wall s,
    {(source, kind): score}), kind 'acc', 'reward' (strict where there is no acc) or
    'reward_flexible'."""
    train = wall = 0.0
    points, sources = [], []
    for step in sorted(rows):
        row = rows[step]
        train += row.get("timing_s/step", 0.0)
        wall += (
            row.get("timing_s/step", 0.0)
            + row.get("timing_s/testing", 0.0)
            + row.get("timing_s/save_checkpoint", 0.0)
        )
        scores = {}
        for key, value in row.items():
            m = VAL.match(key)
            if m:
                scores[m.group(1), m.group(2)] = value
                if m.group(1) not in sources:
                    sources.append(m.group(1))
        if scores:
            points.append((step, train, wall, scores))
    return sources, points


def main(path, minutes=10.0):
    sources, points = curve(load(path))
    if not points:
        raise SystemExit(f"learn_table.py: {path} holds no validation (val-core/*/reward/mean@1)")
    kinds = [
        (s, k)
        for s in sources
        for k in ("acc", "reward", "reward_flexible")
        if any((s, k) in p[3] for p in points)
    ]
    label = {"acc": "strict (acc)", "reward_flexible": "flexible"}
    names = [
        f"{s} {label.get(k) or ('reward' if (s, 'acc') in kinds else 'strict')}" for s, k in kinds
    ]
    print(
        "| step | training time | wall time (with validation, checkpoints) | "
        + " | ".join(names)
        + " |"
    )
    print("|---" * (3 + len(names)) + "|")
    for step, train, wall, scores in points:
        cells = [f"{scores[k]:.3f}" if k in scores else "" for k in kinds]
        print(
            f"| {step} | {train / 60:.1f} min | {wall / 60:.1f} min | " + " | ".join(cells) + " |"
        )
    within = [p for p in points if p[1] <= minutes * 60]
    if not within:
        print(f"no validation within {minutes:g} minutes of training")
        return
    step, train, _, scores = within[-1]
    base = points[0][3]
    gains = ", ".join(
        f"{name} {base[k]:.3f} -> {scores[k]:.3f}" if k in base else f"{name} {scores[k]:.3f}"
        for name, k in zip(names, kinds)
        if k in scores
    )
    print(f"within {minutes:g} minutes of training: step {step} ({train / 60:.1f} min): {gains}")


def summary(paths, minutes=10.0):
    """One row per run: where its first data source stood at the start, within `minutes` of
    training, and at its last validation (strict / flexible, "-" where a score is not logged)."""
    print(
        f"| run | strict / flexible at the start | within {minutes:g} minutes: step (training "
        "time) strict / flexible | last validation: step (training time) strict / flexible |"
    )
    print("|---|---|---|---|")
    for path in paths:
        sources, points = curve(load(path))
        name = os.path.basename(path).removesuffix(".jsonl")
        if not points:
            print(f"| {name} | no validation | - | - |")
            continue
        src = sources[0]
        strict = (src, "acc") if any((src, "acc") in p[3] for p in points) else (src, "reward")
        kinds = (strict, (src, "reward_flexible"))

        def scores(point):
            return " / ".join(f"{point[3][k]:.3f}" if k in point[3] else "-" for k in kinds)

        def at(point):
            return f"{point[0]} ({point[1] / 60:.1f} min) {scores(point)}"

        within = [p for p in points if p[1] <= minutes * 60]
        print(
            f"| {name} | {scores(points[0])} | {at(within[-1]) if within else '-'} | "
            f"{at(points[-1])} |"
        )


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("metrics", nargs="+")
    p.add_argument(
        "--minutes", type=float, default=10.0, help="the training-time budget of the summary line"
    )
    p.add_argument("--summary", action="store_true", help="one row per run (several metrics files)")
    a = p.parse_args()
    if a.summary:
        summary(a.metrics, a.minutes)
    elif len(a.metrics) > 1:
        p.error("several metrics files need --summary")
    else:
        main(a.metrics[0], a.minutes)
