/*
 * The private root of sfs-exec (--private-root): included by sfs_exec.c after
 * fail(), fd_path(), reopen_here() and struct sfs_binds.
 *
 * With --private-root FD the command does not see the host's tree at all.
 * In the command's own process (after --init: inside its own PID namespace)
 * the helper
 *
 *   1. clones every tree it was handed, by fd, while still in the host's
 *      mount namespace (open_tree(OPEN_TREE_CLONE): no path is looked up):
 *      FD (the workspace overlay, a detached mount made with fsmount), each
 *      --sys-tree, each grant (--rw-tree, --reach-tree, --ro-tree,
 *      --pin-tree), the device nodes of /dev below, the granted --device
 *      nodes (sfs_exec_devices.h), and the PTY slave on fd 0 with --tty;
 *   2. unshare(CLONE_NEWNS), makes every mount private, and mounts a new
 *      tmpfs (fsopen/fsmount) on top of "/" of that namespace;
 *   3. fills it, every mount point looked up beneath the tmpfs' own fd one
 *      component at a time with O_NOFOLLOW (directories are only ever made on
 *      the helper's own tmpfs mounts, never inside a grant or a system tree):
 *        - each --sys-tree at its own path, read-only, nosuid, nodev;
 *          each --sys-link PATH=TARGET as a symlink (/bin -> usr/bin);
 *        - /tmp: a private tmpfs (nosuid, nodev; SFS_PRIVATE_TMP_OPTS);
 *        - /dev: a tmpfs (nosuid, noexec, read-only once filled) holding read-only
 *          binds of the host's null, zero, full, random and urandom, with
 *          --tty also tty and the PTY slave at /dev/pts/N, and the symlinks
 *          fd, stdin, stdout, stderr into /proc/self/fd, and the granted
 *          --device nodes under /dev at their paths (binds without nodev);
 *        - /proc: a new proc instance of the command's own PID namespace
 *          (read-only, as the read-only mount layer leaves the host's, nosuid,
 *          nodev, noexec); refused (ENOTSUP) when the command has no
 *          PID namespace of its own, since it would show the host's processes;
 *        - the grants at their host paths, outer first (read-write ones
 *          nosuid, nodev; read-only ones and --ro-tree also read-only;
 *          --pin-tree bound onto itself);
 *        - the granted --device nodes outside /dev, at their paths on the
 *          root tmpfs or the private /tmp (never inside a grant);
 *        - last, so nothing can shadow it, the workspace clone at
 *          --workspace-path (nosuid, nodev);
 *   4. makes the tmpfs root read-only, pivot_root(".", ".") into it and
 *      detaches the old root: nothing else of the host is left;
 *   5. enters the working directory: --cwd-rel REL resolved beneath the
 *      workspace (openat2 RESOLVE_BENEATH | RESOLVE_NO_MAGICLINKS), or --cwd
 *      FD (a directory of a grant) reopened at its path in the new root and
 *      checked to be the same inode.
 *
 * The parent chooses what is mounted, never where outside the new root: the
 * paths are those the kernel reports for the fds (grants, system trees) or
 * --workspace-path, all placed beneath the tmpfs.
 */
#include <sys/statfs.h>

#ifndef SYS_fsopen
#define SYS_fsopen 430
#endif
#ifndef SYS_fsconfig
#define SYS_fsconfig 431
#endif
#ifndef SYS_fsmount
#define SYS_fsmount 432
#endif
#ifndef SYS_pivot_root
#define SYS_pivot_root 155
#endif
#define SFS_FSOPEN_CLOEXEC 1
#define SFS_FSCONFIG_SET_STRING 1
#define SFS_FSCONFIG_CMD_CREATE 6
#define SFS_FSMOUNT_CLOEXEC 1
#define SFS_MOUNT_ATTR_NODEV 0x4
#define SFS_MOUNT_ATTR_NOEXEC 0x8
#define SFS_RESOLVE_NO_MAGICLINKS 0x02
#define SFS_RESOLVE_BENEATH 0x08
#define SFS_TMPFS_MAGIC 0x01021994
#define SFS_MAX_LINKS 16
#define SFS_MAX_PRIVATE (SFS_MAX_TREES * 4 + 8)

