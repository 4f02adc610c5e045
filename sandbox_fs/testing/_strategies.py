"""Hypothesis strategies for hostile input: archives, host trees for manifests, sandbox path names.

For downstream property tests of an integration (issue 15, part 7): draw a
hostile archive and hand it to your extraction path, build a hostile host
tree and point a manifest's ``local_file`` / ``local_dir`` sources into it,
draw sandbox paths for your own path handling; then check the outside with
the sentinel.  Every strategy shrinks towards the plainest case (one
member, one short name), so a failure reports a small example.

* :func:`sandbox_path_names`: ``str`` paths as a request would name them:
  plain components mixed with ``..``, ``.``, empty components, absolute
  paths, backslashes, control characters, names of undecodable bytes
  (``surrogateescape``), very long names.
* :func:`hostile_tar_archives` / :func:`hostile_zip_archives`: ``bytes`` of
  a whole archive (written with :mod:`tarfile` / :mod:`zipfile`) whose
  members use traversal names (zip slip, CVE-2007-4559 family), absolute
  names, symlinks and hard links to the outside or through other links
  (chains), devices, FIFOs and set-id modes, between plain members.
* :func:`hostile_host_trees`: a :class:`HostTreePlan` whose
  :meth:`HostTreePlan.build` plants regular files, directories, symlinks
  (inside, to the outside, absolute, dangling), FIFOs and hard links to an
  outside file in a throw-away directory.

The strategies make bytes and plans only; nothing is written until a
caller builds a plan into a directory it made.
"""

from __future__ import annotations

import io
import os
import stat
import tarfile
import warnings
import zipfile
from dataclasses import dataclass, field
from pathlib import Path

from hypothesis import strategies as st

__all__ = [
    "HostNode", "HostTreePlan", "hostile_host_trees", "hostile_tar_archives", "hostile_zip_archives",
    "sandbox_path_names",
]

_PLAIN = st.sampled_from(["a", "b", "c", "d", "dir", "file.txt", "x.py", ".hidden", "a b", "é"])
_HOSTILE = st.sampled_from(["..", ".", "", "...", "..\\..", "a\\..\\..", "\n", "\x1b[2J", "\x7f", "C:", "-rf",
                            "\udcff\udcfe", "a" * 255, "a" * 256])


def _component() -> st.SearchStrategy[str]:
    return st.one_of(_PLAIN, _HOSTILE)


def sandbox_path_names(*, max_depth: int = 6, absolute: bool = True) -> st.SearchStrategy[str]:
    """Sandbox path names as a request would give them, many of them hostile.

    Args:
        max_depth: most components (``int`` >= 1).
        absolute: also draw paths starting with ``/``.

    Returns:
        A strategy of ``str``; undecodable bytes appear as surrogate escapes
        (``os.fsdecode`` of the bytes).
    """
    body = st.lists(_component(), min_size=1, max_size=max_depth).map("/".join)
    if not absolute:
        return body
    return st.one_of(body, body.map(lambda p: "/" + p), st.just("/"), st.just(""))


# --------------------------------------------------------------------------- archives

_OUTSIDE_TARGETS = ["/etc/passwd", "/", "../outside", "../../../../../../tmp", "..", "a/../../x"]


@dataclass(frozen=True)
class _Member:
    kind: str  # file dir symlink hardlink chr blk fifo
    name: str
    target: str = ""
    data: bytes = b""
    mode: int = 0o644


def _member_names() -> st.SearchStrategy[str]:
    traversal = st.sampled_from(["../evil", "../../evil", "a/../../evil", "/abs/evil", "//evil", "./../evil",
                                 "a/./b/../../../evil", "a\\..\\..\\evil", "C:/evil", "a/\x00b"])
    plain = st.lists(_PLAIN, min_size=1, max_size=3).map("/".join)
    return st.one_of(plain, traversal)


