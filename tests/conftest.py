"""Strict JAX settings for every test (after equinox's tests/conftest.py), and a faster compiler.

The tests' shapes are tiny, so compiling, not running, is most of the suite's time. LLVM's
backend optimisation level 0 compiles the same HLO about 35% faster here and leaves alone what
the tests read: the float operations and their order (XLA's HLO fixes them; the level changes at
most whether a multiply and an add fuse, one rounding) and the HLO passes (fusion, buffer
assignment) behind the memory and lowering tests. One LLVM module per program instead of
XLA:CPU's split into parts for parallel code generation (which two cores do not repay) takes
another tenth or so off jaxlib 0.10.2's compile time (nothing on 0.12's); the code of each
function is the same. Both must be in XLA_FLAGS before a JAX backend starts; subprocesses the
tests spawn inherit them. A value the caller set wins. XLA:CPU's legacy emitters compile every
test but those marked ``default_emitters``, which run last, on the default ones
(:data:`FAST_EMITTERS` says why and how).

Many tests compile the same program (one loss at one shape, under another test's name, in
another worker, or in a subprocess of the proof's dry runs), so every run shares JAX's
persistent compilation cache in a temporary directory of its own: made by the first pytest
process (xdist's controller, before its workers start; they and every subprocess inherit it
through the environment), removed when that process ends. Nothing survives the run, so each
run compiles from nothing as CI does. A ``JAX_COMPILATION_CACHE_DIR`` the caller set wins
(and is left in place): ``make test`` sets one for its two runs and removes it at the end.
"""

import collections
import os
import shutil
import sys
import tempfile

COMPILER_FLAGS = {"xla_backend_optimization_level": 0, "xla_cpu_parallel_codegen_split_count": 1}
for _flag, _value in COMPILER_FLAGS.items():
    if _flag not in os.environ.get("XLA_FLAGS", ""):
        os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} --{_flag}={_value}".strip()

# Every test lowers for this host's CPU but the few that lower for a GPU or TPU, which say so
# (tests.helpers.every_platform; the TPU-compile scripts trace every branch themselves): the
# ops' per-platform branches (grpo_kernels.ops.core.platform) of the other kinds are not traced
# (tests/README.md measures it). A value the caller set wins.
os.environ.setdefault("GRPO_KERNELS_PLATFORMS", "cpu")


def _pin_worker() -> None:
    """Each xdist worker on a core of its own, where there are as many workers as cores.

    Unpinned, two workers and the threads XLA starts for each of their compiles share both
    cores, and the runs take a few percent longer (tests/README.md measures it). This runs
    before any JAX thread starts: the threads XLA starts, and the processes a test starts,
    inherit the core.
    """
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    count = os.environ.get("PYTEST_XDIST_WORKER_COUNT")
    if not worker.startswith("gw") or count is None or not hasattr(os, "sched_getaffinity"):
        return
    cpus = sorted(os.sched_getaffinity(0))
    if int(count) == len(cpus):
        os.sched_setaffinity(0, {cpus[int(worker[2:]) % len(cpus)]})


_pin_worker()
_OWNED_CACHE = None
if not os.environ.get("JAX_COMPILATION_CACHE_DIR"):
    _OWNED_CACHE = tempfile.mkdtemp(prefix="grpo_kernels_jax_cache_")
    os.environ["JAX_COMPILATION_CACHE_DIR"] = _OWNED_CACHE
    # Every program, however quick to compile: at the tests' shapes most compile in well under
    # the default second, and reading one back is faster still.
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "-1")

import jax  # noqa: E402
import pytest  # noqa: E402

