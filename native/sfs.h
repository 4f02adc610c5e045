/*
 * The interface of the sandbox-fs native module (sandbox_fs._sfs_native), one
 * header per topic, each beside its C file.  native/build.py hands these same
 * headers to cffi as the cdef, so every prototype and constant is written
 * once: a header holds only what cffi reads (declarations, #define NAME VALUE)
 * plus #pragma once and #include lines, which build.py leaves out.
 *
 * Every function returns a non-negative result (fd, count, ABI number) or a
 * negative errno; errno itself is never the error channel.  Syscalls only:
 * policy lives in Python (sandbox_fs/_native.py and its callers).
 */
#pragma once

/* Bumped whenever a signature changes; checked by sandbox_fs/_native.py. */
#define SFS_ABI_VERSION 11

#include "resolve.h"
#include "copy.h"
#include "extract.h"
#include "scan.h"
#include "landlock.h"
#include "mount.h"
