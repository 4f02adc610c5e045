"""``sandbox-fs fuzz`` and the shipped fuzz targets (sandbox_fs.testing.fuzz).

The campaign must fail on a planted finding (exit 1, the minimized input
written, a JUnit failure), and every shipped target must hold on its seeds.
"""

from __future__ import annotations

import os
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from sandbox_fs.cli import main
from sandbox_fs.testing.fuzz import Finding, Scene, load_target, render_dictionary, target_names

REPO = Path(__file__).resolve().parent.parent

PLANTED = '''
import os
from sandbox_fs.testing.fuzz import Scene, Target

_scene = None

def one_input(data):
    global _scene
    if _scene is None:
        _scene = Scene("planted")
    _scene.reset()
    def step():
        if b"Z" in data:  # the planted bug: an escaping symlink in the destination
            os.symlink(_scene.outside, os.path.join(_scene.ws, "esc"))
    _scene.run(step)

PLANTED = Target("planted", one_input, lambda: [b"abcdefghZijklmnop"], (b"Z",))
'''


def test_planted_finding_exits_nonzero_with_minimized_input_and_junit(tmp_path):
    pytest.importorskip("atheris", reason="sandbox-fs fuzz needs atheris (sandbox-fs[fuzz])")
    (tmp_path / "planted_target.py").write_text(PLANTED)
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    env = dict(os.environ, PYTHONPATH=str(tmp_path), TMPDIR=str(tmp))
    art, junit = tmp_path / "art", tmp_path / "report.xml"
    proc = subprocess.run([sys.executable, "-m", "sandbox_fs.cli", "fuzz", "planted_target:PLANTED",
                           "--seconds", "20", "--artifacts", str(art), "--junit", str(junit), "--no-instrument"],
                          env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 1, proc.stderr
    assert "symlink escapes the destination: esc" in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1 and "Traceback" not in proc.stderr
    minimized = sorted(art.glob("planted-minimized-*"))
    assert len(minimized) == 1 and minimized[0].read_bytes() == b"Z"
    case = ET.parse(junit).getroot().find("testsuite/testcase")
    assert case is not None and case.get("name") == "planted_target:PLANTED"
    failure = case.find("failure")
    assert failure is not None and "symlink escapes" in failure.get("message", "")
    assert str(minimized[0]) in (failure.text or "")
    assert sorted(os.listdir(tmp)) == []  # the campaign's scratch went, with what the workers made in it


def test_a_campaign_leaves_nothing_in_tmpdir(tmp_path):
    """libFuzzer ends a worker whose time is up with _exit (no atexit): the trees its Scenes made
    with tempfile must still go, with the campaign's scratch directory."""
    pytest.importorskip("atheris", reason="sandbox-fs fuzz needs atheris (sandbox-fs[fuzz])")
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    proc = subprocess.run([sys.executable, "-m", "sandbox_fs.cli", "fuzz", "state", "--seconds", "1",
                           "--artifacts", str(tmp_path / "art"), "--no-instrument"],
                          env=dict(os.environ, TMPDIR=str(tmp)), capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr
    assert sorted(os.listdir(tmp)) == []


def test_missing_atheris_is_one_usage_line(monkeypatch, capsys):
    import sandbox_fs.cli._fuzz as fuzz_cli

    monkeypatch.setattr(fuzz_cli.importlib.util, "find_spec", lambda name: None)
    assert main(["fuzz", "tar", "--seconds", "1"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "sandbox-fs[fuzz]" in err


def test_unknown_target_is_a_usage_error(capsys):
    pytest.importorskip("atheris", reason="sandbox-fs fuzz needs atheris (sandbox-fs[fuzz])")
    assert main(["fuzz", "no-such-target", "--seconds", "1"]) == 2
    assert "no fuzz target" in capsys.readouterr().err


def test_scene_catches_each_kind_of_finding():
    scene = Scene("unit")
    scene.reset()
    scene.run(lambda: None)
    with pytest.raises(Finding, match="unexpected failure KeyError"):
        scene.run(lambda: {}["k"])
    with pytest.raises(Finding, match="special node"):
        scene.run(lambda: os.mkfifo(os.path.join(scene.ws, "p")))
    scene.reset()
    with pytest.raises(Finding, match="secret.txt: removed"):
        scene.run(lambda: os.rename(os.path.join(scene.outside, "secret.txt"), os.path.join(scene.ws, "s")))


@pytest.mark.parametrize("name", target_names())
def test_shipped_target_holds_on_its_seeds_and_committed_corpus(name):
    target = load_target(name)
    for data in target.seeds():
        target.one_input(data)
    corpus = REPO / "fuzz" / "corpus" / name
    assert sorted(p.name for p in corpus.iterdir()), f"fuzz/corpus/{name} is empty"
    for path in sorted(corpus.iterdir()):
        target.one_input(path.read_bytes())
    assert (REPO / "fuzz" / "dict" / f"{name}.dict").read_text() == render_dictionary(target.tokens), \
        "fuzz/dict is stale: run python fuzz/make_seeds.py"
