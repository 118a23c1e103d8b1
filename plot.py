"""Draw one or more runs' metrics.jsonl as one PNG: python plot.py RUN [RUN ...] [--out F.png]
[--labels L ...] [--x minutes]

RUN is a run folder (the trainer's --default_local_dir, holding metrics.jsonl) or a .jsonl file;
runs are named by their folder (or file) in the legend, or by --labels, one per run. Panels, against
the step: the training score (critic/score/mean), validation (val-core/<data_source>/reward/mean@1,
dashed: reward_flexible, dotted: acc, the strict score of a shaped reward), response length, the KL
term (actor/kl_loss, or actor/reward_kl_penalty when the KL is in the reward) and the policy's
entropy (against the training time instead with `--x minutes`: the sum of the steps' `timing_s/step`
so far, which compares runs whose steps take different times, as a budget of minutes does); and
where each step's time goes (timing_s/gen, old_log_prob, ref, values, adv, update_critic,
update_actor, update_weights) as stacked bars: one bar per step for one run, the median of each
phase for several (a step that compiles does not skew it).
Metrics a run does not log (GRPO has no critic) are left out.
"""

import argparse
import json
import math
import statistics
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # no display needed
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.lines import Line2D  # noqa: E402
from matplotlib.ticker import MaxNLocator  # noqa: E402

PHASES = [
    "gen",
    "old_log_prob",
    "ref",
    "values",
    "adv",
    "update_critic",
    "update_actor",
    "update_weights",
]
LINE_PANELS = [  # (title, candidate keys: the first one a run logs is drawn)
    ("training score (critic/score/mean)", ["critic/score/mean"]),
    ("response length (tokens)", ["response_length/mean"]),
    ("KL to the reference", ["actor/kl_loss", "actor/reward_kl_penalty"]),
    ("entropy (actor/entropy)", ["actor/entropy"]),
]


def load_run(path):
    """(name, {step: metrics}) of a run folder or a metrics.jsonl file; later lines win on a
    repeated step."""
    path = Path(path)
    file = path / "metrics.jsonl" if path.is_dir() else path
    if not file.is_file():
        raise SystemExit(f"plot.py: no metrics.jsonl at {file}")
    rows = {}
    with open(file) as f:
        for line in f:
            if line.strip():
                row = json.loads(line)
                rows.setdefault(row["step"], {}).update(row)
    name = (
        path.name
        if path.is_dir()
        else (file.parent.name if file.name == "metrics.jsonl" else file.stem)
    )
    return name, rows


def training_minutes(rows):
    """{step: minutes of training up to the end of that step}: the sum of `timing_s/step` over the
    steps so far; a step without it (the validation before step 1) adds nothing. A step run again
    after a resume counts once, as the later line that `load_run` keeps."""
    total, minutes = 0.0, {}
    for step, row in sorted(rows.items()):
        total += row.get("timing_s/step", 0.0)
        minutes[step] = total / 60
    return minutes


X_LABELS = {"step": "step", "minutes": "training time (min)"}


def series(rows, key, x="step"):
    """x values (steps, or training minutes with x="minutes") and values of one metric, skipping
    steps that lack it or hold nan."""
    at = training_minutes(rows) if x == "minutes" else {s: s for s in rows}
    points = [
        (at[s], r[key])
        for s, r in sorted(rows.items())
        if isinstance(r.get(key), (int, float)) and not math.isnan(r[key])
    ]
    return [p[0] for p in points], [p[1] for p in points]


def draw_lines(ax, runs, title, keys, colors, x="step"):
    drawn = False
    for (name, rows), color in zip(runs, colors):
        for key in keys:
            steps, values = series(rows, key, x)
            if steps:
                ax.plot(
                    steps, values, color=color, marker="." if len(steps) < 30 else None, label=name
                )
                drawn = True
                break
    ax.set_title(title, fontsize=10)
    ax.set_xlabel(X_LABELS[x])
    if not drawn:
        ax.text(
            0.5, 0.5, "not logged", ha="center", va="center", transform=ax.transAxes, color="gray"
        )


VAL_STYLES = {"reward": ("", "-"), "reward_flexible": (" (flexible)", "--"), "acc": (" (acc)", ":")}


