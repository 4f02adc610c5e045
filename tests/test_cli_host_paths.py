"""No CLI host-path option echoes its host path in error text (a grant shows as ``[grant NAME]``)."""

from __future__ import annotations

import json
import os
import secrets

import pytest

from sandbox_fs.cli import main

# every option that takes a host path, with the other arguments it needs ({P} is the host path)
CASES = [
    ["run", "--manifest", "{M}", "--workspaces-dir", "{W}", "--grant", "{P}", "--", "true"],
    ["run", "--manifest", "{M}", "--workspaces-dir", "{W}", "--grant", "g={P}:rw", "--", "true"],
    ["run", "--manifest", "{M}", "--workspaces-dir", "{W}", "--grant", "{P}:xx", "--", "true"],
    ["run", "--manifest", "{M}", "--workspaces-dir", "{P}", "--", "true"],
    ["run", "--manifest", "{M}", "--workspaces-dir", "{W}", "--store", "{P}", "--resume", "{S}", "--", "true"],
    ["run", "--manifest", "{P}", "--workspaces-dir", "{W}", "--", "true"],
    ["run", "--workspaces-dir", "{W}", "--resume", "{P}", "--", "true"],
    ["run", "--manifest", "{M}", "--workspaces-dir", "{W}", "--state", "{P}/s.json", "--", "true"],
    ["session", "create", "--workspaces-dir", "{W}", "--grant", "{P}", "--state", "{S}"],
    ["session", "create", "--workspaces-dir", "{W}", "--base-dir", "{P}", "--manifest", "{M}", "--state", "{S}"],
    ["session", "create", "--workspaces-dir", "{W}", "--state-key-file", "{P}", "--state", "{S}"],
    ["session", "create", "--workspaces-dir", "{W}", "--state", "{P}/s.json"],
    ["session", "resume", "--workspaces-dir", "{W}", "--store", "{P}", "--state", "{S}"],
    ["session", "fork", "--workspaces-dir", "{W}", "--store", "{P}", "--state", "{S}", "--state-out", "{S}"],
    ["session", "rm", "--workspaces-dir", "{W}", "--state", "{P}"],
    ["snapshot", "save", "--store", "{W}/st", "--name", "x", "--workspace", "{P}"],
    ["snapshot", "restore", "--store", "{P}", "--name", "x", "--workspace", "{W}"],
    ["snapshot", "ls", "--store", "{P}"],
    ["extract", "{P}", "--into", "{W}/x"],
    ["apply", "{P}", "--root", "{W}/r"],
    ["apply", "{M}", "--root", "{W}/r", "--base", "{P}"],
    ["apply", "{M}", "--root", "{W}/r", "--grant", "{P}"],
]


@pytest.mark.parametrize("kind", ["missing", "symlink"])
def test_no_host_path_in_error_text(tmp_path, capsys, kind):
    """Each option given a host path (missing, or through a symlink) is refused in one line that does not show it.

    (A case the command can complete, such as a missing --workspaces-dir it makes, may succeed: only
    its refusals are checked, and most cases must refuse.)
    """
    real = tmp_path / "real"
    real.mkdir()
    (tmp_path / "m.json").write_text(json.dumps({"entries": {}}))
    (tmp_path / "w").mkdir()
    bad, refused = [], 0
    for case in CASES:
        marker = "hp" + secrets.token_hex(6)
        host = tmp_path / marker / "x\tq"  # a control character too: the line stays escaped either way
        if kind == "symlink":
            os.symlink(real, tmp_path / marker)
            host = tmp_path / marker / "sub"
        fill = {"{M}": str(tmp_path / "m.json"), "{W}": str(tmp_path / "w"), "{S}": str(tmp_path / "s.json"),
                "{P}": str(host)}
        argv = list(case)
        for k, v in fill.items():
            argv = [a.replace(k, v) for a in argv]
        rc = main(argv)
        _, err = capsys.readouterr()
        if rc != 0:
            refused += 1
            if len(err.strip().splitlines()) != 1 or marker in err or str(tmp_path) in err or "\t" in err:
                bad.append((case, rc, err))
    assert not bad, "\n".join(f"{c} rc={r} {e!r}" for c, r, e in bad)
    assert refused >= len(CASES) - 8
