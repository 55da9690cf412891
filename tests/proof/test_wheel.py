"""The proof runs from an installed wheel: its programs and its A/B config are in the wheel,
and they start from a directory that is not a checkout."""

import os
import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_the_wheel_carries_the_proof_and_runs_it_outside_the_checkout(tmp_path):
    build = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps",
                            "--no-build-isolation", "--quiet", "-w", str(tmp_path / "dist"),
                            str(ROOT)], capture_output=True, text=True, timeout=600)
    assert build.returncode == 0, build.stderr[-2000:]
    wheel, = (tmp_path / "dist").glob("grpo_kernels-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    modules = {p.name for p in (ROOT / "src" / "grpo_kernels" / "proof").iterdir()
               if p.suffix in (".py", ".yaml")}
    assert {f"grpo_kernels/proof/{m}" for m in modules} <= names
    zipfile.ZipFile(wheel).extractall(tmp_path / "site")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    env = dict(os.environ, PYTHONPATH=str(tmp_path / "site"), JAX_PLATFORMS="cpu")
    config = subprocess.run(
        [sys.executable, "-c", "from grpo_kernels.cli import proof; "
         "print(proof.ab_config(), proof._script('gpu_train_step.py')[1:3])"],
        cwd=elsewhere, env=env, capture_output=True, text=True, timeout=300)
    assert config.returncode == 0, config.stderr[-2000:]
    path = config.stdout.split()[0]
    assert path.startswith(str(tmp_path / "site")) and Path(path).is_file()
    assert "['-m', 'grpo_kernels.proof.gpu_train_step']" in config.stdout
    run = subprocess.run([sys.executable, "-m", "grpo_kernels.proof.gpu_train_step",
                          "--arm", "fused-xla", "--model", "tiny", "--layers", "2", "--rows", "2",
                          "--prompt", "4", "--completion", "8", "--iters", "1"],
                         cwd=elsewhere, env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-2000:]
    assert '"loss"' in run.stdout
    origin = subprocess.run([sys.executable, "-c", "import grpo_kernels.proof.gpu_train_step "
                             "as m; print(m.__file__)"], cwd=elsewhere, env=env,
                            capture_output=True, text=True, timeout=300).stdout
    assert origin.startswith(str(tmp_path / "site")), origin
