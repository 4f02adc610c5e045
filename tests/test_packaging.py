"""``python -m build`` makes an sdist and a wheel that holds the native module, the exec
helper and the typing markers; the wheel installs into a fresh venv, where
``sandbox-fs features`` runs and the exec helper is found.

Slow (about 25-40 s: an isolated build, then an install that takes the dependencies from
pip's cache or the package index).
"""

from __future__ import annotations

import importlib.util
import json
import os
import pathlib
import stat
import subprocess
import sys
import zipfile

import pytest

import sandbox_fs

REPO = pathlib.Path(__file__).resolve().parent.parent

pytestmark = pytest.mark.slow


# pip's cache (for the build's isolated environment and the install) lives beside the test
# virtualenv, never in the home directory (the suite checks that /root is left unchanged).
PIP_CACHE = pathlib.Path(sys.prefix) / "pip-cache"


def _run(cmd: list[str], **kw) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}
    env["PIP_CACHE_DIR"] = str(PIP_CACHE)
    return subprocess.run(cmd, capture_output=True, text=True, env=env, **kw)


def _check(proc: subprocess.CompletedProcess[str], what: str) -> None:
    assert proc.returncode == 0, f"{what} failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"


def test_wheel_holds_the_native_parts_and_installs_into_a_fresh_venv(tmp_path):
    if importlib.util.find_spec("build") is None:
        pytest.skip("the 'build' package is not installed in this environment (scripts/setup.sh installs it)")
    dist = tmp_path / "dist"
    _check(_run([sys.executable, "-m", "build", "--outdir", str(dist), str(REPO)], timeout=600), "python -m build")
    wheels = list(dist.glob("sandbox_fs-*.whl"))
    assert len(wheels) == 1 and len(list(dist.glob("sandbox_fs-*.tar.gz"))) == 1

    with zipfile.ZipFile(wheels[0]) as whl:
        members = {i.filename: i for i in whl.infolist()}
        entry_points = whl.read(next(n for n in members if n.endswith(".dist-info/entry_points.txt"))).decode()
    assert any(n.startswith("sandbox_fs/_sfs_native") and n.endswith(".so") for n in members)
    exec_helper = members["sandbox_fs/sfs-exec"]
    assert stat.S_IMODE(exec_helper.external_attr >> 16) == 0o755
    assert "sandbox_fs/py.typed" in members and "sandbox_fs/_sfs_native.pyi" in members
    assert "sandbox-fs = sandbox_fs.cli:main" in entry_points

    venv = tmp_path / "venv"
    _check(_run([sys.executable, "-m", "venv", "--without-pip", str(venv)], timeout=120), "venv")
    py = venv / "bin" / "python"
    _check(_run([sys.executable, "-m", "pip", "--python", str(py), "install", "-q", "--disable-pip-version-check",
                 str(wheels[0])], timeout=600), "pip install of the wheel")

    where = _run([str(py), "-c", "import sandbox_fs; print(sandbox_fs.__file__)"], cwd=tmp_path, timeout=60)
    _check(where, "import sandbox_fs")
    assert pathlib.Path(where.stdout.strip()).is_relative_to(venv), "the installed wheel was not the one imported"
    cli = str(venv / "bin" / "sandbox-fs")
    feats = _run([cli, "features", "--json"], cwd=tmp_path, timeout=60)
    _check(feats, "sandbox-fs features --json")
    report = json.loads(feats.stdout)
    assert report["version"] == sandbox_fs.__version__
    assert report["native_abi"] == sandbox_fs._native.EXPECTED_ABI
    assert report["landlock_abi"] == sandbox_fs.features()["landlock_abi"]
    helper = _run([str(py), "-c", "from sandbox_fs.exec import helper_path; print(helper_path())"], cwd=tmp_path,
                  timeout=60)
    _check(helper, "sandbox_fs.exec.helper_path()")
    found = pathlib.Path(helper.stdout.strip())
    assert found.is_relative_to(venv) and os.access(found, os.X_OK), "the installed exec helper is not the wheel's"
