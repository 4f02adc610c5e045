/*
 * sandbox-fs native: fsopen(2) / fsconfig(2) / fsmount(2), the calls that
 * make a mount attached nowhere (the FUSE overlay's).  Each returns a non-negative
 * result or -errno.  glibc 2.36 declares the mount calls in <sys/mount.h>,
 * which clashes with <linux/mount.h>, so they go through syscall(2).
 */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif
#include <errno.h>
#include <stddef.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "sfs.h"

#ifndef SYS_fsopen
#define SYS_fsopen 430
#endif
#ifndef SYS_fsconfig
#define SYS_fsconfig 431
#endif
#ifndef SYS_fsmount
#define SYS_fsmount 432
#endif

static int ret_or_errno(long ret) {
    return ret < 0 ? -errno : (int)ret;
}

int sfs_fsopen(const char *fsname, unsigned int flags) {
    return ret_or_errno(syscall(SYS_fsopen, fsname, flags));
}

int sfs_fsconfig_string(int fs_fd, const char *key, const char *value) {
    return ret_or_errno(syscall(SYS_fsconfig, fs_fd, FSCONFIG_SET_STRING, key, value, 0));
}

int sfs_fsconfig_flag(int fs_fd, const char *key) {
    return ret_or_errno(syscall(SYS_fsconfig, fs_fd, FSCONFIG_SET_FLAG, key, NULL, 0));
}

int sfs_fsconfig_create(int fs_fd) {
    return ret_or_errno(syscall(SYS_fsconfig, fs_fd, FSCONFIG_CMD_CREATE, NULL, NULL, 0));
}

int sfs_fsmount(int fs_fd, unsigned int flags, unsigned int attr_flags) {
    return ret_or_errno(syscall(SYS_fsmount, fs_fd, flags, attr_flags));
}
