/* Shared between the native C files; not part of the Python module's interface. */
#pragma once
#include <stddef.h>
#include <stdint.h>

#define SFS_COPY_BUF 65536       /* bytes a read/write copy moves per call */

int sfs_write_all(int fd, const char *buf, size_t len);
int sfs_set_times_ns(int fd, int64_t ns);
int sfs_own_fd(int fd, int64_t uid, int64_t gid);
