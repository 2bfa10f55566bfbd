"""The package's shape: the import contract in pyproject.toml holds, no module imports itself through a circle, the
public API is `grpo_accel`'s `__all__` (typed, documented, cheap to import), and examples import only from it.

    pytest tests/test_architecture.py
"""

import importlib
import re
import subprocess
import sys
from pathlib import Path

import grimp
import pytest

ROOT = Path(__file__).resolve().parent.parent


def test_import_contract_holds():
    """lint-imports reads [tool.importlinter] in pyproject.toml; a broken rule is named in its output."""
    out = subprocess.run([sys.executable, "-c", "from importlinter.cli import lint_imports_command; "
                          "lint_imports_command()"], cwd=ROOT, capture_output=True, text=True)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-2000:]
    assert "0 broken" in out.stdout


def test_the_contract_catches_a_wrong_import(tmp_path):
    """The same contract on a copy of the package with one upward import (offload importing the trainer) fails."""
    import shutil

    shutil.copytree(ROOT / "grpo_accel", tmp_path / "grpo_accel", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    stash = tmp_path / "grpo_accel" / "offload" / "stash.py"
    stash.write_text(stash.read_text() + "\nfrom grpo_accel.trainer import config  # noqa\n")
    out = subprocess.run([sys.executable, "-c", "import sys; sys.path.insert(0, '.'); "
                          "from importlinter.cli import lint_imports_command; lint_imports_command()"],
                         cwd=tmp_path, capture_output=True, text=True)
    assert out.returncode != 0
    assert "grpo_accel.offload.stash -> grpo_accel.trainer.config" in out.stdout


def test_no_import_circles():
    graph = grimp.build_graph("grpo_accel")
    circles = [(a, b) for a in sorted(graph.modules) for b in graph.find_modules_directly_imported_by(a)
               if graph.find_shortest_chain(importer=b, imported=a)]
    assert not circles, circles


def test_every_folder_says_its_job():
    for init in sorted((ROOT / "grpo_accel").rglob("__init__.py")):
        module = ".".join(init.relative_to(ROOT).parent.parts)
        doc = importlib.import_module(module).__doc__
        assert doc and len(doc.strip()) > 40, module


def test_public_api_is_all_and_documented():
    import grpo_accel

    assert set(grpo_accel.__all__) >= {"GRPOAccelTrainer", "GRPOAccelConfig", "get_preset", "list_presets",
                                       "plan_memory", "model_shape"}
    for name in grpo_accel.__all__:
        obj = getattr(grpo_accel, name)
        assert obj.__doc__ and obj.__doc__.strip(), name
    with pytest.raises(AttributeError):
        grpo_accel.not_a_public_name  # noqa: B018


def test_import_grpo_accel_is_cheap():
    """Planning or reading a preset must not pay for TRL and transformers' trainer (names load on first use)."""
    code = "import sys, grpo_accel; print('trl' in sys.modules, 'transformers' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False", "False"]


def test_examples_import_only_the_public_api():
    """README and docs code blocks reach grpo_accel through `from grpo_accel import ...` only."""
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    bad = []
    for page in pages:
        for block in re.findall(r"```python\n(.*?)```", page.read_text(), re.S):
            bad += [f"{page.name}: {line.strip()}" for line in block.splitlines()
                    if re.match(r"\s*(from grpo_accel\.|import grpo_accel\.)", line)]
    assert not bad, bad


def private_imports(package: Path) -> list[str]:
    """`from grpo_accel.X import _name` in a module other than X's own package `__init__` re-exporting it: a private
    name used across modules (issue 37: what one module needs of another is public, named for what it does)."""
    import ast

    bad = []
    for path in sorted(package.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("grpo_accel"):
                bad += [f"{path.relative_to(package.parent)}: {node.module}.{a.name}" for a in node.names
                        if a.name.startswith("_") and not a.name.startswith("__")]
    return bad


def test_no_module_imports_another_modules_private_name(tmp_path):
    assert private_imports(ROOT / "grpo_accel") == []
    # the check itself catches one
    (tmp_path / "grpo_accel").mkdir()
    (tmp_path / "grpo_accel" / "m.py").write_text("from grpo_accel.tiling.layer import _hidden\n")
    assert private_imports(tmp_path / "grpo_accel") == ["grpo_accel/m.py: grpo_accel.tiling.layer._hidden"]
