/* Shared between the native C files; not part of the Python module's interface. */
#pragma once
#include <stddef.h>
#include <stdint.h>

/* The ways sfs_copy_range moves bytes, best first (copy.c). */
enum sfs_copy_way { SFS_COPY_FILE_RANGE = 0, SFS_COPY_SENDFILE = 1, SFS_COPY_READ_WRITE = 2 };
int64_t sfs_copy_range(int in_fd, int64_t *in_off, int out_fd, int64_t len, int *way);
int sfs_write_all(int fd, const char *buf, size_t len);

/* fd metadata (resolve.c): 0 or -errno. */
int sfs_set_times_ns(int fd, int64_t ns);
int sfs_own_fd(int fd, int64_t uid, int64_t gid);
