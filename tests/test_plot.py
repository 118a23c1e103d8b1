"""plot.py draws a GRPO run and a PPO run (with the critic's metrics, without validation on one
step) on one figure, and one run alone; it writes a non-empty PNG either way."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

import plot

ROOT = Path(__file__).resolve().parents[1]


def write_run(folder, steps, critic):
    folder.mkdir(parents=True)
    rows = [
        {
            "step": 0,
            "val-core/arith/reward/mean@1": 0.1,
            "val-core/arith/reward_flexible/mean@1": 0.2,
        }
    ]
    for s in range(1, steps + 1):
        row = {
            "step": s,
            "critic/score/mean": 0.1 * s,
            "response_length/mean": 4.0,
            "actor/entropy": 0.5 / s,
            "timing_s/gen": 1.0,
            "timing_s/old_log_prob": 0.5,
            "timing_s/adv": 0.01,
            "timing_s/update_actor": 2.0,
            "timing_s/update_weights": 0.1,
            "timing_s/step": 3.7,
            "critic/score_flexible/mean": float("nan"),
        }
        if critic:  # PPO: a critic, KL in the reward
            row |= {
                "timing_s/values": 0.4,
                "timing_s/update_critic": 1.0,
                "actor/reward_kl_penalty": 0.01 * s,
            }
        else:
            row |= {"timing_s/ref": 0.5, "actor/kl_loss": 0.001 * s}
        if s == steps:
            row["val-core/arith/reward/mean@1"] = 0.5
        rows.append(row)
    with open(folder / "metrics.jsonl", "w") as f:
        # nan is written as NaN, as the trainer does
        f.writelines(json.dumps(r) + "\n" for r in rows)
    return folder


def test_two_runs_on_one_figure(tmp_path):
    grpo = write_run(tmp_path / "grpo_run", 5, critic=False)
    ppo = write_run(tmp_path / "ppo_run", 3, critic=True)
    out = tmp_path / "figs" / "both.png"
    assert plot.plot([grpo, ppo / "metrics.jsonl"], out) == out
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 10_000
    assert [plot.load_run(p)[0] for p in (grpo, ppo / "metrics.jsonl")] == ["grpo_run", "ppo_run"]


def test_command_line_one_run(tmp_path):
    run = write_run(tmp_path / "run", 2, critic=False)
    proc = subprocess.run(
        [sys.executable, "plot.py", str(run), "--out", str(tmp_path / "one.png")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert (tmp_path / "one.png").stat().st_size > 10_000


def test_labels_name_the_runs_and_the_validation_legend_names_line_styles(tmp_path, monkeypatch):
    """--labels replace the folder names in the figure's legend; with several runs the validation
    panel's legend names data sources and line styles only (the colour names the run), so it stays
    small however many runs are drawn. A label count that does not match the runs is refused."""
    runs = [write_run(tmp_path / f"run{i}", 3, critic=False) for i in range(3)]
    figures = []
    monkeypatch.setattr(plot.plt, "close", figures.append)
    plot.plot(runs, tmp_path / "three.png", labels=["lr 1e-6", "lr 5e-6", "lr 1e-5"])
    fig = figures[0]
    assert [t.get_text() for t in fig.legends[0].get_texts()] == ["lr 1e-6", "lr 5e-6", "lr 1e-5"]
    validation = fig.axes[1]
    assert [t.get_text() for t in validation.get_legend().get_texts()] == [
        "arith",
        "arith (flexible)",
    ]
    assert len(validation.get_lines()) == 6  # strict and flexible for each run
    assert [t.get_text() for t in fig.axes[5].get_xticklabels()] == [
        "lr 1e-6",
        "lr 5e-6",
        "lr 1e-5",
    ]
    # a shaped reward's strict score ("acc") gets its own line style
    rows = {0: {"step": 0, "val-core/a/reward/mean@1": 0.1, "val-core/a/acc/mean@1": 0.0}}
    ax = plot.plt.figure().add_subplot()
    plot.draw_validation(ax, [("r", rows)], ["C0"])
    assert [t.get_text() for t in ax.get_legend().get_texts()] == ["a (acc)", "a"]
    assert [line.get_linestyle() for line in ax.get_lines()] == [":", "-"]
    with pytest.raises(SystemExit, match="2 --labels for 3 runs"):
        plot.plot(runs, tmp_path / "bad.png", labels=["a", "b"])
    assert not (tmp_path / "bad.png").exists()


def test_against_training_minutes(tmp_path, monkeypatch):
    """--x minutes: each point at the sum of timing_s/step so far (3.7 s a step; the validation
    before step 1 at 0), so runs whose steps take different times line up by the time they
    trained."""
    run = write_run(tmp_path / "run", 3, critic=False)
    assert plot.training_minutes(plot.load_run(run)[1]) == pytest.approx(
        {0: 0.0, 1: 3.7 / 60, 2: 7.4 / 60, 3: 11.1 / 60}
    )
    figures = []
    monkeypatch.setattr(plot.plt, "close", figures.append)
    plot.plot([run], tmp_path / "minutes.png", x="minutes")
    validation = figures[0].axes[1]
    # steps 0 and 3
    assert list(validation.get_lines()[0].get_xdata()) == pytest.approx([0.0, 11.1 / 60])
    assert list(figures[0].axes[0].get_lines()[0].get_xdata()) == pytest.approx(
        [3.7 / 60, 7.4 / 60, 11.1 / 60]
    )
    assert (
        validation.get_xlabel() == "training time (min)"
        and figures[0].axes[5].get_xlabel() == "step"
    )
    with pytest.raises(SystemExit, match="--x hours: use one of step, minutes"):
        plot.plot([run], tmp_path / "bad.png", x="hours")