@st.composite
def _members(draw: st.DrawFn, devices: bool) -> list[_Member]:
    out: list[_Member] = []
    names: list[str] = []
    kinds = ["file", "dir", "symlink", "hardlink"] + (["chr", "blk", "fifo"] if devices else [])
    for _ in range(draw(st.integers(1, 6))):
        kind = draw(st.sampled_from(kinds))
        name = draw(_member_names())
        earlier = st.sampled_from(names) if names else st.just("a")
        if kind in ("symlink", "hardlink"):
            # chains: a link to an earlier member (possibly itself a link), or straight outside
            target = draw(st.one_of(st.sampled_from(_OUTSIDE_TARGETS), earlier,
                                    earlier.map(lambda n: n + "/passwd")))
            out.append(_Member(kind, name, target))
        elif kind == "file":
            mode = draw(st.sampled_from([0o644, 0o755, 0o4755, 0o2755, 0o1777, 0o777]))
            out.append(_Member(kind, name, data=draw(st.binary(max_size=64)), mode=mode))
        else:
            out.append(_Member(kind, name, mode=0o755 if kind == "dir" else 0o644))
        names.append(name)
    return out


_TAR_TYPES = {"file": tarfile.REGTYPE, "dir": tarfile.DIRTYPE, "symlink": tarfile.SYMTYPE,
              "hardlink": tarfile.LNKTYPE, "chr": tarfile.CHRTYPE, "blk": tarfile.BLKTYPE, "fifo": tarfile.FIFOTYPE}


def _tar_bytes(members: list[_Member], fmt: int) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=fmt) as tar:
        for m in members:
            info = tarfile.TarInfo(m.name)
            info.type = _TAR_TYPES[m.kind]
            info.mode = m.mode
            info.linkname = m.target
            if m.kind in ("chr", "blk"):
                info.devmajor, info.devminor = 1, 3  # /dev/null's numbers
            info.size = len(m.data) if m.kind == "file" else 0
            tar.addfile(info, io.BytesIO(m.data) if m.kind == "file" else None)
    return buf.getvalue()


def hostile_tar_archives(*, devices: bool = True) -> st.SearchStrategy[bytes]:
    """Whole tar archives (``bytes``, 1 to 6 members) mixing plain and hostile members.

    Hostile members: traversal and absolute names (CVE-2007-4559, zip slip),
    a NUL in a name, symlinks and hard links to the outside (absolute,
    ``..``), to earlier members (chains: a link through a link, as in
    CVE-2025-4138 / CVE-2025-4517 of tarfile's data filter), set-id and
    world-writable modes, and with ``devices`` character and block devices
    and FIFOs.  Written in ustar, GNU or PAX format (drawn).

    Args:
        devices: include device and FIFO members.
    """
    fmt = st.sampled_from([tarfile.USTAR_FORMAT, tarfile.GNU_FORMAT, tarfile.PAX_FORMAT])
    return st.builds(_tar_bytes, _members(devices), fmt)


def _zip_bytes(members: list[_Member]) -> bytes:
    buf = io.BytesIO()
    with warnings.catch_warnings(), zipfile.ZipFile(buf, "w") as zf:
        warnings.simplefilter("ignore", UserWarning)  # duplicate names are drawn on purpose
        for m in members:
            name = m.name + "/" if m.kind == "dir" else m.name
            info = zipfile.ZipInfo(name)
            info.create_system = 3  # unix: external_attr carries st_mode
            if m.kind == "symlink":
                info.external_attr = (stat.S_IFLNK | 0o777) << 16
                zf.writestr(info, m.target)
            elif m.kind == "dir":
                info.external_attr = (stat.S_IFDIR | 0o755) << 16
                zf.writestr(info, b"")
            elif m.kind == "fifo":
                info.external_attr = (stat.S_IFIFO | 0o644) << 16
                zf.writestr(info, b"")
            else:  # zip has no hard links or devices: a plain file with the drawn mode
                info.external_attr = (stat.S_IFREG | m.mode) << 16
                zf.writestr(info, m.data or m.target.encode())
    return buf.getvalue()


def hostile_zip_archives() -> st.SearchStrategy[bytes]:
    """Whole zip archives (``bytes``, 1 to 6 entries) mixing plain and hostile entries.

    Traversal and absolute names (zip slip), backslash-separated names, a NUL
    in a name, unix symlink entries (``external_attr`` ``S_IFLNK``) to the
    outside or to earlier entries, FIFO entries and set-id modes.
    """
    return st.builds(_zip_bytes, _members(devices=True))


# --------------------------------------------------------------------------- host trees


