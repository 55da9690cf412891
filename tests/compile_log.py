"""Where a test run's compile time goes: an opt-in pytest plugin, and its summary.

    COMPILE_LOG=/tmp/run pytest -p tests.compile_log -n 2 tests/ops ...
    python -m tests.compile_log /tmp/run

The plugin times each XLA compile (``jax._src.compiler.backend_compile_and_load``, with the
program's name) and each lowering to StableHLO (``mlir.lower_jaxpr_to_module``) in every pytest
process, against the test that runs it, and writes them to ``$COMPILE_LOG.<worker>.json`` at
the end. A program read back from the persistent cache is not compiled, so it is not counted.
The summary prints the totals and the test functions and program names with the most compile
seconds. Both wrap JAX internals, which may move between versions; they serve measurement only.
"""

from __future__ import annotations

import collections
import glob
import json
import os
import sys
import time

import pytest

_LOG: list[tuple[str | None, str, str, float]] = []  # (test id, "compile"/"lower", name, s)
_TEST: dict[str, str | None] = {"id": None}


def _timed(kind: str, fn, name_of):
    def wrapped(*args, **kwargs):
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            _LOG.append((_TEST["id"], kind, name_of(args), time.perf_counter() - start))
    return wrapped


def _module_name(args) -> str:
    from jax._src.lib.mlir import ir
    return ir.StringAttr(args[1].operation.attributes["sym_name"]).value


def pytest_configure(config):
    from jax._src import compiler
    from jax._src.interpreters import mlir

    compiler.backend_compile_and_load = _timed("compile", compiler.backend_compile_and_load,
                                               _module_name)
    mlir.lower_jaxpr_to_module = _timed("lower", mlir.lower_jaxpr_to_module, lambda _: "")


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item, nextitem):
    _TEST["id"] = item.nodeid
    return (yield)


def pytest_unconfigure(config):
    out = os.environ.get("COMPILE_LOG")
    if out:
        with open(f"{out}.{os.environ.get('PYTEST_XDIST_WORKER', 'main')}.json", "w") as f:
            json.dump(_LOG, f)


def summary(prefix: str, top: int = 25) -> str:
    """The totals of every ``{prefix}.*.json``, then the ``top`` test functions and program
    names by compile seconds."""
    rows = [row for path in sorted(glob.glob(f"{prefix}.*.json"))
            for row in json.load(open(path))]
    if not rows:
        raise SystemExit(f"no {prefix}.*.json files")
    seconds: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    count: collections.Counter = collections.Counter()
    for test, kind, name, s in rows:
        function = (test or "(outside a test)").split("[")[0]
        seconds[kind][function] += s
        if kind == "compile":
            seconds["program"][name] += s
            count[name] += 1
    lines = [f"compile {sum(seconds['compile'].values()):.1f} s over {sum(count.values())} "
             f"programs; lowering {sum(seconds['lower'].values()):.1f} s",
             "", "compile s  lowering s  test function"]
    lines += [f"{s:9.1f}  {seconds['lower'][f]:10.1f}  {f}"
              for f, s in seconds["compile"].most_common(top)]
    lines += ["", "compile s  programs  program"]
    lines += [f"{s:9.1f}  {count[n]:8d}  {n}" for n, s in seconds["program"].most_common(top)]
    return "\n".join(lines)


if __name__ == "__main__":
    if len(sys.argv) != 2 or sys.argv[1] in ("-h", "--help"):
        print(__doc__)
        raise SystemExit(0 if len(sys.argv) == 2 else 2)
    print(summary(sys.argv[1]))
