"""Run artifacts: per-step metrics CSV/JSON and the reward-curve PNG, from a Trainer's log history.

    grpo-accel report runs/demo      # re-renders the PNGs of a finished (or crashed) run
"""

from __future__ import annotations

import csv
import io
import json
import os
import tempfile


def atomic_write_text(path: str, text: str) -> None:
    """Write via a temporary file + rename, so a crash never leaves a half-written artifact."""
    directory = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=".tmp-")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def step_rows(log_history: list[dict]) -> list[dict]:
    """One row per logged training step (the final summary entry, with train_runtime, is left out)."""
    return [row for row in log_history if "step" in row and "train_runtime" not in row and "loss" in row]


def write_metrics_csv(rows: list[dict], path: str) -> None:
    keys = ["step"] + sorted({k for row in rows for k in row} - {"step"})
    buffer = io.StringIO(newline="")
    writer = csv.DictWriter(buffer, fieldnames=keys)
    writer.writeheader()
    writer.writerows(rows)
    atomic_write_text(path, buffer.getvalue())


def read_metrics_csv(path: str) -> list[dict]:
    with open(path, newline="") as f:
        return [{k: float(v) for k, v in row.items() if v not in ("", None)} for row in csv.DictReader(f)]


def moving_average(values: list[float], window: int) -> list[float]:
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v
        if i >= window:
            total -= values[i - window]
        out.append(total / min(i + 1, window))
    return out


def plot_reward_curve(rows: list[dict], path: str, title: str = "GRPO reward", accuracy: dict | None = None) -> None:
    """Reward per step with a moving average (single-step reward is noisy: 2 prompts per step)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [r["step"] for r in rows if "reward" in r]
    rewards = [r["reward"] for r in rows if "reward" in r]
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(steps, rewards, ".", alpha=0.35, label="reward per step")
    if rewards:
        window = max(3, len(rewards) // 10)
        ax.plot(steps, moving_average(rewards, window), "-", lw=2, label=f"moving average ({window} steps)")
    if accuracy:
        ax.set_title(f"{title}\nheld-out accuracy {accuracy.get('before', float('nan')):.0%} → "
                     f"{accuracy.get('after', float('nan')):.0%}")
    else:
        ax.set_title(title)
    integer_steps(ax)
    ax.set_xlabel("step")
    ax.set_ylabel("mean reward")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path + ".tmp.png", dpi=120)
    plt.close(fig)
    os.replace(path + ".tmp.png", path)


def write_json(obj, path: str) -> None:
    atomic_write_text(path, json.dumps(obj, indent=2, default=str) + "\n")


SERIES_STYLES = ("-", "--", ":", "-.")
SERIES_MARKERS = ("o", "s", "^", "D", "v", "x")


def integer_steps(ax) -> None:
    """Steps are whole numbers: no 0.5 ticks on a two-step run."""
    from matplotlib.ticker import MaxNLocator

    ax.xaxis.set_major_locator(MaxNLocator(integer=True))


def _plot_series(rows, keys: dict[str, str], path: str, title: str, ylabel: str) -> bool:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    present = {k: label for k, label in keys.items() if any(k in r for r in rows)}
    if not present:
        return False
    fig, ax = plt.subplots(figsize=(7, 4))
    for i, (key, label) in enumerate(present.items()):
        pts = [(r["step"], r[key]) for r in rows if key in r]
        # series often coincide (phases with the same peak): each its own dash, hollow marker and width, drawn
        # widest first, so a line under another still shows
        ax.plot([p[0] for p in pts], [p[1] for p in pts], linestyle=SERIES_STYLES[i % len(SERIES_STYLES)],
                marker=SERIES_MARKERS[i % len(SERIES_MARKERS)], markerfacecolor="none",
                lw=max(3.5 - 0.6 * i, 1.0), label=label)
    integer_steps(ax)
    ax.set_title(title)
    ax.set_xlabel("step")
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path + ".tmp.png", dpi=120)
    plt.close(fig)
    os.replace(path + ".tmp.png", path)
    return True


def render_report(run_dir: str) -> list[str]:
    """PNGs for a run directory (finished or crashed): reward (+ held-out accuracy before → after),
    correctness/format rewards, completion length, peak memory per phase. Returns the files written."""
    metrics = os.path.join(run_dir, "metrics.csv")
    if not os.path.exists(metrics):
        raise FileNotFoundError(f"{metrics} not found. Fix: point at a run directory made by launch/train.py.")
    rows = read_metrics_csv(metrics)
    summary_path = os.path.join(run_dir, "summary.json")
    summary = json.load(open(summary_path)) if os.path.exists(summary_path) else {}
    acc = None
    if "before" in summary and "after" in summary:
        acc = {"before": summary["before"]["accuracy_lenient"], "after": summary["after"]["accuracy_lenient"]}
    written = [os.path.join(run_dir, "reward_curve.png")]
    plot_reward_curve(rows, written[0], title=os.path.basename(os.path.normpath(run_dir)), accuracy=acc)
    reward_keys = {k: k.split("/")[1] for r in rows for k in r if k.startswith("rewards/") and k.endswith("/mean")}
    plots = [
        ("rewards.png", reward_keys, "reward per function", "mean reward"),
        ("completion_length.png", {"completions/mean_length": "mean", "completions/max_length": "max",
                                   "completions/min_length": "min"}, "completion length", "tokens"),
        ("memory_phases.png", {k: k.removeprefix("memory/") for r in rows for k in r if k.startswith("memory/")},
         "peak memory per phase (CUDA: allocated; CPU: process RSS)", "GiB"),
    ]
    for name, keys, title, ylabel in plots:
        path = os.path.join(run_dir, name)
        if _plot_series(rows, keys, path, title, ylabel):
            written.append(path)
    return written