@dataclass(frozen=True)
class HostNode:
    """One node a :class:`HostTreePlan` plants.

    Attributes:
        path: relative ``/``-separated path beneath the tree's top.
        kind: ``"file"``, ``"dir"``, ``"symlink"``, ``"fifo"`` or
            ``"hardlink_outside"`` (a hard link to the outside file given to
            :meth:`HostTreePlan.build`).
        target: a symlink's target (``"@outside"`` stands for the outside
            directory's absolute path).
        data: a regular file's content.
        mode: permission bits of a file or directory.
    """

    path: str
    kind: str
    target: str = ""
    data: bytes = b""
    mode: int = 0o644


@dataclass(frozen=True)
class HostTreePlan:
    """A hostile host tree to plant in a throw-away directory (a manifest's source tree).

    Attributes:
        nodes: in creation order; parents come before children.
    """

    nodes: tuple[HostNode, ...] = field(default_factory=tuple)

    def files(self) -> list[str]:
        """Paths of the plain regular files (sources a manifest may copy)."""
        return [n.path for n in self.nodes if n.kind == "file"]

    def hostile(self) -> list[str]:
        """Paths of the nodes a source must never be read through (links, FIFOs, outside hard links)."""
        return [n.path for n in self.nodes if n.kind not in ("file", "dir")]

    def build(self, top: Path, outside: Path, outside_file: Path) -> None:
        """Plant the plan beneath ``top`` (an existing, empty, throw-away directory).

        Args:
            top: where the tree goes.
            outside: a directory outside ``top`` that symlinks point to.
            outside_file: a regular file outside ``top`` that hard links share.

        Raises:
            OSError: ``top`` is missing, or a node cannot be made.
        """
        for n in self.nodes:
            p = top / n.path
            if n.kind == "dir":
                p.mkdir(mode=0o755)
                # host-access: builds the hostile host tree a test asked for, in the test's own directory (the point is to plant it)
                os.chmod(p, n.mode)
            elif n.kind == "file":
                p.write_bytes(n.data)
                os.chmod(p, n.mode)
            elif n.kind == "symlink":
                os.symlink(str(outside) if n.target == "@outside" else n.target, p)
            elif n.kind == "fifo":
                os.mkfifo(p, 0o644)
            elif n.kind == "hardlink_outside":
                os.link(outside_file, p)
            else:  # pragma: no cover - the strategy draws only the kinds above
                raise ValueError(f"unknown node kind {n.kind!r}")


_TREE_LINK_TARGETS = ["@outside", "/etc", "../../..", "..", "missing", "f0", "d0", "d0/f1", "d0/../../outside"]


@st.composite
def _tree_plans(draw: st.DrawFn, max_nodes: int) -> HostTreePlan:
    nodes: list[HostNode] = []
    dirs = [""]
    used: set[str] = set()
    for i in range(draw(st.integers(1, max_nodes))):
        parent = draw(st.sampled_from(dirs))
        kind = draw(st.sampled_from(["file", "file", "dir", "symlink", "fifo", "hardlink_outside"]))
        name = f"{'d' if kind == 'dir' else 'f'}{i}"
        path = f"{parent}/{name}" if parent else name
        if path in used:
            continue
        used.add(path)
        if kind == "dir":
            nodes.append(HostNode(path, kind, mode=draw(st.sampled_from([0o755, 0o700, 0o555]))))
            dirs.append(path)
        elif kind == "file":
            nodes.append(HostNode(path, kind, data=draw(st.binary(max_size=32)),
                                  mode=draw(st.sampled_from([0o644, 0o600, 0o755, 0o4755]))))
        elif kind == "symlink":
            nodes.append(HostNode(path, kind, target=draw(st.sampled_from(_TREE_LINK_TARGETS))))
        else:
            nodes.append(HostNode(path, kind))
    return HostTreePlan(tuple(nodes))


def hostile_host_trees(*, max_nodes: int = 8) -> st.SearchStrategy[HostTreePlan]:
    """Plans of hostile host trees (1 to ``max_nodes`` nodes) for manifest sources.

    Each node is a regular file (any mode, set-uid included), a directory
    (read-only ones too), a symlink (to the outside directory, to ``/etc``,
    climbing with ``..``, dangling, or to a sibling), a FIFO (a source that
    would block a reader) or a hard link to an outside file.  Build one with
    :meth:`HostTreePlan.build` into a directory the test made.

    Args:
        max_nodes: most nodes in a plan (``int`` >= 1).
    """
    return _tree_plans(max_nodes)