if _OWNED_CACHE is not None:  # also where a plugin imported JAX before the environment was set
    jax.config.update("jax_compilation_cache_dir", _OWNED_CACHE)
    jax.config.update("jax_persistent_cache_min_compile_time_secs",
                      float(os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"]))
    jax.config.update("jax_persistent_cache_min_entry_size_bytes",
                      int(os.environ["JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES"]))

jax.config.update("jax_numpy_rank_promotion", "raise")
jax.config.update("jax_numpy_dtype_promotion", "strict")


@pytest.fixture(autouse=True)
def _no_implicit_rank_promotion():
    yield


def pytest_addoption(parser):
    parser.addoption("--tunix-grid", choices=("full", "pairwise"), default="pairwise",
                     help="tests/integrations/test_tunix.py's parity grid: every pair of "
                     "options (default) or every combination (full)")
    parser.addoption("--mesh-grid", choices=("full", "pairwise"), default="pairwise",
                     help="tests/sharding/test_sharding.py::test_equals_one_device's grid: "
                     "every pair of levels of its factors (default) or every combination (full)")


# XLA:CPU's fusion emitters (its default code generator) are about a quarter of the suite's
# compile time. Most tests check math, which the legacy emitters compile from the same HLO
# operations in the same order; but the fusion pass differs with the emitters (single operations
# left unfused, a bitcast and a copy for a fused convert), so the buffer assignment, the
# optimised HLO and its cost do too. A test that reads one of those (memory_analysis, the
# optimised HLO, its cost analysis), in its process or in one it starts, or whose exact ties
# depend on XLA:CPU's rounding, is marked ``default_emitters``.
#
# Every process of a run starts on the legacy emitters (XLA_FLAGS, before a backend starts;
# xdist's workers inherit it), and the marked tests are moved to the end of the run, so that
# each worker passes from the one kind of test to the other once. There, the worker clears
# JAX's in-memory caches (no program compiled on the legacy emitters is reused), asks for the
# default emitters in every CPU compile it makes from then on (an XLA option of the compile, so
# part of the persistent cache's key: a program is never read back compiled the other way),
# and takes the flag out of XLA_FLAGS for the processes its tests start. A caller's own
# ``--xla_cpu_use_fusion_emitters`` in XLA_FLAGS wins, as on jaxlib 0.12, which has no legacy
# emitters (XLA aborts on the flag there, so a child process is asked first).
EMITTER_OPTION = "xla_cpu_use_fusion_emitters"  # XLA's debug option, by flag or per compile
FAST_EMITTERS = f"--{EMITTER_OPTION}=false"
MARK = "default_emitters"
_PLAN_READS = ("memory_analysis", "as_text", "cost_analysis")
_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_READERS = tuple(os.path.join(_REPO, d) + os.sep for d in ("tests", "benchmarks"))
# Whether this process switches between the emitters (it started on the legacy ones), and
# whether it now compiles on the default ones (set per test by pytest_runtest_protocol below).
_EMITTERS = {"switching": False, "default": True}


def run_order(items: list) -> list:
    """``items`` with the ``default_emitters`` tests after the others, and in each group the
    ``slow`` ones first, each in its order: the longest tests start early, so that neither
    worker is left running one alone at the end."""
    return sorted(items, key=lambda item: (item.get_closest_marker(MARK) is not None,
                                           item.get_closest_marker("slow") is None))


def _refuse_plan_reads() -> None:
    """Fail a test's (or a benchmark's) read of a compiled program's plan while the process
    compiles on the legacy emitters, whose plans are not the ones users get. The library's own
    reads (the trainer's and the bench command's reports) go on: a test that asserts on those
    is marked by hand."""
    from jax.stages import Compiled

    def guarded(name):
        read = getattr(Compiled, name)

        def method(self, *args, **kwargs):
            caller = sys._getframe(1).f_code.co_filename
            if not _EMITTERS["default"] and caller.startswith(_READERS):
                raise AssertionError(
                    f"{caller} reads Compiled.{name}() in a test on {FAST_EMITTERS}: mark the "
                    f"test {MARK} (tests/conftest.py)")
            return read(self, *args, **kwargs)
        return method

    for name in _PLAN_READS:
        setattr(Compiled, name, guarded(name))


def _ask_default_emitters_per_compile() -> None:
    """Make every CPU compile of this process, while ``_EMITTERS["default"]``, override the
    process's legacy emitters with the default ones (jax's compile options take any XLA debug
    option by name; one the compile sets itself wins)."""
    from jax._src import compiler

    plain = compiler.get_compile_options

    def get_compile_options(*args, env_options_overrides=None, backend=None, **kwargs):
        if _EMITTERS["default"] and getattr(backend, "platform", None) == "cpu":
            env_options_overrides = {EMITTER_OPTION: True,
                                     **(env_options_overrides or {})}
        return plain(*args, env_options_overrides=env_options_overrides, backend=backend,
                     **kwargs)

    compiler.get_compile_options = get_compile_options


def use_default_emitters(default: bool) -> None:
    """Compile on the default emitters from now on (``default``) or on the legacy ones, here
    and in the processes started from here; a no-op in a process that does not switch."""
    if not _EMITTERS["switching"] or _EMITTERS["default"] == default:
        return
    if default:
        jax.clear_caches()
    _EMITTERS["default"] = default
    flags = os.environ["XLA_FLAGS"].replace(FAST_EMITTERS, "").split()
    os.environ["XLA_FLAGS"] = " ".join(flags if default else [*flags, FAST_EMITTERS])


def pytest_configure(config):
    config.addinivalue_line(
        "markers", f"{MARK}: reads an XLA:CPU compile plan (memory, optimised HLO, cost) or an "
        "exact tie, so it runs on XLA:CPU's default emitters (tests/conftest.py)")
    if f"--{EMITTER_OPTION}" in os.environ["XLA_FLAGS"].replace(FAST_EMITTERS, ""):
        return  # the caller's choice
    if FAST_EMITTERS not in os.environ["XLA_FLAGS"]:
        if not _xla_takes(FAST_EMITTERS):
            return
        # Before any backend starts (collection comes later); xdist's workers inherit it.
        os.environ["XLA_FLAGS"] = f"{os.environ['XLA_FLAGS']} {FAST_EMITTERS}"
    _EMITTERS.update(switching=True, default=False)
    _ask_default_emitters_per_compile()
    _refuse_plan_reads()


ORDER: list = []  # this process's tests, in the order they run


def pytest_collection_modifyitems(config, items):
    items[:] = run_order(items)
    ORDER[:] = items


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item, nextitem):
    use_default_emitters(item.get_closest_marker(MARK) is not None)
    return (yield)


def _xla_takes(flag: str) -> bool:
    """Whether this jaxlib's XLA starts with ``flag``, asked of a child process."""
    import subprocess
    env = dict(os.environ, XLA_FLAGS=f"{os.environ['XLA_FLAGS']} {flag}", JAX_PLATFORMS="cpu")
    probe = "import jax.numpy as jnp; jnp.zeros(1).block_until_ready()"
    return subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True,
                          timeout=120).returncode == 0


