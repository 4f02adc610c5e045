"""The command line starts light: ``--version``, ``--help`` and a usage error import no subcommand
module, no pydantic, no trio; a chosen subcommand imports only what it needs."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

import sandbox_fs
from sandbox_fs import _native

HEAVY = ("pydantic", "trio", "sandbox_fs.archive", "sandbox_fs.manifest", "sandbox_fs.exec",
         "sandbox_fs.snapshot", "sandbox_fs.client", "sandbox_fs.materialize")

# Runs main() in a fresh interpreter, then writes (as JSON, to the fd named by SFS_PROBE_FD) the
# exit code and the modules loaded: stdout and stderr stay the command's own.
PROBE = """
import json, os, sys
from sandbox_fs.cli import main
try:
    code = main(sys.argv[1:])
except SystemExit as exc:
    code = exc.code
with os.fdopen(int(os.environ["SFS_PROBE_FD"]), "w") as out:
    json.dump({"code": code, "modules": sorted(sys.modules)}, out)
"""


def run_probe(*argv: str) -> tuple[int, list[str], str, str]:
    """(exit code, modules loaded, stdout, stderr) of ``sandbox-fs ARGV`` in a fresh interpreter."""
    r, w = os.pipe()
    try:
        proc = subprocess.Popen([sys.executable, "-c", PROBE, *argv], pass_fds=(w,), stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, stdin=subprocess.DEVNULL,
                                env={**os.environ, "SFS_PROBE_FD": str(w)})
    finally:
        os.close(w)
    out, err = proc.communicate(timeout=60)
    with os.fdopen(r) as f:
        report = json.load(f)
    return report["code"], report["modules"], out.decode(), err.decode()


def heavy_loaded(modules: list[str]) -> list[str]:
    return [m for m in modules if any(m == h or m.startswith(h + ".") for h in HEAVY)
            or m.startswith("sandbox_fs.cli._") and m.split(".")[-1] not in
            ("_main", "_errors", "_output", "_args", "_hostpath")]


@pytest.mark.parametrize("argv", [["--version"], ["--help"], [], ["no-such-command"], ["--no-such-option"],
                                  ["-h"]])
def test_top_level_imports_nothing_heavy(argv):
    code, modules, _out, err = run_probe(*argv)
    assert code in (0, 2)
    assert heavy_loaded(modules) == [], (argv, heavy_loaded(modules))
    assert "Traceback" not in err


def test_usage_error_is_one_line_and_light():
    code, modules, out, err = run_probe("extrac", "x")
    assert code == 2 and out == ""
    assert err.startswith("sandbox-fs: error: usage: ") and len(err.strip().splitlines()) == 1
    assert heavy_loaded(modules) == []


def test_a_subcommand_imports_only_its_own_module():
    code, modules, out, _err = run_probe("features", "--json")
    assert code == 0 and json.loads(out)["native_abi"] == _native.EXPECTED_ABI
    chosen = [m for m in modules if m.startswith("sandbox_fs.cli._")]
    assert "sandbox_fs.cli._features" in chosen
    assert not [m for m in chosen if m.split(".")[-1] in ("_run", "_extract", "_apply", "_session",
                                                          "_snapshot", "_schema", "_demo")]
    assert "pydantic" not in modules


def test_extract_help_does_not_import_trio():
    code, modules, out, _err = run_probe("extract", "--help")
    assert code == 0 and "--max-members" in out
    assert "trio" not in modules


def test_extracting_imports_no_trio(tmp_path):
    """The synchronous extraction never needs trio (nor the manifest, session or exec layers)."""
    import io
    import tarfile

    arc = tmp_path / "one.tar"
    with tarfile.open(arc, "w") as tf:
        info = tarfile.TarInfo("hello.txt")
        info.size = 3
        tf.addfile(info, io.BytesIO(b"hi\n"))
    code, modules, out, err = run_probe("extract", str(arc), "--into", str(tmp_path / "out"))
    assert code == 0 and err == "" and out.startswith("extracted 1 files")
    assert (tmp_path / "out" / "hello.txt").read_bytes() == b"hi\n"
    assert [m for m in modules if m == "trio" or m.startswith(("trio.", "sandbox_fs.manifest", "sandbox_fs.exec",
                                                                 "sandbox_fs.session", "sandbox_fs.client"))] == []


def test_version_prints_package_version_and_native_abi():
    r = subprocess.run([sys.executable, "-m", "sandbox_fs", "--version"], capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 0 and r.stderr == ""
    assert r.stdout == f"sandbox-fs {sandbox_fs.__version__} (native ABI {_native.lib.SFS_ABI_VERSION})\n"


def test_version_through_the_entry_point(capsys):
    from sandbox_fs.cli import main

    with pytest.raises(SystemExit) as exc:
        main(["--version"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("sandbox-fs ") and f"(native ABI {_native.EXPECTED_ABI})" in out


def test_the_version_is_the_distributions():
    from importlib.metadata import version

    assert sandbox_fs.__version__ == version("sandbox-fs")
