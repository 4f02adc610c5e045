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
int sfs_renameat2(int olddirfd, const char *oldpath, int newdirfd, const char *newpath, unsigned int flags);
int sfs_set_times_fd(int fd, int64_t ns);
int sfs_fchown_fd(int fd, int64_t uid, int64_t gid);
