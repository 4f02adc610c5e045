"""Regenerate the small seed corpora in fuzz/corpus/{tar,zip} (committed; run once)."""

import io
import os
import stat
import tarfile
import zipfile

HERE = os.path.dirname(os.path.abspath(__file__))


def tar(members, fmt=tarfile.PAX_FORMAT, comp=""):
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:" + comp if comp else "w", format=fmt) as tf:
        for name, typ, data, link in members:
            ti = tarfile.TarInfo(name)
            ti.type, ti.linkname, ti.mode, ti.mtime = typ, link, 0o644, 1_600_000_000
            if typ == tarfile.REGTYPE:
                ti.size = len(data)
                tf.addfile(ti, io.BytesIO(data))
            else:
                tf.addfile(ti)
    return buf.getvalue()


def zipb(entries, comp=zipfile.ZIP_DEFLATED):
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", compression=comp) as zf:
        for name, mode, data in entries:
            zi = zipfile.ZipInfo(name, date_time=(2020, 1, 1, 0, 0, 0))
            zi.create_system, zi.external_attr, zi.compress_type = 3, mode << 16, comp
            zf.writestr(zi, data)
    return buf.getvalue()


R, D, S, L = tarfile.REGTYPE, tarfile.DIRTYPE, tarfile.SYMTYPE, tarfile.LNKTYPE
basic = [("d", D, b"", ""), ("d/f", R, b"hello\n", ""), ("d/l", S, b"", "f"), ("h", L, b"", "d/f")]
seeds = {
    "tar": {
        "basic.tar": tar(basic),
        "basic_gnu.tar": tar(basic + [("x" * 150 + "/y" * 20, R, b"long", "")], fmt=tarfile.GNU_FORMAT),
        "basic.tar.gz": tar(basic, comp="gz"),
        "basic.tar.bz2": tar(basic, comp="bz2"),
        "basic.tar.xz": tar(basic, comp="xz"),
        "pax_path.tar": tar([("ok", R, b"1", ""), ("\u00e9t\u00e9/" + "n" * 120, R, b"2", "")]),
        "evil_links.tar": tar([("a", S, b"", "."), ("c", S, b"", "a/.."), ("c/x", R, b"x", ""),
                               ("h", L, b"", "../outside/secret.txt")]),
        "dups.tar": tar([("x", R, b"1", ""), ("x", R, b"2", ""), ("x", D, b"", ""), ("y", S, b"", "x")]),
    },
    "zip": {
        "basic.zip": zipb([("d/", stat.S_IFDIR | 0o755, b""), ("d/f", stat.S_IFREG | 0o644, b"hello\n"),
                           ("l", stat.S_IFLNK | 0o777, b"d/f")]),
        "stored.zip": zipb([("a", stat.S_IFREG | 0o644, b"A" * 100), ("b", stat.S_IFREG | 0o755, b"B")],
                           comp=zipfile.ZIP_STORED),
        "slip.zip": zipb([("../outside/x", stat.S_IFREG | 0o644, b"x"), ("l", stat.S_IFLNK | 0o777, b"../outside")]),
        "bz2.zip": zipb([("f", stat.S_IFREG | 0o644, b"z" * 300)], comp=zipfile.ZIP_BZIP2),
    },
}
for target, files in seeds.items():
    for name, data in files.items():
        with open(os.path.join(HERE, "corpus", target, name), "wb") as fh:
            fh.write(data)
