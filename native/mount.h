/* The new mount API, for the FUSE overlay's detached mount, and its daemon's capability drop: mount.c. */
#pragma once
#include <linux/mount.h>        /* FSOPEN_*, FSMOUNT_*, MOUNT_ATTR_* */
#include <linux/capability.h>   /* CAP_*, capset's structs */

int sfs_fsopen(const char *fsname, unsigned int flags);
int sfs_fsconfig_string(int fs_fd, const char *key, const char *value);
int sfs_fsconfig_flag(int fs_fd, const char *key);
int sfs_fsconfig_create(int fs_fd);
int sfs_fsmount(int fs_fd, unsigned int flags, unsigned int attr_flags);
/* Drop every capability not in the bit mask keep (bit n = capability n) from
   the calling thread's bounding, ambient, inheritable, permitted and effective
   sets.  Capabilities are per thread: call it before any other thread exists. */
int sfs_drop_capabilities(unsigned long long keep);
