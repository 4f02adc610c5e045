/*
 * Granted device nodes of sfs-exec (--device FD, --proc-read PATH): included
 * by sfs_exec.c after fail(), fd_path() and struct sfs_mount_attr, before
 * sfs_exec_root.h (which places them in the private root).
 *
 * The parent opened each node O_PATH by its trusted host-path rule (no
 * symlink on any component, a character or block device) and gave Landlock
 * READ_FILE | WRITE_FILE | IOCTL_DEV on exactly those inodes.  Here, while
 * still in the host's mount namespace, each node is cloned
 * (open_tree(OPEN_TREE_CLONE) of the fd: no path is looked up) with the
 * mount attributes read-only, nosuid, noexec and *not* nodev (cleared where
 * the kernel lets us: as root; in an unprivileged user namespace a nodev
 * flag of the source is locked and stays, and the clone is made inside the
 * new namespaces from the node found again there), and its host path is read.
 * After the mount layer is built, the clone is moved onto the node's path:
 *
 *   --ro-mounts: onto the node itself, reached by openat2(RESOLVE_NO_SYMLINKS)
 *      and checked to be the same inode (a bind onto itself: only the mount
 *      attributes change, so a nodev host mount does not make it unusable);
 *      a node hidden by the mount layer (under a --reach-tree stub or a
 *      --mask) fails with stage "device";
 *   --private-root: at the same path in the new root, on an empty file made
 *      on one of the helper's own tmpfs mounts (/dev, /tmp or the root), the
 *      directories made as for the grants; a path inside a grant or a system
 *      tree fails ("device" EXDEV): the helper never makes entries there.
 *
 * --proc-read PATH (a path under /proc, with --private-root and --ruleset):
 * after the mount steps, a Landlock read rule for PATH in the command's own
 * /proc instance (a driver's /proc/driver/...; the host's inode is not the
 * one the new instance shows); skipped when PATH does not exist there.
 *
 * Creating device nodes stays denied: mknod needs CAP_MKNOD (dropped), and
 * the ruleset grants MAKE_CHAR / MAKE_BLOCK nowhere.
 */
#ifndef SYS_openat2
#define SYS_openat2 437
#endif
#define SFS_MAX_DEVICES 32
#define SFS_DEV_ATTR_NODEV 0x4
#define SFS_DEV_ATTR_NOEXEC 0x8
#define SFS_DEV_RESOLVE_NO_SYMLINKS 0x04

struct sfs_dev_how {
    uint64_t flags, mode, resolve;
};

/* --device FDs as parsed, then their clones and host paths (by clone_devices). */
struct sfs_devices {
    int fds[SFS_MAX_DEVICES], clones[SFS_MAX_DEVICES], n;
    char *paths[SFS_MAX_DEVICES];
    char *procs[SFS_MAX_DEVICES];
    int nprocs;
};

static struct sfs_devices granted;

static void add_device_fd(int fd)
{
    if (granted.n == SFS_MAX_DEVICES)
        fail("usage", E2BIG);
    granted.fds[granted.n++] = fd;
}

/* --proc-read PATH: "/proc/" then at least one component, no "." or ".." (checked by the caller too). */
static void add_proc_read(char *path)
{
    if (granted.nprocs == SFS_MAX_DEVICES || strncmp(path, "/proc/", 6) != 0 || strstr(path, "/.")
        || strstr(path, "//"))
        fail("usage", EINVAL);
    granted.procs[granted.nprocs++] = path;
}

/* A detached clone of the device node fd: read-only, nosuid, noexec, nodev cleared if allowed. */
static int clone_device(int fd)
{
    struct stat st;
    if (fstat(fd, &st) < 0)
        fail("device", errno);
    if (!S_ISCHR(st.st_mode) && !S_ISBLK(st.st_mode))
        fail("device", ENODEV);
    long c = syscall(SYS_open_tree, fd, "", SFS_OPEN_TREE_CLONE | AT_EMPTY_PATH | O_CLOEXEC);
    if (c < 0)
        fail("device", errno);
    struct sfs_mount_attr ma = { SFS_MOUNT_ATTR_RDONLY | SFS_MOUNT_ATTR_NOSUID | SFS_DEV_ATTR_NOEXEC,
                                 SFS_DEV_ATTR_NODEV, 0, 0 };
    if (syscall(SYS_mount_setattr, (int)c, "", AT_EMPTY_PATH, &ma, sizeof ma) < 0) {
        if (errno != EPERM)
            fail("device", errno);
        ma.attr_clr = 0;                /* a locked nodev (user namespace): the kernel keeps it */
        if (syscall(SYS_mount_setattr, (int)c, "", AT_EMPTY_PATH, &ma, sizeof ma) < 0)
            fail("device", errno);
    }
    return (int)c;
}

/*
 * In the host's mount namespace: every granted node's path, and its clone
 * when clone_now (root).  Unprivileged, the clone is made later, inside the
 * new user and mount namespaces (a mount of another namespace cannot be
 * cloned from there, nor a clone made here moved into them).
 */
static void clone_devices(int clone_now)
{
    for (int k = 0; k < granted.n; k++) {
        granted.paths[k] = fd_path(granted.fds[k], "device");
        granted.clones[k] = clone_now ? clone_device(granted.fds[k]) : -1;
    }
}

/* --ro-mounts: each clone onto its own node, found again by path (no symlink) and checked by inode. */
static void attach_devices_in_place(void)
{
    for (int k = 0; k < granted.n; k++) {
        struct sfs_dev_how how = { O_PATH | O_NOFOLLOW | O_CLOEXEC, 0, SFS_DEV_RESOLVE_NO_SYMLINKS };
        struct stat a, b;
        int nfd = (int)syscall(SYS_openat2, AT_FDCWD, granted.paths[k], &how, sizeof how);
        if (nfd < 0)
            fail("device", errno);
        if (fstat(granted.fds[k], &a) < 0 || fstat(nfd, &b) < 0)
            fail("device", errno);
        if (a.st_dev != b.st_dev || a.st_ino != b.st_ino)
            fail("device", ESTALE);
        if (granted.clones[k] < 0)
            granted.clones[k] = clone_device(nfd);      /* unprivileged: this namespace's copy */
        if (syscall(SYS_move_mount, granted.clones[k], "", nfd, "",
                    SFS_MOVE_MOUNT_F_EMPTY_PATH | SFS_MOVE_MOUNT_T_EMPTY_PATH) < 0)
            fail("device", errno);
        close(granted.clones[k]);
        close(nfd);
        free(granted.paths[k]);
    }
    granted.n = 0;
}

/* After the mount steps, before restricting: read rules for the --proc-read paths that exist. */
static void add_proc_read_rules(int ruleset_fd, long long access)
{
    for (int k = 0; k < granted.nprocs; k++) {
        struct sfs_dev_how how = { O_PATH | O_CLOEXEC, 0, SFS_DEV_RESOLVE_NO_SYMLINKS };
        int fd = (int)syscall(SYS_openat2, AT_FDCWD, granted.procs[k], &how, sizeof how);
        if (fd < 0) {
            if (errno == ENOENT)
                continue;
            fail("device", errno);
        }
        struct stat st;
        if (fstat(fd, &st) < 0)
            fail("device", errno);
        struct sfs_path_beneath rule = { (uint64_t)(S_ISDIR(st.st_mode) ? access : (access & 4 /* READ_FILE */)), fd };
        if (syscall(SYS_landlock_add_rule, ruleset_fd, 1 /* PATH_BENEATH */, &rule, 0U) < 0)
            fail("device", errno);
        close(fd);
    }
}
