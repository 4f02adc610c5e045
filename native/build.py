"""cffi build script (API mode, out-of-line) for sandbox_fs._sfs_native.

Constants come through the cdef as ``...`` so the C compiler fills them in
from the system headers; the Landlock structs are defined in sfs.c because
Debian 12's linux-libc-dev (6.1) only describes Landlock ABI <= 2.
"""
import os

from cffi import FFI

HERE = os.path.dirname(os.path.abspath(__file__))

CDEF = """
#define SFS_ABI_VERSION ...
#define SFS_MAX_SYMLINK_HOPS ...
#define RESOLVE_NO_XDEV ...
#define RESOLVE_NO_MAGICLINKS ...
#define RESOLVE_NO_SYMLINKS ...
#define RESOLVE_BENEATH ...
#define RESOLVE_IN_ROOT ...
#define RENAME_NOREPLACE ...
#define RENAME_EXCHANGE ...
#define O_PATH ...
#define O_TMPFILE ...
int sfs_openat2(int dirfd, const char *path, uint64_t flags, uint64_t mode, uint64_t resolve);
int sfs_open_fallback(int rootfd, const char *path, uint64_t flags, uint64_t mode, uint64_t resolve);
int sfs_open_file(int dirfd, const char *path, uint64_t flags, uint64_t mode, uint64_t resolve, int fallback, int allow_special);
int sfs_renameat2(int olddirfd, const char *oldpath, int newdirfd, const char *newpath, unsigned int flags);
int64_t sfs_copy(int in_fd, int out_fd, int64_t max_bytes);
#define SFS_XFER_CHECK_IDENT ...
#define SFS_XFER_FSYNC ...
#define SFS_XFER_SET_MTIME ...
#define SFS_XFER_MORE ...
#define SFS_STAGE_SRC_OPEN ...
#define SFS_STAGE_SRC_CHANGED ...
#define SFS_STAGE_TMP_CREATE ...
#define SFS_STAGE_COPY ...
#define SFS_STAGE_META ...
#define SFS_STAGE_RENAME ...
struct sfs_xfer {
    uint64_t dev, ino;
    int64_t max_bytes;
    int64_t mtime_ns;
    uint32_t mode;
    int flags;
    int64_t size;
    int stage;
    int src_fd, tmp_fd;
};
int sfs_xfer_file(int src_dirfd, const char *src_name, int dst_dirfd, const char *tmp_name,
                  const char *dst_name, struct sfs_xfer *x, char *buf, int64_t buflen);
int sfs_xfer_finish(int dst_dirfd, const char *tmp_name, const char *dst_name, struct sfs_xfer *x);
void sfs_xfer_abort(int dst_dirfd, const char *tmp_name, struct sfs_xfer *x);
int sfs_landlock_abi(void);
int sfs_landlock_create(uint64_t fs, uint64_t net, uint64_t scoped);
int sfs_landlock_add_path(int ruleset_fd, int parent_fd, uint64_t access);
int sfs_landlock_add_port(int ruleset_fd, uint64_t port, uint64_t access);
"""

ffibuilder = FFI()
ffibuilder.cdef(CDEF)
ffibuilder.set_source(
    "sandbox_fs._sfs_native",
    '#include <fcntl.h>\n#include <stdio.h>\n#include <linux/openat2.h>\n#include "sfs.h"\n',
    sources=[os.path.relpath(os.path.join(HERE, "sfs.c"))],
    include_dirs=[os.path.relpath(HERE)],
    extra_compile_args=["-Wall", "-Wextra", "-Werror", "-O2", "-std=gnu11"],
)

if __name__ == "__main__":
    ffibuilder.compile(verbose=True)