#define SFS_ROOT_OPTS "size=1m,nr_inodes=4096,mode=0755"
#define SFS_DEV_OPTS "size=64k,nr_inodes=64,mode=0755"
#define SFS_PRIVATE_TMP_OPTS "size=256m,nr_inodes=65536,mode=1777"

struct sfs_open_how {
    uint64_t flags, mode, resolve;
};

/* What --private-root and its companions asked for. */
struct sfs_private {
    int ws_fd;                  /* --private-root: the workspace's detached mount */
    const char *ws_path;        /* --workspace-path */
    const char *cwd_rel;        /* --cwd-rel: the cwd beneath the workspace */
    int sys[SFS_MAX_TREES], nsys;
    char *links[SFS_MAX_LINKS];
    int nlinks;
};

/* One clone to attach in the new root: at path, in path order. */
struct sfs_placed {
    int clone;
    char *path;
};

/* The helper's own tmpfs mounts (st_dev): the only places it makes directories. */
static dev_t own_devs[4];
static int n_own_devs;

/* Is path absolute, without empty, "." or ".." components, and not "/" itself? */
static int plain_abs_path(const char *path)
{
    if (path[0] != '/' || path[1] == '\0' || strlen(path) >= 4096)
        return 0;
    for (const char *p = path + 1;;) {
        size_t len = strcspn(p, "/");
        if (len == 0 || (len == 1 && p[0] == '.') || (len == 2 && p[0] == '.' && p[1] == '.'))
            return 0;
        if (p[len] == '\0')
            return 1;
        p += len + 1;
    }
}

/* A detached clone of the tree at fd with attr set on every mount of it. */
static int clone_tree(int fd, uint64_t attr, int recursive)
{
    unsigned flags = SFS_OPEN_TREE_CLONE | AT_EMPTY_PATH | O_CLOEXEC | (recursive ? SFS_AT_RECURSIVE : 0);
    long c = syscall(SYS_open_tree, fd, "", flags);
    if (c < 0)
        fail("privroot", errno);
    struct sfs_mount_attr ma = { attr, 0, 0, 0 };
    if (attr && syscall(SYS_mount_setattr, (int)c, "", AT_EMPTY_PATH | (recursive ? SFS_AT_RECURSIVE : 0),
                        &ma, sizeof ma) < 0)
        fail("privroot", errno);
    return (int)c;
}

/* A new detached mount of fstype (tmpfs with opts "k=v,..." or proc), with attr. */
static int new_mount(const char *fstype, const char *opts, uint64_t attr)
{
    int fs = (int)syscall(SYS_fsopen, fstype, SFS_FSOPEN_CLOEXEC);
    if (fs < 0)
        fail("privroot", errno);
    char buf[128];
    if (opts) {
        if (strlen(opts) >= sizeof buf)
            fail("privroot", E2BIG);
        strcpy(buf, opts);
        char *save = NULL;
        for (char *kv = strtok_r(buf, ",", &save); kv; kv = strtok_r(NULL, ",", &save)) {
            char *eq = strchr(kv, '=');
            if (!eq)
                fail("privroot", EINVAL);
            *eq = '\0';
            if (syscall(SYS_fsconfig, fs, SFS_FSCONFIG_SET_STRING, kv, eq + 1, 0) < 0)
                fail("privroot", errno);
        }
    }
    if (syscall(SYS_fsconfig, fs, SFS_FSCONFIG_CMD_CREATE, NULL, NULL, 0) < 0)
        fail("privroot", errno);
    int m = (int)syscall(SYS_fsmount, fs, SFS_FSMOUNT_CLOEXEC, (unsigned)attr);
    if (m < 0)
        fail("privroot", errno);
    close(fs);
    return m;
}

/* Record a tmpfs of ours (by its mount fd) as a place where directories may be made. */
static void own_mount(int mfd)
{
    struct stat st;
    if (fstat(mfd, &st) < 0)
        fail("privroot", errno);
    if (n_own_devs == (int)(sizeof own_devs / sizeof own_devs[0]))
        fail("privroot", E2BIG);
    own_devs[n_own_devs++] = st.st_dev;
}

