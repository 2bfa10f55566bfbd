"""Each results CSV has its card (benchmarks/cards.py: the command, each run's machine, versions, date, sha and
table), and the committed cards are what the CSVs give: a CSV rerun without its card fails here, naming the fix."""

import csv
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import cards  # noqa: E402


def test_the_committed_cards_are_what_the_csvs_give():
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "cards.py"), "--check"], capture_output=True,
                          text=True)
    assert proc.returncode == 0, proc.stderr


def test_a_card_names_every_run_of_its_csv(tmp_path):
    rows = [dict(op="op", impl=i, shape="s", metric="m", value=str(v), unit="s", device=d, versions="torch=x",
                 git_sha=sha, date=date) for i, v, d, sha, date in
            (("a", 1.5, "cpu", "abc1234", "2026-12-01"), ("b", 2, "cpu", "abc1234", "2026-12-01"),
             ("a", 3.25, "NVIDIA H200", "def5678", "2026-12-02"))]
    path = tmp_path / "made_up.csv"
    with path.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    text = cards.card(path)
    assert "## 2026-12-02, def5678: NVIDIA H200" in text and "## 2026-12-01, abc1234: cpu" in text
    assert text.index("2026-12-02") < text.index("2026-12-01")  # the newest run first
    assert "| op | a | s | m | 3.25 | s |" in text and "| op | b | s | m | 2 | s |" in text
