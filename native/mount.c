/*
 * sandbox-fs native: fsopen(2) / fsconfig(2) / fsmount(2), the calls that
 * make a mount attached nowhere (the FUSE overlay's), and the capability drop
 * the daemon makes once it is mounted.  Each returns a non-negative result or
 * -errno.  glibc 2.36 declares the mount calls in <sys/mount.h>,
 * which clashes with <linux/mount.h>, so they go through syscall(2).
 */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif
#include <errno.h>
#include <stddef.h>
#include <stdint.h>
#include <sys/prctl.h>
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

#ifndef PR_CAP_AMBIENT
#define PR_CAP_AMBIENT 47
#endif
#ifndef PR_CAP_AMBIENT_CLEAR_ALL
#define PR_CAP_AMBIENT_CLEAR_ALL 4
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

int sfs_drop_capabilities(unsigned long long keep) {
    /* The bounding set first: dropping from it needs CAP_SETPCAP, which the
       capset below removes unless kept.  EINVAL: beyond the kernel's last cap. */
    for (int cap = 0; cap < 64; cap++) {
        if (keep & (1ULL << cap))
            continue;
        if (prctl(PR_CAPBSET_DROP, cap, 0, 0, 0) < 0 && errno != EINVAL)
            return -errno;
    }
    if (prctl(PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0) < 0 && errno != EINVAL)
        return -errno;
    struct __user_cap_header_struct hdr = { _LINUX_CAPABILITY_VERSION_3, 0 };
    struct __user_cap_data_struct data[2];
    data[0].effective = data[0].permitted = (uint32_t)keep;
    data[1].effective = data[1].permitted = (uint32_t)(keep >> 32);
    data[0].inheritable = data[1].inheritable = 0;
    return ret_or_errno(syscall(SYS_capset, &hdr, data));
}