def pytest_unconfigure(config):
    if _OWNED_CACHE is not None:
        shutil.rmtree(_OWNED_CACHE, ignore_errors=True)


# Test time each folder may use, in seconds summed over the tests' setup, call and teardown
# (over all xdist workers: about twice the wall time it adds under `-n 2`), on the 2-core AMD
# EPYC of tests/README.md with the suite's compile cache. Together they are `make test`'s 20
# minutes (with tests/integrations' second run against tunix's head and each run's start). The
# summary at the end of a run prints each folder's time beside its budget; a folder over it is a
# test to merge, shrink or share before one more is added.
BUDGET_S = {
    "tests/ops/logits_loss": 440, "tests/ops/lm_head_loss": 155, "tests/ops/core": 56,
    "tests/ops/logps": 85, "tests/ops": 35, "tests/integrations": 230, "tests/benchmarks": 205,
    "tests/cli": 130, "tests/rl": 142, "tests/models": 48, "tests/objective": 30,
    "tests/proof": 23, "tests/sharding": 450, "tests": 31,
}
_USED_S: collections.Counter = collections.Counter()


def _folder(nodeid: str) -> str:
    """The longest folder of :data:`BUDGET_S` that holds the test ``nodeid``."""
    path = nodeid.split("::", 1)[0]
    return max((f for f in BUDGET_S if path.startswith(f + "/")), key=len, default="tests")


def pytest_runtest_logreport(report):
    _USED_S[_folder(report.nodeid)] += report.duration


def cpu_probe_s() -> float:
    """Seconds this machine takes to compile three fixed programs, with no cache.

    Compiling is most of the suite's time, and one 2-core machine's speed moves by 15% within
    an afternoon (tests/README.md), so a run's wall time is comparable with another's only
    beside this figure. It runs after the tests, when the workers have stopped.
    """
    import time

    import jax.numpy as jnp

    def program(x):
        def body(carry, row):
            s = jnp.tanh(row @ x.T) + carry
            return s, jax.nn.logsumexp(s, axis=-1)
        return jax.lax.scan(body, jnp.zeros((x.shape[0], x.shape[0])), x[None].repeat(4, 0))

    cached = jax.config.jax_enable_compilation_cache
    jax.config.update("jax_enable_compilation_cache", False)
    try:
        start = time.perf_counter()
        for n in (24, 40, 56):
            jax.jit(jax.grad(lambda x: program(x)[1].sum())).lower(
                jax.ShapeDtypeStruct((n, n), jnp.float32)).compile()
        return time.perf_counter() - start
    finally:
        jax.config.update("jax_enable_compilation_cache", cached)


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    if not _USED_S or hasattr(config, "workerinput"):
        return
    use_default_emitters(False)  # the probe compiles as every run's first tests do
    emitters = "legacy" if _EMITTERS["switching"] else "default"
    terminalreporter.write_line(f"cpu probe (tests/conftest.py::cpu_probe_s, {emitters} "
                                f"emitters): {cpu_probe_s():.2f} s")
    terminalreporter.section("test time per folder (s, all workers) / budget (tests/conftest.py)")
    for folder, used in sorted(_USED_S.items(), key=lambda kv: -kv[1]):
        budget = BUDGET_S[folder]
        terminalreporter.write_line(f"{folder:28s} {used:7.1f} / {budget:4d}"
                                    + ("  OVER BUDGET" if used > budget else ""))