def draw_validation(ax, runs, colors, x="step"):
    """Each run's greedy validation score per data source, dashed where flexible, dotted for "acc".
    The colour names the run (the figure's legend); this panel's legend names the data sources and
    line styles."""
    styles = {}  # legend label -> line style, in drawing order
    for (name, rows), color in zip(runs, colors):
        keys = sorted(
            {
                k
                for r in rows.values()
                for k in r
                if k.startswith("val-core/") and k.endswith("/mean@1")
            }
        )
        for key in keys:
            steps, values = series(rows, key, x)
            # val-core/<source>/<score>/mean@1
            source, score, _ = key.split("/", 1)[1].rsplit("/", 2)
            suffix, style = VAL_STYLES.get(score, (f" ({score})", "-."))
            styles[source + suffix] = style
            ax.plot(steps, values, color=color, linestyle=style, marker="o", markersize=3)
    ax.set_title("validation, greedy (val-core/*/reward/mean@1)", fontsize=10)
    ax.set_xlabel(X_LABELS[x])
    if styles:
        line_color = colors[0] if len(runs) == 1 else "gray"
        ax.legend(
            [
                Line2D([], [], color=line_color, linestyle=ls, marker="o", markersize=3)
                for ls in styles.values()
            ],
            list(styles),
            fontsize=7,
        )
    else:
        ax.text(
            0.5, 0.5, "not logged", ha="center", va="center", transform=ax.transAxes, color="gray"
        )


def draw_timing(ax, runs):
    """Stacked seconds per phase: per step for one run, each phase's median over the steps for
    several."""
    cmap = plt.get_cmap("tab10")
    if len(runs) == 1:
        rows = runs[0][1]
        steps = [s for s, r in sorted(rows.items()) if "timing_s/step" in r]
        bars = {p: [rows[s].get(f"timing_s/{p}", 0.0) for s in steps] for p in PHASES}
        x, labels = steps, None
        ax.set_xlabel("step")
    else:
        bars = {}
        for p in PHASES:
            bars[p] = []
            for _, rows in runs:
                timed = [r for r in rows.values() if "timing_s/step" in r]
                bars[p].append(
                    statistics.median([r.get(f"timing_s/{p}", 0.0) for r in timed] or [0.0])
                )
        x, labels = list(range(len(runs))), [name for name, _ in runs]
    bottom = [0.0] * len(x)
    for i, p in enumerate(PHASES):
        # a phase this algorithm does not have (GRPO: values, update_critic) is left out
        if any(bars[p]):
            ax.bar(x, bars[p], bottom=bottom, color=cmap(i), label=p)
            bottom = [b + v for b, v in zip(bottom, bars[p])]
    if labels:
        ax.set_xticks(x, labels, rotation=15, fontsize=8)
    ax.set_title(
        "time per step (s), by phase" + (" (median per phase)" if labels else ""), fontsize=10
    )
    if any(bottom):
        ax.legend(fontsize=7)
    else:
        ax.text(
            0.5, 0.5, "not logged", ha="center", va="center", transform=ax.transAxes, color="gray"
        )


def plot(paths, out, labels=None, x="step"):
    """Draw the runs at `paths` into the PNG `out`; `labels` names them in the legend (default:
    their folder or file names); `x`: "step", or "minutes" of training (`training_minutes`)."""
    if x not in X_LABELS:
        raise SystemExit(f"plot.py: --x {x}: use one of {', '.join(X_LABELS)}")
    runs = [load_run(p) for p in paths]
    if labels:
        if len(labels) != len(runs):
            raise SystemExit(
                f"plot.py: {len(labels)} --labels for {len(runs)} runs; give one label per run"
            )
        runs = [(label, rows) for label, (_, rows) in zip(labels, runs)]
    colors = [plt.get_cmap("tab10")(i % 10) for i in range(len(runs))]
    fig, axes = plt.subplots(2, 3, figsize=(15, 8))
    axes = axes.ravel()
    draw_lines(axes[0], runs, *LINE_PANELS[0], colors, x)
    draw_validation(axes[1], runs, colors, x)
    for ax, (title, keys) in zip(axes[2:5], LINE_PANELS[1:]):
        draw_lines(ax, runs, title, keys, colors, x)
    draw_timing(axes[5], runs)
    handles, labels = axes[0].get_legend_handles_labels()
    if handles:
        fig.legend(handles, labels, loc="upper center", ncol=min(len(runs), 6), fontsize=9)
    # steps are whole numbers; the time panel is per step for one run, its ticks name the runs for
    # several
    for ax in ([] if x == "minutes" else list(axes[:5])) + ([axes[5]] if len(runs) == 1 else []):
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    for ax in axes[:5]:
        ax.grid(alpha=0.3)
    fig.tight_layout(rect=(0, 0, 1, 0.95))
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "runs", nargs="+", help="run folders (holding metrics.jsonl) or .jsonl files"
    )
    parser.add_argument("--out", default="metrics.png", help="the PNG to write")
    parser.add_argument(
        "--labels", nargs="+", help="the runs' names in the legend, one per run, in order"
    )
    parser.add_argument(
        "--x",
        default="step",
        choices=list(X_LABELS),
        help="the line panels against the step, or against minutes of training",
    )
    cli = parser.parse_args()
    print(f"wrote {plot(cli.runs, cli.out, cli.labels, cli.x)}")
