/* The new mount API, for the FUSE overlay's detached mount: mount.c. */
#pragma once
#include <linux/mount.h>        /* FSOPEN_*, FSMOUNT_*, MOUNT_ATTR_* */

int sfs_fsopen(const char *fsname, unsigned int flags);
int sfs_fsconfig_string(int fs_fd, const char *key, const char *value);
int sfs_fsconfig_flag(int fs_fd, const char *key);
int sfs_fsconfig_create(int fs_fd);
int sfs_fsmount(int fs_fd, unsigned int flags, unsigned int attr_flags);
