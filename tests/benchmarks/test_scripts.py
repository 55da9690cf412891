"""Every user benchmark at the top of benchmarks/: its ``--help`` works, benchmarks/README.md
lists it and a docs page cites its command."""

import runpy
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BENCHMARKS = ROOT / "benchmarks"
SCRIPTS = sorted(BENCHMARKS.glob("*.py"))
DOCS = "\n".join(p.read_text() for p in sorted((ROOT / "docs").rglob("*.md")))


def test_the_benchmarks_folder_has_scripts():
    assert len(SCRIPTS) >= 10, SCRIPTS


@pytest.mark.parametrize("script", SCRIPTS, ids=[p.name for p in SCRIPTS])
def test_help_listing_and_citation(script, monkeypatch, capsys):
    monkeypatch.syspath_prepend(str(BENCHMARKS))  # as when run as a script from there
    monkeypatch.setattr(sys, "argv", [str(script), "--help"])
    with pytest.raises(SystemExit) as exit_:
        runpy.run_path(str(script), run_name="__main__")
    assert exit_.value.code == 0
    assert capsys.readouterr().out.startswith("usage:")
    assert f"| `{script.name}` |" in (BENCHMARKS / "README.md").read_text()
    assert f"benchmarks/{script.name}" in DOCS, f"no docs page cites {script.name}"
