"""cffi build script (API mode, out-of-line) for sandbox_fs._sfs_native.

The module is split by topic, one C file and one header each (resolve, copy,
extract, scan, landlock, mount; sfs.h holds the ABI version and includes them).  The cdef
is those same headers, read as they are, so each prototype and constant is
written once; their ``#pragma once`` and ``#include`` lines are for the C
compiler and are left out.  The system constants Python reads come through
the cdef as ``#define NAME ...`` so the compiler fills them in from the system
headers.  The Landlock structs are defined in landlock.c because Debian 12's
linux-libc-dev (6.1) only describes Landlock ABI <= 2.
"""
import os

from cffi import FFI

HERE = os.path.dirname(os.path.abspath(__file__))

# Each topic: NAME.c and NAME.h, and the system constants Python reads with its functions.
TOPICS = (
    ("resolve", ("RESOLVE_NO_XDEV", "RESOLVE_NO_MAGICLINKS", "RESOLVE_NO_SYMLINKS", "RESOLVE_BENEATH",
                 "RESOLVE_IN_ROOT", "RENAME_NOREPLACE", "RENAME_EXCHANGE", "O_PATH", "O_TMPFILE")),
    ("copy", ()),
    ("extract", ()),
    ("scan", ()),
    ("landlock", ()),
    ("mount", ("FSOPEN_CLOEXEC", "FSMOUNT_CLOEXEC", "MOUNT_ATTR_NOSUID", "MOUNT_ATTR_NODEV",
               "CAP_CHOWN", "CAP_DAC_OVERRIDE", "CAP_DAC_READ_SEARCH", "CAP_FOWNER", "CAP_MKNOD")),
)
SOURCES = [name + ".c" for name, _ in TOPICS]


def header_cdef(name):
    """The cdef text of the header native/``name``: its lines without ``#pragma once`` and ``#include``.

    Raises:
        ValueError: the header holds another preprocessor line than ``#define`` (cffi cannot read it).
    """
    kept = []
    with open(os.path.join(HERE, name)) as f:
        for line in f.read().splitlines():
            directive = line.lstrip()
            if directive.startswith(("#pragma once", "#include ")):
                continue
            if directive.startswith("#") and not directive.startswith("#define "):
                raise ValueError(f"native/{name}: cffi cannot read {line!r}; keep it out of the header")
            kept.append(line)
    return "\n".join(kept)


def cdef():
    """The whole cdef: sfs.h, then per topic its system constants and its header."""
    parts = [header_cdef("sfs.h")]
    for name, system_constants in TOPICS:
        parts += [f"#define {constant} ..." for constant in system_constants]
        parts.append(header_cdef(name + ".h"))
    return "\n".join(parts)


ffibuilder = FFI()
ffibuilder.cdef(cdef())
ffibuilder.set_source(
    "sandbox_fs._sfs_native",
    '#include "sfs.h"\n',
    sources=[os.path.relpath(os.path.join(HERE, name)) for name in SOURCES],
    depends=[os.path.relpath(os.path.join(HERE, name)) for name in ["sfs.h", "internal.h"] +
             [topic + ".h" for topic, _ in TOPICS]],
    include_dirs=[os.path.relpath(HERE)],
    extra_compile_args=["-Wall", "-Wextra", "-Werror", "-O2", "-std=gnu11"],
)

if __name__ == "__main__":
    ffibuilder.compile(verbose=True)
