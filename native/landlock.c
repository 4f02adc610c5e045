/*
 * sandbox-fs native: the Landlock syscalls.  Returns -errno on failure.
 */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif
#include <errno.h>
#include <stdint.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "sfs.h"

#ifndef SYS_landlock_create_ruleset
#define SYS_landlock_create_ruleset 444
#endif
#ifndef SYS_landlock_add_rule
#define SYS_landlock_add_rule 445
#endif

/* ------------------------------------------------------------------ */
/* Landlock (structs defined here: bookworm's headers stop at ABI 2)   */
/* ------------------------------------------------------------------ */

struct sfs_ruleset_attr {
    uint64_t handled_access_fs;
    uint64_t handled_access_net;
    uint64_t scoped;
};

struct sfs_path_beneath {
    uint64_t allowed_access;
    int32_t parent_fd;
} __attribute__((packed));

struct sfs_net_port {
    uint64_t allowed_access;
    uint64_t port;
};

int sfs_landlock_abi(void)
{
    long v = syscall(SYS_landlock_create_ruleset, NULL, 0, 1U /* VERSION */);
    return v < 0 ? -errno : (int)v;
}

int sfs_landlock_create(uint64_t fs, uint64_t net, uint64_t scoped)
{
    struct sfs_ruleset_attr attr = { fs, net, scoped };
    size_t size = scoped ? 24 : (net ? 16 : 8);
    long fd = syscall(SYS_landlock_create_ruleset, &attr, size, 0U);
    return fd < 0 ? -errno : (int)fd;
}

int sfs_landlock_add_path(int ruleset_fd, int parent_fd, uint64_t access)
{
    struct sfs_path_beneath rule = { access, parent_fd };
    if (syscall(SYS_landlock_add_rule, ruleset_fd, 1 /* PATH_BENEATH */, &rule, 0U) < 0)
        return -errno;
    return 0;
}

int sfs_landlock_add_port(int ruleset_fd, uint64_t port, uint64_t access)
{
    struct sfs_net_port rule = { access, port };
    if (syscall(SYS_landlock_add_rule, ruleset_fd, 2 /* NET_PORT */, &rule, 0U) < 0)
        return -errno;
    return 0;
}
