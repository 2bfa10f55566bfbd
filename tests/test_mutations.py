"""The mutation check's own machinery (tests/mutations.py) on a two-file project: a bug its test catches is killed, the
same bug against a weakened test survives and fails the check, a pattern that moved is named, a test that fails
unmutated is no kill, and the file is restored even when the run is interrupted. The rows themselves are checked by
running the check (`make test-mutations`, docs/testing.md)."""

import sys

import mutations as mt
import pytest

CODE = "def bound_ok(staleness, bound):\n    return staleness <= bound\n"
TEST = "from rules import bound_ok\n\n\ndef test_at_the_bound():\n    assert bound_ok(1, 1)\n"
WEAK = "from rules import bound_ok\n\n\ndef test_at_the_bound():\n    assert bound_ok(0, 1)\n"
OFF_BY_ONE = mt.Mutation("x", "`<=` -> `<`", "rules.py", "staleness <= bound", "staleness < bound",
                         ("test_rules.py::test_at_the_bound",))


def project(tmp_path, test=TEST):
    (tmp_path / "rules.py").write_text(CODE)
    (tmp_path / "test_rules.py").write_text(test)
    return str(tmp_path)


def run(tree, *mutations, **kw):
    lines = []
    out = mt.check(list(mutations), tree, {"main": sys.executable, "vllm": None}, say=lines.append, **kw)
    return out, "\n".join(lines)


def test_a_caught_bug_is_killed_and_the_file_restored(tmp_path):
    tree = project(tmp_path)
    out, said = run(tree, OFF_BY_ONE)
    assert out["killed"] == ["x"] and (tmp_path / "rules.py").read_text() == CODE, said


def test_a_weakened_test_lets_the_bug_survive_and_the_check_fail(tmp_path):
    out, said = run(project(tmp_path, test=WEAK), OFF_BY_ONE)
    assert out["survived"] == ["x"] and "x: SURVIVED" in said


def test_a_moved_pattern_a_missing_venv_and_a_failing_test_are_no_kills(tmp_path):
    tree = project(tmp_path)
    moved = mt.Mutation("moved", "gone", "rules.py", "staleness =< bound", "x", OFF_BY_ONE.tests)
    engine = mt.Mutation("engine", "vLLM's", "rules.py", "staleness <= bound", "x", OFF_BY_ONE.tests, venv="vllm")
    out, said = run(tree, moved, engine)
    assert out["unmatched"] == ["moved"] and out["skipped"] == ["engine"] and "needs .venv-vllm" in said
    (tmp_path / "test_rules.py").write_text(TEST.replace("bound_ok(1, 1)", "not bound_ok(1, 1)"))
    out, said = run(tree, OFF_BY_ONE)
    assert out["broken"] == ["x"] and not out["killed"], said


def test_an_interrupted_run_restores_the_file(tmp_path, monkeypatch):
    tree = project(tmp_path)

    def interrupted(*a, **k):
        assert "staleness < bound" in (tmp_path / "rules.py").read_text()  # the bug is in while its tests run
        raise KeyboardInterrupt

    monkeypatch.setattr(mt, "pytest", interrupted)
    with pytest.raises(KeyboardInterrupt):
        run(tree, OFF_BY_ONE, baseline=False)
    assert (tmp_path / "rules.py").read_text() == CODE


def test_every_rows_pattern_is_in_its_file_once():
    """The rows against this tree, without running a test: a refactor that moves a row's line makes the check say
    UNMATCHED only when someone runs it (minutes); here it fails `make test` naming the row to update."""
    from pathlib import Path

    root = Path(mt.__file__).resolve().parents[1]
    moved = [m.name for m in mt.MUTATIONS if (root / m.path).read_text().count(m.pattern) != 1]
    assert not moved, f"rows whose pattern is not in their file exactly once: {moved}"
