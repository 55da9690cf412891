"""How ``grpo-kernels proof`` runs one phase: in a process of its own with a time limit
(:func:`run_phase`), or through the phase module's ``main(argv)`` in the proof's own process
(:func:`run_phase_in_process`, ``--in-process``). Both give the same record: the phase's name,
its return code, wall time, argv, its JSON rows and its output.
"""

from __future__ import annotations

import contextlib
import importlib
import io
import json
import os
import subprocess
import sys
import time
import traceback
from typing import Any, Callable


def _json_rows(stdout: str) -> list[dict]:
    rows = []
    for line in stdout.splitlines():
        if line.startswith("{"):
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:
                pass
    return rows


def run_phase(name: str, cmd: list[str], limit: float, env: dict[str, str]) -> dict:
    """One phase in its own process: its record (rc is an int, "timeout" or "not run")."""
    t0 = time.perf_counter()
    try:
        r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=limit)
        rc, stdout, stderr = r.returncode, r.stdout, r.stderr
    except OSError as e:
        rc, stdout, stderr = "not run", "", str(e)
    except subprocess.TimeoutExpired as e:
        rc = "timeout"
        stdout = e.stdout.decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
        stderr = e.stderr.decode() if isinstance(e.stderr, bytes) else (e.stderr or "")
    return {"phase": name, "rc": rc, "wall_s": time.perf_counter() - t0, "argv": cmd,
            "rows": _json_rows(stdout), "stdout": stdout, "stderr": stderr}


# jax settings a phase module may change for its own process (its compile cache), restored
# after each phase run in this process.
_PHASE_CONFIG = ("jax_compilation_cache_dir", "jax_persistent_cache_min_compile_time_secs",
                 "jax_persistent_cache_min_entry_size_bytes", "jax_enable_x64")


def in_process_main(cmd: list[str]) -> Callable[[list[str]], Any] | None:
    """The ``main(argv)`` that runs phase ``cmd`` in this process, or None where it needs its
    own: a command other than ``python -m grpo_kernels...``, or one that puts another tunix
    first on the import path (``--tunix-path``: modules already imported would not change)."""
    if len(cmd) < 3 or cmd[0] != sys.executable or cmd[1] != "-m" or "--tunix-path" in cmd:
        return None
    if cmd[2] == "grpo_kernels.cli.main":
        from grpo_kernels.cli.main import main
        return main
    if cmd[2].startswith("grpo_kernels.proof."):
        return importlib.import_module(cmd[2]).main
    return None


def run_phase_in_process(name: str, cmd: list[str], main: Callable[[list[str]], Any]) -> dict:
    """One phase through its module's ``main(argv)`` in this process, output captured; its
    record as :func:`run_phase`'s (no time limit). The environment and the jax settings of
    :data:`_PHASE_CONFIG` are restored afterwards."""
    import jax


    saved_env, saved = dict(os.environ), {k: getattr(jax.config, k) for k in _PHASE_CONFIG}
    out, err = io.StringIO(), io.StringIO()
    t0 = time.perf_counter()
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            rc = main(cmd[3:])
    except SystemExit as e:
        rc = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except Exception:  # noqa: BLE001 - a failing phase is recorded, as its process's would be
        err.write(traceback.format_exc())
        rc = 1
    finally:
        os.environ.clear()
        os.environ.update(saved_env)
        for k, v in saved.items():
            jax.config.update(k, v)
    stdout = out.getvalue()
    return {"phase": name, "rc": 0 if rc is None else int(rc), "wall_s": time.perf_counter() - t0,
            "argv": cmd, "rows": _json_rows(stdout), "stdout": stdout, "stderr": err.getvalue()}
