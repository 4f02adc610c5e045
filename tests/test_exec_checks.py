"""The exec package's rights and environment rules, each pinned on its own (mutants that survived, see mutants/survivors.md)."""

from __future__ import annotations

import errno

import pytest

import sandbox_fs
from sandbox_fs import open_root
from sandbox_fs.exec import ConfinementError, ConfinementPolicy, InvalidEnvError, _landlock
from sandbox_fs.exec._env import build_env
from sandbox_fs.exec._ruleset import build_ruleset

L = _landlock
needs_abi6 = pytest.mark.skipif(sandbox_fs.features()["landlock_abi"] < 6,
                                reason="kernel Landlock ABI < 6 (features()['landlock_abi'])")
needs_landlock = pytest.mark.skipif(sandbox_fs.features()["landlock_abi"] < 1,
                                    reason="no Landlock on this kernel (features()['landlock_abi'] < 1)")


def test_fs_mask_per_abi_is_exact():
    """Every right arrives at its own ABI, not one earlier or later (a right the kernel does not know is EINVAL)."""
    want = {0: 0, 1: L._FS_ABI1, 2: L._FS_ABI1 | L.FS_REFER, 3: L._FS_ABI1 | L.FS_REFER | L.FS_TRUNCATE}
    want[4] = want[3]
    want[5] = want[6] = want[7] = want[3] | L.FS_IOCTL_DEV
    assert {abi: L.fs_mask(abi) for abi in range(8)} == want
    assert L.fs_mask(-1) == 0


def test_build_env_copies_only_the_allow_list_and_checks_types():
    host = {"LANG": "C", "LC_ALL": "C", "SECRET_TOKEN": "s", "LD_PRELOAD": "/x.so"}
    env = build_env(None, workspace_host_path="/w", host_env=host)
    assert {k: env[k] for k in ("LANG", "LC_ALL")} == {"LANG": "C", "LC_ALL": "C"}
    assert "SECRET_TOKEN" not in env and "LD_PRELOAD" not in env
    with pytest.raises(InvalidEnvError):
        build_env({"A": 5}, workspace_host_path="/w", host_env={})  # type: ignore[dict-item]
    with pytest.raises(InvalidEnvError) as ei:
        build_env({"x" * 100 + "=": "v"}, workspace_host_path="/w", host_env={})
    assert ei.value.context["name"] == "x" * 64  # the name is shown bounded


@needs_abi6
@pytest.mark.parametrize("signals,unix", [(True, True), (True, False), (False, True), (False, False)])
def test_build_ruleset_scopes_and_net_follow_the_policy(tmp_path, signals, unix):
    (tmp_path / "ws").mkdir()
    (tmp_path / "g").mkdir()
    pol = ConfinementPolicy(scope_signals=signals, scope_abstract_unix=unix)
    with open_root(tmp_path / "ws") as ws, open_root(tmp_path / "g") as g:
        rs = build_ruleset(ws, [(g, True)], pol)  # a grant: its rule is added from its own fd
        try:
            assert rs.scoped == (L.SCOPE_SIGNAL if signals else 0) | (L.SCOPE_ABSTRACT_UNIX_SOCKET if unix else 0)
            assert rs.net == L.net_mask(rs.abi) != 0  # TCP handled unless unrestricted_tcp
        finally:
            rs.close()


@needs_abi6
def test_build_ruleset_defaults_and_refusals(tmp_path):
    with open_root(tmp_path) as ws:
        rs = build_ruleset(ws)  # default policy, the kernel's ABI
        try:
            assert rs.abi == L.abi() and rs.scoped == L.SCOPE_SIGNAL | L.SCOPE_ABSTRACT_UNIX_SOCKET
        finally:
            rs.close()
        rs = build_ruleset(ws, policy=ConfinementPolicy(unrestricted_tcp=True), abi=4)
        try:
            assert rs.abi == 4 and rs.net == 0
        finally:
            rs.close()
        with pytest.raises(ConfinementError, match="not available"):
            build_ruleset(ws, abi=0)


