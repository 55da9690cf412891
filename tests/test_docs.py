"""The documentation: the site builds with --strict, the API reference names every public
function and class, README.md stays short with examples that run as written, docstring
examples run, and no text speaks of how the work was organised instead of the product."""

import inspect
import os
import re
import subprocess
import sys

import numpy as np
import pytest

ROOT = os.path.join(os.path.dirname(__file__), "..")
API = os.path.join(ROOT, "docs", "api")


def _read(*parts):
    with open(os.path.join(ROOT, *parts), encoding="utf-8") as f:
        return f.read()


def test_site_builds_with_strict(tmp_path):
    # --strict: a broken link or anchor, a missing page or an unresolved reference fails
    mkdocs = os.path.join(os.path.dirname(sys.executable), "mkdocs")
    result = subprocess.run([mkdocs, "build", "--strict", "--site-dir", str(tmp_path / "site")],
                            cwd=ROOT, capture_output=True, text=True, timeout=600,
                            env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})
    assert result.returncode == 0, result.stderr[-3000:]
    page = (tmp_path / "site" / "api" / "grpo_kernels" / "index.html").read_text()
    assert "num_items_in_batch" in page  # a docstring rendered, not only a heading


def _public(module):
    names = getattr(module, "__all__", None)
    if names is None:
        names = [n for n, o in vars(module).items()
                 if not n.startswith("_") and (inspect.isfunction(o) or inspect.isclass(o))
                 and o.__module__ == module.__name__]
    return [n for n in names if not n.startswith("__")]


def test_api_reference_names_every_public_function_and_class():
    import grpo_kernels
    import grpo_kernels.integrations.tunix as tunix
    import grpo_kernels.models as models
    import grpo_kernels.sharding as sharding

    text = "".join(_read("docs", "api", f) for f in sorted(os.listdir(API)))
    listed = set(re.findall(r"^::: (\S+)$", text, flags=re.M))
    for module in (grpo_kernels, sharding, models, tunix):
        missing = [n for n in _public(module) if f"{module.__name__}.{n}" not in listed]
        assert not missing, f"{module.__name__}: not in docs/api: {missing}"


def _readme_block(name):
    text = _read("README.md")
    match = re.search(rf"\[start:{name}\] -->\n```python\n(.*?)```\n<!-- --8<-- \[end:{name}\]",
                      text, flags=re.S)
    assert match, f"README.md has no {name!r} example"
    return match.group(1)


def test_readme_is_short_and_its_examples_run():
    assert len(_read("README.md").splitlines()) <= 130
    logits = {}
    exec(compile(_readme_block("logits"), "README.md:logits", "exec"), logits)
    assert np.isfinite(float(logits["loss"]))
    assert logits["dlogits"].shape == logits["logits"].shape
    assert np.isfinite(np.asarray(logits["dlogits"], np.float32)).all()
    fused = {}
    exec(compile(_readme_block("fused"), "README.md:fused", "exec"), fused)
    assert np.isfinite(float(fused["loss"])) and fused["ref_logps"].shape == (2, 16)
    assert fused["dlm_head"].shape == fused["lm_head"].shape
    assert float(np.abs(np.asarray(fused["dhidden"], np.float32)).max()) > 0


@pytest.mark.parametrize("name", ["tunix"])
def test_readme_snippets_that_need_a_users_script_compile(name):
    compile(_readme_block(name), f"README.md:{name}", "exec")


@pytest.mark.parametrize("module", [
    "grpo_kernels.ops.logits_loss.api", "grpo_kernels.ops.lm_head_loss.api",
    "grpo_kernels.ops.logps.api", "grpo_kernels.sharding.loss", "grpo_kernels.sharding.logps",
    "grpo_kernels.integrations.tunix.log_probs"])
def test_docstring_examples_run(module):
    import doctest
    import importlib

    mod = importlib.import_module(module)
    tests = [t for t in doctest.DocTestFinder().find(mod) if t.examples]
    assert tests, f"{module} has no docstring examples"
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS)
    for test in tests:
        runner.run(test)
    assert runner.failures == 0, f"{runner.failures} failing examples in {module}"


# Words that name the work's own bookkeeping (numbered stops and issues, work periods, builds
# by their order) rather than the product: a reader cannot know what they referred to.
PROCESS_WORDS = re.compile(
    r"\bstops? \d|\bsessions?\b|\bissues? #?\d|\bissue-\d|\b(the|this|an|its) issue\b"
    r"|\b(this|previous|earlier|older|first|second|third) build\b|_stop\d", re.IGNORECASE)


def _text_files():
    yield "README.md"
    yield "CHANGELOG.md"
    for top, suffixes in (("docs", (".md",)), ("src", (".py",)), ("tests", (".py",)),
                          ("configs", (".yaml",))):
        for folder, _, files in os.walk(os.path.join(ROOT, top)):
            for name in files:
                if name.endswith(suffixes):
                    yield os.path.relpath(os.path.join(folder, name), ROOT)


def test_no_process_words():
    hits = [f"{path}:{number}: {line.strip()}"
            for path in _text_files()
            for number, line in enumerate(_read(path).splitlines(), start=1)
            if PROCESS_WORDS.search(line)]
    assert not hits, "\n".join(hits[:40])


def _results_tables() -> tuple[str, str]:
    """docs/results.md's claims, and its table of raw files."""
    claims, _, raw = _read("docs", "results.md").partition("## Raw results files")
    return claims, raw


def test_every_results_row_cites_its_command_commit_and_an_existing_file():
    rows = [line for line in _results_tables()[0].splitlines()
            if line.startswith("| ") and not line.startswith("| claim") and "---" not in line]
    assert len(rows) >= 10
    results = os.path.join(ROOT, "benchmarks", "results")
    for row in rows:
        cells = [c.strip() for c in row.strip("|").split("|")]
        assert any(c.startswith("`") and ("python" in c or "make" in c or "grpo-kernels" in c
                                          or "benchmarks/" in c) for c in cells), row
        assert any(re.fullmatch(r"[0-9a-f]{7,40}", c) for c in cells), row
        files = re.findall(r"`([\w.\-]+\.(?:jsonl?|md|txt|csv))`", row)
        assert files and all(os.path.isfile(os.path.join(results, f)) for f in files), row


def test_the_results_page_lists_every_raw_file_and_no_other():
    listed = set(re.findall(r"`([\w.\-]+\.(?:jsonl?|md|txt|csv|png))`", _results_tables()[1]))
    present = set(os.listdir(os.path.join(ROOT, "benchmarks", "results")))
    assert listed == present, (sorted(present - listed), sorted(listed - present))