static int is_own(int dirfd)
{
    struct stat st;
    struct statfs sf;
    if (fstat(dirfd, &st) < 0 || fstatfs(dirfd, &sf) < 0)
        fail("privroot", errno);
    for (int k = 0; k < n_own_devs; k++)
        if (own_devs[k] == st.st_dev && sf.f_type == SFS_TMPFS_MAGIC)
            return 1;
    return 0;
}

/*
 * An O_PATH fd on the directory path (plain, absolute) beneath rootfd,
 * each component opened with O_NOFOLLOW; a missing one is made (mode
 * 0755) only inside one of the helper's own tmpfs mounts, else ENOENT.
 */
static int beneath(int rootfd, const char *path)
{
    if (!plain_abs_path(path))
        fail("privroot", EINVAL);
    int fd = fcntl(rootfd, F_DUPFD_CLOEXEC, 3);
    if (fd < 0)
        fail("privroot", errno);
    for (const char *p = path + 1; *p;) {
        char name[256];
        size_t len = strcspn(p, "/");
        if (len >= sizeof name)
            fail("privroot", ENAMETOOLONG);
        memcpy(name, p, len);
        name[len] = '\0';
        p += len + (p[len] == '/');
        int nfd = openat(fd, name, O_PATH | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
        if (nfd < 0 && errno == ENOENT && is_own(fd)) {
            if (mkdirat(fd, name, 0755) < 0)
                fail("privroot", errno);
            if (fchmodat(fd, name, 0755, 0) < 0)      /* the directory just made: whatever the umask */
                fail("privroot", errno);
            nfd = openat(fd, name, O_PATH | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
        }
        if (nfd < 0)
            fail("privroot", errno);
        close(fd);
        fd = nfd;
    }
    return fd;
}

/* Move the detached clone onto the directory (or file) dirfd; closes both. */
static void attach(int clone, int dirfd)
{
    if (syscall(SYS_move_mount, clone, "", dirfd, "", SFS_MOVE_MOUNT_F_EMPTY_PATH | SFS_MOVE_MOUNT_T_EMPTY_PATH) < 0)
        fail("privroot", errno);
    close(clone);
    close(dirfd);
}

static int by_path(const void *a, const void *b)
{
    return strcmp(((const struct sfs_placed *)a)->path, ((const struct sfs_placed *)b)->path);
}

/* Clone each fds[] tree with attr and add it at its own host path to out[]. */
static void place_trees(const int *fds, int n, uint64_t attr, int recursive, struct sfs_placed *out, int *nout)
{
    for (int t = 0; t < n; t++) {
        if (*nout == SFS_MAX_PRIVATE)
            fail("privroot", E2BIG);
        out[*nout].path = fd_path(fds[t], "privroot");
        if (!plain_abs_path(out[*nout].path))
            fail("privroot", EINVAL);
        out[(*nout)++].clone = clone_tree(fds[t], attr, recursive);
    }
}

/* The device nodes of the private /dev (host /dev/NAME, bound read-only). */
static const char *const sfs_dev_nodes[] = { "null", "zero", "full", "random", "urandom" };
#define SFS_N_DEV_NODES (sizeof sfs_dev_nodes / sizeof sfs_dev_nodes[0])

/* Clones of the device nodes (and with tty: /dev/tty, then the PTY slave on fd 0, or -1). */
struct sfs_devs {
    int nodes[SFS_N_DEV_NODES], tty, pts;
    char pts_name[16];
};

/* A read-only clone of the host's character device /dev/name. */
static int clone_dev(int devfd, const char *name)
{
    struct stat st;
    int fd = openat(devfd, name, O_PATH | O_NOFOLLOW | O_CLOEXEC);
    if (fd < 0 || fstat(fd, &st) < 0)
        fail("privroot", errno);
    if (!S_ISCHR(st.st_mode))
        fail("privroot", ENODEV);
    int c = clone_tree(fd, SFS_MOUNT_ATTR_RDONLY | SFS_MOUNT_ATTR_NOSUID | SFS_MOUNT_ATTR_NOEXEC, 0);
    close(fd);
    return c;
}

static void clone_devs(struct sfs_devs *d, int tty)
{
    int devfd = open("/dev", O_PATH | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
    if (devfd < 0)
        fail("privroot", errno);
    for (size_t k = 0; k < SFS_N_DEV_NODES; k++)
        d->nodes[k] = clone_dev(devfd, sfs_dev_nodes[k]);
    d->tty = tty ? clone_dev(devfd, "tty") : -1;
    close(devfd);
    d->pts = -1;
    if (!tty)
        return;
    /* The PTY slave the command runs on: bound at the name it has on the host. */
    char *path = fd_path(0, "privroot");
    const char *num = strncmp(path, "/dev/pts/", 9) == 0 ? path + 9 : "";
    if (*num && strlen(num) < sizeof d->pts_name
        && strspn(num, "0123456789") == strlen(num)) {
        strcpy(d->pts_name, num);
        d->pts = clone_tree(0, SFS_MOUNT_ATTR_RDONLY | SFS_MOUNT_ATTR_NOSUID | SFS_MOUNT_ATTR_NOEXEC, 0);
    }
    free(path);
}

/* An empty regular file name in dirfd, as the mount point of a device node; its O_PATH fd. */
static int file_point(int dirfd, const char *name)
{
    int fd = openat(dirfd, name, O_CREAT | O_EXCL | O_WRONLY | O_NOFOLLOW | O_CLOEXEC, 0444);
    if (fd < 0)
        fail("privroot", errno);
    close(fd);
    fd = openat(dirfd, name, O_PATH | O_NOFOLLOW | O_CLOEXEC);
    if (fd < 0)
        fail("privroot", errno);
    return fd;
}

/*
 * The granted device nodes (sfs_exec_devices.h) under /dev (under_dev) or
 * elsewhere, each at its host path on an empty file made on one of our own
 * tmpfs mounts; never inside a grant or a system tree (EXDEV).
 */
static void place_devices(int rootfd, int under_dev)
{
    for (int k = 0; k < granted.n; k++) {
        char *path = granted.paths[k], *slash = strrchr(path, '/');
        if (granted.clones[k] < 0 || (strncmp(path, "/dev/", 5) == 0) != under_dev)
            continue;
        int dirfd;
        if (slash == path)
            dirfd = fcntl(rootfd, F_DUPFD_CLOEXEC, 3);
        else {
            *slash = '\0';
            dirfd = beneath(rootfd, path);
            *slash = '/';
        }
        if (dirfd < 0)
            fail("device", errno);
        if (!is_own(dirfd))
            fail("device", EXDEV);
        int point = openat(dirfd, slash + 1, O_CREAT | O_EXCL | O_WRONLY | O_NOFOLLOW | O_CLOEXEC, 0444);
        if (point >= 0)
            close(point);
        else if (errno != EEXIST)       /* a node of the minimal /dev granted again: bound over it */
            fail("device", errno);
        point = openat(dirfd, slash + 1, O_PATH | O_NOFOLLOW | O_CLOEXEC);
        if (point < 0)
            fail("device", errno);
        close(dirfd);
        attach(granted.clones[k], point);
        granted.clones[k] = -1;
        free(path);
    }
}

/* The private /dev beneath rootfd: a tmpfs of device binds and /proc/self links, then read-only. */
static void private_dev(int rootfd, struct sfs_devs *d)
{
    static const char *const links[][2] = {
        { "fd", "/proc/self/fd" }, { "stdin", "/proc/self/fd/0" },
        { "stdout", "/proc/self/fd/1" }, { "stderr", "/proc/self/fd/2" },
    };
    int m = new_mount("tmpfs", SFS_DEV_OPTS, SFS_MOUNT_ATTR_NOSUID | SFS_MOUNT_ATTR_NOEXEC);
    attach(dup(m), beneath(rootfd, "/dev"));
    for (size_t k = 0; k < SFS_N_DEV_NODES; k++)
        attach(d->nodes[k], file_point(m, sfs_dev_nodes[k]));
    if (d->tty >= 0)
        attach(d->tty, file_point(m, "tty"));
    if (d->pts >= 0) {
        if (mkdirat(m, "pts", 0755) < 0)
            fail("privroot", errno);
        int pts = openat(m, "pts", O_PATH | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
        if (pts < 0)
            fail("privroot", errno);
        attach(d->pts, file_point(pts, d->pts_name));
        close(pts);
    }
    own_mount(m);                       /* the granted nodes' directories may be made here */
    place_devices(rootfd, 1);
    for (size_t k = 0; k < sizeof links / sizeof links[0]; k++)
        if (symlinkat(links[k][1], m, links[k][0]) < 0)
            fail("privroot", errno);
    struct sfs_mount_attr ro = { SFS_MOUNT_ATTR_RDONLY, 0, 0, 0 };
    if (syscall(SYS_mount_setattr, m, "", AT_EMPTY_PATH, &ro, sizeof ro) < 0)
        fail("privroot", errno);
    close(m);
}

/* Is spec "PATH=TARGET" with PATH plain and absolute and TARGET not empty? */
static int sys_link_spec(const char *spec)
{
    const char *eq = strchr(spec, '=');
    char path[4096];
    if (!eq || eq[1] == '\0' || (size_t)(eq - spec) >= sizeof path)
        return 0;
    memcpy(path, spec, (size_t)(eq - spec));
    path[eq - spec] = '\0';
    return plain_abs_path(path);
}

/* --sys-link PATH=TARGET (checked by sys_link_spec): a symlink at PATH beneath rootfd. */
static void sys_link(int rootfd, char *spec)
{
    char *eq = strchr(spec, '=');
    *eq = '\0';
    char *slash = strrchr(spec, '/');
    int dirfd;
    if (slash == spec) {
        dirfd = fcntl(rootfd, F_DUPFD_CLOEXEC, 3);
        if (dirfd < 0)
            fail("privroot", errno);
    } else {
        *slash = '\0';
        dirfd = beneath(rootfd, spec);
        *slash = '/';
    }
    if (symlinkat(eq + 1, dirfd, slash + 1) < 0)
        fail("privroot", errno);
    close(dirfd);
    *eq = '=';
}

/* After pivot_root: the working directory as an O_PATH fd (or -1: the workspace itself). */
static int private_cwd(const struct sfs_private *pr, int cwd_fd, char *cwd_path)
{
    if (cwd_path) {                     /* --cwd FD: a directory of a grant, at its host path */
        int nfd = reopen_here(cwd_fd, cwd_path, "cwd");
        close(cwd_fd);
        free(cwd_path);
        return nfd;
    }
    if (cwd_fd >= 0)
        close(cwd_fd);
    int ws = open(pr->ws_path, O_PATH | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
    if (ws < 0)
        fail("cwd", errno);
    if (!pr->cwd_rel || !pr->cwd_rel[0])
        return ws;
    struct sfs_open_how how = { O_PATH | O_DIRECTORY | O_CLOEXEC, 0,
                                SFS_RESOLVE_BENEATH | SFS_RESOLVE_NO_MAGICLINKS };
    int fd = (int)syscall(SYS_openat2, ws, pr->cwd_rel, &how, sizeof how);
    if (fd < 0)
        fail("cwd", errno);
    close(ws);
    return fd;
}

/* Clone what the new root will hold (still in the host's namespace); returns the count placed. */
static int clone_all(const struct sfs_private *pr, const int *rw, int nrw, const int *reach, int nreach,
                     const struct sfs_binds *b, struct sfs_placed *trees, int *ws_clone)
{
    const uint64_t ro = SFS_MOUNT_ATTR_RDONLY | SFS_MOUNT_ATTR_NOSUID | SFS_MOUNT_ATTR_NODEV;
    const uint64_t rw_attr = SFS_MOUNT_ATTR_NOSUID | SFS_MOUNT_ATTR_NODEV;
    int n = 0;
    place_trees(pr->sys, pr->nsys, ro, 1, trees, &n);
    int nsys = n;
    place_trees(rw, nrw, rw_attr, 1, trees, &n);
    place_trees(b->pins, b->npins, rw_attr, 1, trees, &n);
    place_trees(reach, nreach, ro, 1, trees, &n);
    place_trees(b->ro, b->nro, ro, 1, trees, &n);
    qsort(trees + nsys, (size_t)(n - nsys), sizeof *trees, by_path);  /* grants: outer first */
    *ws_clone = clone_tree(pr->ws_fd, rw_attr, 1);
    return n;
}

/*
 * Build the command's root (see the top of this file) and enter it;
 * *cwd_fd is replaced by the working directory in the new root.
 */
static void private_root(const struct sfs_private *pr, const int *rw, int nrw, const int *reach, int nreach,
                         const struct sfs_binds *b, int tty, int *cwd_fd)
{
    static struct sfs_placed trees[SFS_MAX_PRIVATE];
    struct sfs_devs devs;
    int ws_clone;
    if (geteuid() != 0)
        fail("privroot", EPERM);
    if (!in_own_pid_ns)
        fail("privroot", ENOTSUP);      /* a /proc of the host's processes */
    char *cwd_path = *cwd_fd >= 0 && !pr->cwd_rel ? fd_path(*cwd_fd, "cwd") : NULL;
    int n = clone_all(pr, rw, nrw, reach, nreach, b, trees, &ws_clone);
    clone_devs(&devs, tty);
    clone_devices(1);                   /* the granted nodes: sfs_exec_devices.h */
    if (unshare(CLONE_NEWNS) < 0)
        fail("privroot", errno);
    if (mount(NULL, "/", NULL, MS_REC | MS_PRIVATE, NULL) < 0)
        fail("privroot", errno);
    int root = new_mount("tmpfs", SFS_ROOT_OPTS, SFS_MOUNT_ATTR_NOSUID | SFS_MOUNT_ATTR_NODEV);
    if (syscall(SYS_move_mount, root, "", AT_FDCWD, "/", SFS_MOVE_MOUNT_F_EMPTY_PATH) < 0)
        fail("privroot", errno);
    own_mount(root);
    for (int t = 0; t < pr->nlinks; t++)
        sys_link(root, pr->links[t]);
    int tmp = new_mount("tmpfs", SFS_PRIVATE_TMP_OPTS, SFS_MOUNT_ATTR_NOSUID | SFS_MOUNT_ATTR_NODEV);
    own_mount(tmp);
    attach(tmp, beneath(root, "/tmp"));
    private_dev(root, &devs);
    attach(new_mount("proc", NULL, SFS_MOUNT_ATTR_RDONLY | SFS_MOUNT_ATTR_NOSUID | SFS_MOUNT_ATTR_NODEV
                     | SFS_MOUNT_ATTR_NOEXEC), beneath(root, "/proc"));
    for (int t = 0; t < n; t++) {       /* system trees, then grants outer first */
        attach(trees[t].clone, beneath(root, trees[t].path));
        free(trees[t].path);
    }
    place_devices(root, 0);             /* outside /dev: on the root tmpfs or the private /tmp */
    attach(ws_clone, beneath(root, pr->ws_path));   /* last: nothing shadows the workspace */
    apply_guards(root, pr->ws_path);                /* protected entries, over the workspace too */
    struct sfs_mount_attr ro = { SFS_MOUNT_ATTR_RDONLY, 0, 0, 0 };
    if (syscall(SYS_mount_setattr, root, "", AT_EMPTY_PATH, &ro, sizeof ro) < 0)
        fail("privroot", errno);
    if (fchdir(root) < 0 || syscall(SYS_pivot_root, ".", ".") < 0)
        fail("privroot", errno);
    if (umount2(".", MNT_DETACH) < 0 || chdir("/") < 0)
        fail("privroot", errno);
    close(root);
    *cwd_fd = private_cwd(pr, *cwd_fd, cwd_path);
}