def _rules_asked(monkeypatch, tmp_path, policy, *, tty):
    """The ``/dev/tty`` and TCP rules build_ruleset asks the Ruleset for (the kernel cannot list a ruleset's rules)."""
    asked: list[tuple] = []
    add_host_path, allow_tcp = L.Ruleset.add_host_path, L.Ruleset.allow_tcp

    def spy_path(self, host_path, access):
        asked.append(("path", host_path, access))
        return add_host_path(self, host_path, access)

    def spy_tcp(self, ports, access):
        ports = list(ports)
        asked.append(("tcp", ports, access))
        return allow_tcp(self, ports, access)

    monkeypatch.setattr(L.Ruleset, "add_host_path", spy_path)
    monkeypatch.setattr(L.Ruleset, "allow_tcp", spy_tcp)
    with open_root(tmp_path) as ws:
        build_ruleset(ws, policy=policy, tty=tty).close()
    return asked


@needs_landlock
def test_build_ruleset_tty_and_tcp_rules_are_exact(monkeypatch, tmp_path):
    """/dev/tty gets read, write and ioctl; the connect rule is the union of the policy's ports and the proxy's."""
    from sandbox_fs.exec._egress import PROXY_PORT

    tty = ("path", "/dev/tty", L.FS_READ_FILE | L.FS_WRITE_FILE | L.FS_IOCTL_DEV)
    asked = _rules_asked(monkeypatch, tmp_path, ConfinementPolicy(allow_tcp_connect=frozenset({443, 80}),
                                                                  allow_tcp_bind=frozenset({8080})), tty=True)
    assert asked == [tty, ("tcp", [80, 443], L.NET_CONNECT_TCP), ("tcp", [8080], L.NET_BIND_TCP)]
    asked = _rules_asked(monkeypatch, tmp_path, ConfinementPolicy(allow_hosts=("example.com",)), tty=False)
    assert asked == [("tcp", [PROXY_PORT], L.NET_CONNECT_TCP), ("tcp", [], L.NET_BIND_TCP)]


@needs_landlock
def test_build_ruleset_refused_rule_names_its_errno(monkeypatch, tmp_path):
    with open_root(tmp_path) as ws:
        with pytest.raises(ConfinementError, match="refused") as ei:  # port 70000 is refused with EINVAL
            build_ruleset(ws, policy=ConfinementPolicy(allow_tcp_connect=frozenset({70000})))
        assert ei.value.context == {"errno": "EINVAL"}

        def no_errno(self):
            raise OSError("no errno")

        monkeypatch.setattr(L.Ruleset, "add_system_set", no_errno)
        with pytest.raises(ConfinementError, match="refused") as ei:
            build_ruleset(ws)
        assert ei.value.context["errno"] not in errno.errorcode.values()  # no errno is made up (EPERM)


def _missing(policy, *, abi=7, process_bounds=False, pid_namespace=False):
    from types import SimpleNamespace

    from sandbox_fs.exec._coverage import missing_protections

    prep = SimpleNamespace(abi=abi, level="landlock", ro_mounts=True, net_isolated=True, process_bounds=process_bounds)
    return missing_protections(SimpleNamespace(confinement="required", policy=policy), prep,  # type: ignore[arg-type]
                               pid_namespace=pid_namespace)


@pytest.mark.parametrize("pids_max,processes,missing", [(None, None, False), (8, None, True), (None, 8, True),
                                                        (8, 8, True)])
def test_a_process_bound_asked_for_and_not_available_is_reported(pids_max, processes, missing):
    pol = ConfinementPolicy(pids_max=pids_max, processes=processes)
    assert ("process_bound" in _missing(pol)) is missing
    assert "process_bound" not in _missing(pol, process_bounds=True)


def test_signal_scoping_is_missing_below_abi_6_only():
    pol = ConfinementPolicy(scope_signals=True)
    assert "landlock.scope_signals" in _missing(pol, abi=5)
    assert "landlock.scope_signals" not in _missing(pol, abi=6)
    assert "landlock.scope_signals" not in _missing(pol, abi=5, pid_namespace=True)
