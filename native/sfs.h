#ifndef SFS_H
#define SFS_H
#include <stdint.h>

/* Bumped whenever a signature below changes; checked by sandbox_fs/_native.py. */
#define SFS_ABI_VERSION 1
#define SFS_MAX_SYMLINK_HOPS 40   /* MAXSYMLINKS in the kernel */
#define SFS_EAGAIN_RETRIES 128
#define SFS_COPY_BUF 65536

int sfs_openat2(int dirfd, const char *path, uint64_t flags, uint64_t mode, uint64_t resolve);
int sfs_open_fallback(int rootfd, const char *path, uint64_t flags, uint64_t mode, uint64_t resolve);
int sfs_renameat2(int olddirfd, const char *oldpath, int newdirfd, const char *newpath, unsigned int flags);
int64_t sfs_copy(int in_fd, int out_fd, int64_t max_bytes);
int sfs_landlock_abi(void);
int sfs_landlock_create(uint64_t fs, uint64_t net, uint64_t scoped);
int sfs_landlock_add_path(int ruleset_fd, int parent_fd, uint64_t access);
int sfs_landlock_add_port(int ruleset_fd, uint64_t port, uint64_t access);
#endif
