/* Resolution beneath a directory fd, and the *at calls the os module cannot make: resolve.c. */
#pragma once
#include <fcntl.h>              /* O_PATH, O_TMPFILE */
#include <stdint.h>
#include <stdio.h>              /* RENAME_NOREPLACE, RENAME_EXCHANGE */
#include <linux/openat2.h>      /* RESOLVE_* */

#define SFS_MAX_SYMLINK_HOPS 40   /* MAXSYMLINKS in the kernel */

int sfs_openat2(int dirfd, const char *path, uint64_t flags, uint64_t mode, uint64_t resolve);
int sfs_open_fallback(int rootfd, const char *path, uint64_t flags, uint64_t mode, uint64_t resolve);
int sfs_open_file(int dirfd, const char *path, uint64_t flags, uint64_t mode, uint64_t resolve,
                  int fallback, int allow_special);
int sfs_open_member(int dirfd, const char *path, uint64_t flags, uint64_t resolve, int fallback,
                    int probe, int64_t *out);
int sfs_renameat2(int olddirfd, const char *oldpath, int newdirfd, const char *newpath, unsigned int flags);
int sfs_set_times_fd(int fd, int64_t ns);
int sfs_fchown_fd(int fd, int64_t uid, int64_t gid);

/* Handle calls (sandbox_fs/_root_handle.py): one held fd, or a held directory fd plus one name. */
#define SFS_TIME_ATIME_OMIT 1
#define SFS_TIME_ATIME_NOW 2
#define SFS_TIME_MTIME_OMIT 4
#define SFS_TIME_MTIME_NOW 8
#define SFS_MAKE_DIR 1
#define SFS_MAKE_NODE 2
#define SFS_MAKE_SYMLINK 3
int sfs_fchmod_empty(int fd, uint32_t mode);
int sfs_utimens_empty(int fd, int64_t atime_ns, int64_t mtime_ns, int how);
int sfs_link_empty(int fd, int newdirfd, const char *name);
int sfs_open_name(int dirfd, const char *name, uint64_t flags, uint64_t mode, int allow_special,
                  int64_t expect_dev, int64_t expect_ino, int64_t uid, int64_t gid);
int sfs_make_name(int dirfd, const char *name, int kind, uint32_t mode, uint64_t rdev, const char *target,
                  int64_t uid, int64_t gid);
int64_t sfs_getdents(int fd, char *buf, uint64_t len);
