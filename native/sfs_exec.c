/*
 * sfs-exec: the single-threaded exec helper of sandbox_fs.exec.
 *
 * The Python parent (a multi-threaded trio process) must not run Python in a
 * forked child, so every step between fork and the target's execve happens
 * here, in C, in a fresh single-threaded process:
 *
 *   sfs-exec [OPTIONS] -- PROG [ARGS...]
 *
 *   --status FD        write "STAGE ERRNO\n" to FD on failure; FD is closed
 *                      by execve on success (O_CLOEXEC), so EOF means "exec'd"
 *   --env-fd FD        the target's environment: FD (a memfd) holds NUL-
 *                      terminated KEY=VALUE entries, read whole from offset 0
 *                      (at most SFS_MAX_ENV bytes and SFS_MAX_ENV_ENTRIES
 *                      entries, else "env E2BIG") and closed at once.  It is
 *                      applied only at the target's execve; the helper itself
 *                      runs with the fixed environment the parent gave it, and
 *                      PROG is searched for on the *target's* PATH.  Passed as
 *                      data, never in argv (/proc/PID/cmdline is world-readable)
 *   --pids-procs FD    join a cgroup v1 pids leaf: FD is its cgroup.procs
 *                      opened for writing; the target writes "0" to it as its
 *                      first step (after --cgroup's fork), before any other,
 *                      so it never runs outside that pids.max bound
 *   --cgroup FD        start the target in the cgroup v2 directory FD: the
 *                      helper first forks it with clone3(CLONE_INTO_CGROUP |
 *                      CLONE_PARENT), writes "pid N" on the status fd and
 *                      exits; the child (a child of the Python parent) does
 *                      every step below.  Writing cgroup.procs instead costs
 *                      an RCU grace period (~13 ms measured here); it is the
 *                      fallback when clone3 is refused
 *   --rlimit RES=N     set soft and hard limit of RES (cpu, as, fsize,
 *                      nofile, nproc, core) to N; repeatable
 *   --unshare FLAGS    unshare(2) with these CLONE_NEW* flags (decimal), after
 *                      the mount namespace step (so inside its user namespace
 *                      on unprivileged hosts) and after joining the cgroup
 *                      (CLONE_NEWCGROUP then roots the view at the leaf)
 *   --mask DIR         with --ro-mounts: mount an empty read-only tmpfs over
 *                      DIR (a fixed system path such as /sys/fs/cgroup, from
 *                      the parent's policy); repeatable
 *   --netns FD         setns(FD, CLONE_NEWNET) after joining --mntns/--userns
 *   --ipcns FD         setns(FD, CLONE_NEWIPC) likewise (namespaces a --hold-ns
 *                      helper made with --unshare, joined instead of made:
 *                      setns costs less than a fresh namespace)
 *   --seccomp BITS     after no_new_privs, install the seccomp allow-list (see
 *                      "seccomp" below: unlisted syscalls ENOSYS, privileged
 *                      and namespace ones EPERM, set-id modes EPERM, socket
 *                      families by --socket).  BITS: 1: first join a fresh
 *                      anonymous session keyring; 2: also refuse sendto/
 *                      sendmsg/sendmmsg with MSG_FASTOPEN and setsockopt(
 *                      TCP_FASTOPEN_CONNECT) (ways around Landlock's TCP
 *                      connect rule)
 *   --socket K:F:T:P   with --seccomp: allow socket() (K = s) or socketpair()
 *                      (K = p) of family F, type T (after SOCK_NONBLOCK and
 *                      SOCK_CLOEXEC) and protocol P (a number or *);
 *                      repeatable.  Other families and types: EAFNOSUPPORT;
 *                      other protocols of an allowed family and type:
 *                      EPROTONOSUPPORT
 *   --tty              setsid() then ioctl(0, TIOCSCTTY): fd 0 becomes the
 *                      controlling terminal (PTY sessions)
 *   --cwd FD           fchdir(FD): the working directory, opened by the
 *                      parent through a Root (never a host path string)
 *   --ro-mounts        a private mount namespace in which every mount is
 *                      nosuid and read-only except clones of the --rw-tree
 *                      directories (nosuid and nodev: a device node planted
 *                      in a writable tree opens nothing), and each
 *                      --reach-tree is bound onto itself nosuid and nodev
 *                      (only the --device binds drop nodev)
 *                      (not root: inside a user namespace mapping only our
 *                      own uid and gid).  Landlock does not cover chmod, chown,
 *                      utime or xattr changes; a read-only mount does (EROFS)
 *   --rw-tree FD       with --ro-mounts: keep the tree at directory FD
 *                      writable (the workspace, read-write grants); repeatable
 *   --pin-tree FD      with --ro-mounts: then bind directory FD (an ancestor
 *                      of a --ro-tree inside its --rw-tree, outer first) onto
 *                      itself: a mount point cannot be renamed or removed
 *                      (EBUSY), so the read-only grant's path stays its own
 *   --ro-tree FD       with --ro-mounts: then cover directory FD (a read-only
 *                      grant nested in a --rw-tree) with a recursive
 *                      read-only bind of itself; repeatable
 *   --hold-ns          with --ro-mounts: after making the namespace, write
 *                      "ready" on the status fd and wait for EOF on stdin
 *                      (the parent opens /proc/PID/ns/mnt meanwhile)
 *   --mntns FD         enter that mount namespace (made by --hold-ns)
 *                      instead of making one; --userns FD first when it
 *                      lives in a user namespace (unprivileged hosts)
 *   --drop-caps        empty the capability bounding, ambient, inheritable,
 *                      permitted and effective sets (root keeps uid 0 but no
 *                      capabilities)
 *   --uid N, --gid N   (root) run the target as uid N / gid N: setgroups(0),
 *                      setresgid, setresuid after the mount namespace work,
 *                      the namespaces and fchdir, and after the capability
 *                      bounding set is emptied; before no_new_privs, Landlock
 *                      and seccomp.  The kernel empties the other capability
 *                      sets at the switch; --drop-caps clears them anyway
 *   --reach-tree FD    with --ro-mounts: a read-only tree the target must
 *                      reach (a read-only grant); repeatable.  As root, every
 *                      tree (these and --rw-tree) with an ancestor that others
 *                      may not search (no S_IXOTH: /root, a 0700 temp dir) is
 *                      cloned, a read-only tmpfs (0755) is mounted over the
 *                      top-most such ancestor, and the clone is moved onto
 *                      directories made down to the tree's path inside it:
 *                      the tree is reachable by an unprivileged uid, the rest
 *                      of that ancestor is hidden, the tree's own modes apply
 *   --guard K:BASE:FD:REL  with --ro-mounts or --private-root: a protected
 *                      (K = r) or unreadable (K = d) entry, or a pinned
 *                      parent (K = p), mounted over once the trees are in
 *                      place (sfs_exec_guard.h); repeatable
 *   --ruleset FD       landlock_restrict_self(FD) after PR_SET_NO_NEW_PRIVS
 *   --ruleset-flags N  with --ruleset: landlock_restrict_self's flags (ABI 7
 *                      LANDLOCK_RESTRICT_SELF_LOG_*: which denials the audit
 *                      subsystem records; the parent checks the ABI)
 *   --domain-tag NAME  with --ruleset: prctl(PR_SET_NAME, NAME) just before
 *                      landlock_restrict_self: the kernel copies the comm into
 *                      the domain's audit details, so the host can tell its
 *                      domain's AUDIT_LANDLOCK_DOMAIN record by this tag;
 *                      execve replaces the comm with the program's name
 *   --init             run the target under an init of its own (a PID namespace
 *                      when one can be made, else a child subreaper) that
 *                      reaps, forwards signals and ends the tree when the
 *                      target exits or the lifeline closes (sfs_exec_init.h)
 *   --lifeline FD      with --init: the read end of a pipe only the host can
 *                      write; EOF (the host died) ends the tree
 *   --no-pid-ns        with --init: the subreaper fallback even where a PID
 *                      namespace could be made (tests of that fallback)
 *   --private-root FD  instead of --ro-mounts: run the command in a root of its
 *                      own (root only, with --init in a PID namespace; see
 *                      sfs_exec_root.h): a tmpfs holding the --sys-tree
 *                      trees read-only, --sys-link symlinks, a private /tmp,
 *                      a minimal /dev, its own /proc, the grants (--rw-tree,
 *                      --reach-tree, --ro-tree, --pin-tree) at their paths,
 *                      and last the clone of FD (the workspace's detached
 *                      mount, made with fsmount) at --workspace-path
 *   --workspace-path P with --private-root: where the workspace is mounted
 *                      (absolute, no "." or ".." components)
 *   --sys-tree FD      with --private-root: a system directory (/usr, /etc
 *                      ...) bound read-only at its own path; repeatable
 *   --sys-link P=T     with --private-root: a symlink P -> T in the new root
 *                      (/bin=usr/bin on merged-/usr systems); repeatable
 *   --cwd-rel REL      with --private-root: the working directory, resolved
 *                      beneath the workspace in the new root (RESOLVE_BENEATH);
 *                      without it --cwd FD names a directory of a grant
 *   --tmp-access ACCESS with --private-root and --ruleset: add a Landlock rule
 *                      for the private /tmp with these access bits
 *   --device FD        a granted device node (an O_PATH fd; repeatable, at most
 *                      32): with --ro-mounts or --private-root, bound at its
 *                      path without nodev (see sfs_exec_devices.h); not with
 *                      --mntns or --hold-ns
 *   --proc-read PATH   with --private-root and --ruleset: a Landlock read rule
 *                      for PATH (under /proc) in the command's own /proc
 *   --proc-self ACCESS add a Landlock rule for this process's own /proc/PID
 *                      directory (it is the target's after execve) with the
 *                      given access bits, before restricting
 *   --egress-listen PORT with --egress-sock, in the network namespace the
 *                      target got (--unshare with CLONE_NEWNET, or --netns):
 *                      bring its loopback up, bind and listen on
 *                      127.0.0.1:PORT (the host's egress proxy), before any
 *                      confinement step
 *   --egress-sock FD   send that listening socket over the unix socket FD
 *                      (SCM_RIGHTS, one byte), then close both
 *
 * setsid() always runs (a new session and process group, so the parent can
 * signal the whole group), PR_SET_NO_NEW_PRIVS is always set, and every fd
 * but 0/1/2 is marked close-on-exec (close_range), so the target starts with
 * exactly stdin/stdout/stderr.
 *
 * PR_SET_PDEATHSIG is deliberately not used: trio forks from a worker
 * thread, and the death signal fires when that *thread* exits, which trio's
 * thread cache does after a few idle seconds.  With --init the helper's init
 * watches the --lifeline pipe instead, and ends the tree when the host dies.
 * Exit status 127 with a status line means the helper failed before execve;
 * the target's own 127 comes with no line.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

extern char **environ;
#include <sched.h>
#include <grp.h>
#include <sys/ioctl.h>
#include <sys/mount.h>
#include <sys/stat.h>
#include <sys/prctl.h>
#include <sys/resource.h>
#include <sys/syscall.h>
#include <stddef.h>
#include <linux/capability.h>
#include <linux/filter.h>
#include <linux/seccomp.h>
#include <linux/audit.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <netinet/in.h>
#include <arpa/inet.h>
#include <net/if.h>

#ifndef SYS_landlock_add_rule
#define SYS_landlock_add_rule 445
#endif
#ifndef SYS_landlock_restrict_self
#define SYS_landlock_restrict_self 446
#endif
#ifndef SYS_close_range
#define SYS_close_range 436
#endif
#ifndef CLOSE_RANGE_CLOEXEC
#define CLOSE_RANGE_CLOEXEC (1U << 2)
#endif
#ifndef SYS_open_tree
#define SYS_open_tree 428
#endif
#ifndef SYS_move_mount
#define SYS_move_mount 429
#endif
#ifndef SYS_mount_setattr
#define SYS_mount_setattr 442
#endif
#define SFS_OPEN_TREE_CLONE 1
#define SFS_AT_RECURSIVE 0x8000
#define SFS_MOVE_MOUNT_F_EMPTY_PATH 0x4
#define SFS_MOVE_MOUNT_T_EMPTY_PATH 0x40
#define SFS_MOUNT_ATTR_RDONLY 0x1
#define SFS_MOUNT_ATTR_NOSUID 0x2
#define SFS_MOUNT_ATTR_NODEV 0x4
#define SFS_MAX_TREES 64
#define SFS_MAX_MASKS 32
#define SFS_MAX_ENV (1 << 20)
#define SFS_MAX_ENV_ENTRIES 4096
#define SFS_DEFAULT_PATH "/usr/local/bin:/usr/bin:/bin"
#ifndef SYS_clone3
#define SYS_clone3 435
#endif
#define SFS_CLONE_INTO_CGROUP 0x200000000ULL

struct sfs_clone_args {
    uint64_t flags, pidfd, child_tid, parent_tid, exit_signal, stack, stack_size, tls,
        set_tid, set_tid_size, cgroup;
};

struct sfs_mount_attr {
    uint64_t attr_set, attr_clr, propagation, userns_fd;
};

#ifndef PR_CAP_AMBIENT
#define PR_CAP_AMBIENT 47
#define PR_CAP_AMBIENT_CLEAR_ALL 4
#endif

struct sfs_path_beneath {
    uint64_t allowed_access;
    int32_t parent_fd;
} __attribute__((packed));

static int status_fd = -1;
/* Set in the target by --init when it runs in a PID namespace of its own. */
static int in_own_pid_ns;

/* Report the failed stage and errno to the parent, then exit 127. */
static void fail(const char *stage, int err)
{
    if (status_fd >= 0) {
        char line[96];
        int n = snprintf(line, sizeof line, "%s %d\n", stage, err);
        if (n > 0) {
            ssize_t w = write(status_fd, line, (size_t)n);
            (void)w;
        }
    } else {
        fprintf(stderr, "sfs-exec: %s: %s\n", stage, strerror(err));
    }
    _exit(127);
}

static int parse_int(const char *s, long long *out)
{
    char *end;
    errno = 0;
    long long v = strtoll(s, &end, 10);
    if (errno || end == s || *end != '\0')
        return -1;
    *out = v;
    return 0;
}

static int parse_fd(const char *s)
{
    long long v;
    if (parse_int(s, &v) || v < 0 || v > 1 << 20)
        fail("usage", EINVAL);
    return (int)v;
}

static int rlimit_resource(const char *name, size_t len)
{
    static const struct { const char *name; int res; } table[] = {
        { "cpu", RLIMIT_CPU }, { "as", RLIMIT_AS }, { "fsize", RLIMIT_FSIZE },
        { "nofile", RLIMIT_NOFILE }, { "nproc", RLIMIT_NPROC }, { "core", RLIMIT_CORE },
    };
    for (size_t i = 0; i < sizeof table / sizeof table[0]; i++)
        if (strlen(table[i].name) == len && memcmp(table[i].name, name, len) == 0)
            return table[i].res;
    return -1;
}

static void set_rlimit(const char *spec)
{
    const char *eq = strchr(spec, '=');
    long long v;
    if (!eq)
        fail("usage", EINVAL);
    int res = rlimit_resource(spec, (size_t)(eq - spec));
    if (res < 0 || parse_int(eq + 1, &v) || v < 0)
        fail("usage", EINVAL);
    struct rlimit rl = { (rlim_t)v, (rlim_t)v };
    if (setrlimit(res, &rl) < 0)
        fail("rlimit", errno);
}

static void join_cgroup(int dirfd)
{
    int fd = openat(dirfd, "cgroup.procs", O_WRONLY | O_CLOEXEC);
    if (fd < 0)
        fail("cgroup", errno);
    if (write(fd, "0\n", 2) != 2)
        fail("cgroup", errno);
    close(fd);
}

/* Join a cgroup v1 pids leaf through its cgroup.procs, opened by the parent. */
static void join_pids_v1(int procs_fd)
{
    if (write(procs_fd, "0\n", 2) != 2)
        fail("pids", errno);
    close(procs_fd);
}

/*
 * Fork the target into the cgroup, as a sibling: clone3(CLONE_INTO_CGROUP |
 * CLONE_PARENT) makes it a child of our parent (the Python process), which
 * then waits for it directly.  The helper reports "pid N" on the status
 * pipe and exits at once.  Returns in the child only (or, when clone3 is
 * refused, in the helper itself after joining the cgroup by cgroup.procs).
 */
static void fork_into_cgroup(int cgroup_fd)
{
    struct sfs_clone_args args;
    memset(&args, 0, sizeof args);
    args.flags = SFS_CLONE_INTO_CGROUP | CLONE_PARENT;
    args.exit_signal = SIGCHLD;
    args.cgroup = (uint64_t)cgroup_fd;
    long pid = syscall(SYS_clone3, &args, sizeof args);
    if (pid < 0) {
        int err = errno;
        if (err != ENOSYS && err != E2BIG && err != EINVAL)
            fail("cgroup", err);
        join_cgroup(cgroup_fd);
        close(cgroup_fd);
        return;
    }
    if (pid == 0) {
        close(cgroup_fd);
        return;
    }
    char line[48];
    int n = snprintf(line, sizeof line, "pid %ld\n", pid);
    if (status_fd < 0 || write(status_fd, line, (size_t)n) != n)
        _exit(126);                     /* the parent cannot learn the pid */
    _exit(0);
}

/* Become uid/gid with no supplementary groups (root only; checked after). */
static void switch_identity(long long uid, long long gid)
{
    uid_t r, e, s;
    if (setgroups(0, NULL) < 0)
        fail("identity", errno);
    if (setresgid((gid_t)gid, (gid_t)gid, (gid_t)gid) < 0)
        fail("identity", errno);
    if (setresuid((uid_t)uid, (uid_t)uid, (uid_t)uid) < 0)
        fail("identity", errno);
    if (getresuid(&r, &e, &s) < 0 || r != (uid_t)uid || e != (uid_t)uid || s != (uid_t)uid
        || getgroups(0, NULL) != 0)
        fail("identity", EPERM);
}

/* Needs CAP_SETPCAP: runs before an identity switch. */
static void drop_bounding_set(void)
{
    for (int cap = 0; cap < 64; cap++) {
        if (prctl(PR_CAPBSET_DROP, cap, 0, 0, 0) < 0 && errno != EINVAL)
            fail("capabilities", errno);
    }
}

static void drop_capabilities(void)
{
    if (prctl(PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0) < 0 && errno != EINVAL)
        fail("capabilities", errno);
    struct __user_cap_header_struct hdr = { _LINUX_CAPABILITY_VERSION_3, 0 };
    struct __user_cap_data_struct data[2];
    memset(data, 0, sizeof data);
    if (syscall(SYS_capset, &hdr, data) < 0)
        fail("capabilities", errno);
}

static void write_file(const char *path, const char *text)
{
    int fd = open(path, O_WRONLY | O_CLOEXEC);
    if (fd < 0)
        fail("mounts", errno);
    ssize_t n = (ssize_t)strlen(text);
    if (write(fd, text, (size_t)n) != n)
        fail("mounts", errno);
    close(fd);
}

#include "sfs_exec_init.h"     /* --init, --lifeline: supervision */

/* The path the kernel reports for fd (read before leaving the namespace). */
static char *fd_path(int fd, const char *stage)
{
    char link[64], path[4096];
    snprintf(link, sizeof link, "/proc/self/fd/%d", fd);
    ssize_t n = readlink(link, path, sizeof path - 1);
    if (n < 0)
        fail(stage, errno);
    path[n] = '\0';
    if (path[0] != '/')
        fail(stage, ENOENT);
    char *copy = strdup(path);
    if (!copy)
        fail(stage, ENOMEM);
    return copy;
}

/*
 * fd was opened in the parent's mount namespace; return an O_PATH fd on the
 * same directory as seen in ours, through the path read before unshare.
 * The identity check (dev, ino) refuses a path swapped meanwhile.
 */
static int reopen_here(int fd, const char *path, const char *stage)
{
    struct stat a, b;
    int nfd = open(path, O_PATH | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
    if (nfd < 0)
        fail(stage, errno);
    if (fstat(fd, &a) < 0 || fstat(nfd, &b) < 0)
        fail(stage, errno);
    if (a.st_dev != b.st_dev || a.st_ino != b.st_ino)
        fail(stage, ESTALE);
    return nfd;
}

/*
 * Bind each dirs[] directory onto itself, as now seen (the writable clones
 * are already in place), with attr added to every mount of the bind: a
 * read-only grant nested in a writable tree (Landlock unions rules, so only
 * the mount can refuse its writes), an ancestor of one pinned as a mount
 * point (EBUSY on rename), or a read-only grant made nodev.
 */
static void bind_self(const int *dirs, char **paths, int n, uint64_t attr_set)
{
    struct sfs_mount_attr attr = { attr_set, 0, 0, 0 };
    for (int t = 0; t < n; t++) {
        int target = reopen_here(dirs[t], paths[t], "mounts");
        long c = syscall(SYS_open_tree, target, "",
                         SFS_OPEN_TREE_CLONE | SFS_AT_RECURSIVE | AT_EMPTY_PATH | O_CLOEXEC);
        if (c < 0)
            fail("mounts", errno);
        if (syscall(SYS_mount_setattr, (int)c, "", AT_EMPTY_PATH | SFS_AT_RECURSIVE, &attr, sizeof attr) < 0)
            fail("mounts", errno);
        if (syscall(SYS_move_mount, (int)c, "", target, "",
                    SFS_MOVE_MOUNT_F_EMPTY_PATH | SFS_MOVE_MOUNT_T_EMPTY_PATH) < 0)
            fail("mounts", errno);
        close((int)c);
        close(target);
        free(paths[t]);
    }
}

/* Directories bound onto themselves after the writable clones: pins[], then ro[] read-only. */
struct sfs_binds {
    int pins[SFS_MAX_TREES], npins, ro[SFS_MAX_TREES], nro;
};

/* --guard entries (sfs_exec_guard.h): applied once the trees are in place. */
static void apply_guards(int rootfd, const char *ws_path);

/* ---- reaching trees under ancestors an unprivileged uid cannot search ---- */

/* Length of the top-most strict ancestor of path without S_IXOTH, or 0. */
static size_t unsearchable_prefix(const char *path)
{
    size_t found = 0, start = 1;
    int fd = open("/", O_PATH | O_DIRECTORY | O_CLOEXEC);
    if (fd < 0)
        fail("reach", errno);
    for (const char *slash; (slash = strchr(path + start, '/')) != NULL; start = (size_t)(slash - path) + 1) {
        char name[256];
        size_t len = (size_t)(slash - path) - start;
        if (len == 0)
            continue;
        if (len >= sizeof name)
            fail("reach", ENAMETOOLONG);
        memcpy(name, path + start, len);
        name[len] = '\0';
        int nfd = openat(fd, name, O_PATH | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
        struct stat st;
        if (nfd < 0 || fstat(nfd, &st) < 0)
            fail("reach", errno);
        close(fd);
        fd = nfd;
        if (!(st.st_mode & S_IXOTH)) {
            found = (size_t)(slash - path);
            break;
        }
    }
    close(fd);
    return found;
}

/* mkdir (0755) the components of path after prefix (inside a stub); an fd on the last. */
static int make_path(const char *path, size_t prefix)
{
    char *top = strndup(path, prefix);
    if (!top)
        fail("reach", ENOMEM);
    int fd = open(top, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
    free(top);
    for (const char *p = path + prefix; fd >= 0 && *p;) {
        char name[256];
        while (*p == '/')
            p++;
        size_t len = strcspn(p, "/");
        if (len == 0)
            break;
        if (len >= sizeof name)
            fail("reach", ENAMETOOLONG);
        memcpy(name, p, len);
        name[len] = '\0';
        p += len;
        if (mkdirat(fd, name, 0755) < 0 && errno != EEXIST)
            fail("reach", errno);
        int nfd = openat(fd, name, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
        close(fd);
        fd = nfd;
        if (fd >= 0 && fchmod(fd, 0755) < 0)    /* whatever the umask */
            fail("reach", errno);
    }
    if (fd < 0)
        fail("reach", errno);
    return fd;
}

static int nested(char **paths, int n, int t)
{
    for (int u = 0; u < n; u++) {
        size_t len = strlen(paths[u]);
        if (u != t && strncmp(paths[t], paths[u], len) == 0 && (paths[t][len] == '/' || len == 1))
            return 1;
    }
    return 0;
}

/* Clone each unreachable tree, stub its top-most unsearchable ancestor, move the clone back in. */
static void reach_trees(const int *fds, char **paths, int n)
{
    int clones[SFS_MAX_TREES];
    size_t pre[SFS_MAX_TREES];
    char *stubs[SFS_MAX_TREES];
    int nstubs = 0;
    for (int t = 0; t < n; t++) {
        clones[t] = -1;
        pre[t] = nested(paths, n, t) ? 0 : unsearchable_prefix(paths[t]);
        if (pre[t] == 0)
            continue;
        int target = reopen_here(fds[t], paths[t], "reach");
        long c = syscall(SYS_open_tree, target, "",
                         SFS_OPEN_TREE_CLONE | SFS_AT_RECURSIVE | AT_EMPTY_PATH | O_CLOEXEC);
        if (c < 0)
            fail("reach", errno);
        close(target);
        clones[t] = (int)c;
    }
    for (int t = 0; t < n; t++) {       /* every clone is made before the first stub hides its tree */
        if (clones[t] < 0)
            continue;
        char *stub = strndup(paths[t], pre[t]);
        int seen = 0;
        if (!stub)
            fail("reach", ENOMEM);
        for (int k = 0; k < nstubs; k++)
            seen |= strcmp(stubs[k], stub) == 0;
        if (seen) {
            free(stub);
            continue;
        }
        if (mount("tmpfs", stub, "tmpfs", MS_NOSUID | MS_NODEV | MS_NOEXEC,
                  "size=64k,nr_inodes=1024,mode=0755") < 0)
            fail("reach", errno);
        stubs[nstubs++] = stub;
    }
    for (int t = 0; t < n; t++) {
        if (clones[t] < 0)
            continue;
        int dfd = make_path(paths[t], pre[t]);
        if (syscall(SYS_move_mount, clones[t], "", dfd, "",
                    SFS_MOVE_MOUNT_F_EMPTY_PATH | SFS_MOVE_MOUNT_T_EMPTY_PATH) < 0)
            fail("reach", errno);
        close(dfd);
        close(clones[t]);
    }
    for (int k = 0; k < nstubs; k++) {
        if (mount(NULL, stubs[k], NULL, MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | MS_NODEV | MS_NOEXEC,
                  NULL) < 0)
            fail("reach", errno);
        free(stubs[k]);
    }
}

/* Every mount read-only except clones of the trees[] directories, then the binds, then
 * (root) the reach[] trees under unsearchable ancestors; every mount nosuid. */
static void read_only_mounts(const int *trees, int ntrees, const struct sfs_binds *b, const int *reach, int nreach,
                             char **masks, int nmasks, int *cwd_fd)
{
    int clones[SFS_MAX_TREES], targets[SFS_MAX_TREES], all[SFS_MAX_TREES * 2];
    char *paths[SFS_MAX_TREES * 2], *pin_paths[SFS_MAX_TREES], *ro_paths[SFS_MAX_TREES], *cwd_path = NULL;
    char *reach_paths[SFS_MAX_TREES];
    int is_root = geteuid() == 0;
    for (int t = 0; t < ntrees; t++)
        paths[t] = fd_path(all[t] = trees[t], "mounts");
    for (int t = 0; t < nreach; t++) {
        paths[ntrees + t] = fd_path(all[ntrees + t] = reach[t], "mounts");
        reach_paths[t] = fd_path(reach[t], "mounts");
    }
    for (int t = 0; t < b->npins; t++)
        pin_paths[t] = fd_path(b->pins[t], "mounts");
    for (int t = 0; t < b->nro; t++)
        ro_paths[t] = fd_path(b->ro[t], "mounts");
    if (*cwd_fd >= 0)
        cwd_path = fd_path(*cwd_fd, "cwd");
    if (geteuid() != 0) {
        /* Unprivileged: a user namespace mapping only our own ids gives the
         * mount rights in a new mount namespace, nothing else. */
        uid_t uid = geteuid();
        gid_t gid = getegid();
        char map[64];
        if (unshare(CLONE_NEWUSER | CLONE_NEWNS) < 0)
            fail("mounts", errno);
        write_file("/proc/self/setgroups", "deny");
        snprintf(map, sizeof map, "%u %u 1", (unsigned)uid, (unsigned)uid);
        write_file("/proc/self/uid_map", map);
        snprintf(map, sizeof map, "%u %u 1", (unsigned)gid, (unsigned)gid);
        write_file("/proc/self/gid_map", map);
    } else if (unshare(CLONE_NEWNS) < 0)
        fail("mounts", errno);
    if (mount(NULL, "/", NULL, MS_REC | MS_PRIVATE, NULL) < 0)
        fail("mounts", errno);
    for (int t = 0; t < ntrees; t++) {
        targets[t] = reopen_here(trees[t], paths[t], "mounts");
        long c = syscall(SYS_open_tree, targets[t], "",
                         SFS_OPEN_TREE_CLONE | SFS_AT_RECURSIVE | AT_EMPTY_PATH | O_CLOEXEC);
        if (c < 0)
            fail("mounts", errno);
        clones[t] = (int)c;
        /* Set-id bits and device nodes in a writable tree give nothing here. */
        struct sfs_mount_attr rw_attr = { SFS_MOUNT_ATTR_NOSUID | SFS_MOUNT_ATTR_NODEV, 0, 0, 0 };
        if (syscall(SYS_mount_setattr, clones[t], "", AT_EMPTY_PATH | SFS_AT_RECURSIVE,
                    &rw_attr, sizeof rw_attr) < 0)
            fail("mounts", errno);
    }
    struct sfs_mount_attr attr = { SFS_MOUNT_ATTR_RDONLY | SFS_MOUNT_ATTR_NOSUID, 0, 0, 0 };
    if (syscall(SYS_mount_setattr, AT_FDCWD, "/", SFS_AT_RECURSIVE, &attr, sizeof attr) < 0)
        fail("mounts", errno);
    for (int t = 0; t < ntrees; t++) {
        if (syscall(SYS_move_mount, clones[t], "", targets[t], "",
                    SFS_MOVE_MOUNT_F_EMPTY_PATH | SFS_MOVE_MOUNT_T_EMPTY_PATH) < 0)
            fail("mounts", errno);
        close(clones[t]);
        close(targets[t]);          /* trees[t] is closed at execve (it may also be the cwd fd) */
    }
    /* Read-only grants: nodev too (a device node opens for writing on a read-only mount);
     * a writable clone inside one keeps its own attributes, read-write included. */
    bind_self(reach, reach_paths, nreach, SFS_MOUNT_ATTR_NOSUID | SFS_MOUNT_ATTR_NODEV);
    bind_self(b->pins, pin_paths, b->npins, SFS_MOUNT_ATTR_NOSUID | SFS_MOUNT_ATTR_NODEV);
    bind_self(b->ro, ro_paths, b->nro, SFS_MOUNT_ATTR_RDONLY | SFS_MOUNT_ATTR_NOSUID | SFS_MOUNT_ATTR_NODEV);
    if (is_root)
        reach_trees(all, paths, ntrees + nreach);
    apply_guards(-1, NULL);
    for (int t = 0; t < ntrees + nreach; t++)
        free(paths[t]);
    for (int m = 0; m < nmasks; m++) {
        /* Hide a host tree (cgroupfs: clone3(CLONE_INTO_CGROUP) with an O_PATH
         * fd, which Landlock does not check, would leave the leaf). */
        if (mount("tmpfs", masks[m], "tmpfs", MS_RDONLY | MS_NOSUID | MS_NODEV | MS_NOEXEC,
                  "size=4k,nr_inodes=1,mode=0555") < 0 && errno != ENOENT)
            fail("mask", errno);
    }
    if (cwd_path) {
        /* The old fd names the covered directory; enter the one now on top. */
        int nfd = reopen_here(*cwd_fd, cwd_path, "cwd");
        close(*cwd_fd);
        *cwd_fd = nfd;
        free(cwd_path);
    }
}

/*
 * Enter a read-only mount namespace made earlier by a --hold-ns helper
 * (kept alive by the parent's nsfs fd), so its teardown, which waits for an
 * RCU grace period, is paid once per supervisor instead of at every exit.
 */
static void join_mount_ns(int userns_fd, int mntns_fd, int netns_fd, int ipcns_fd, int *cwd_fd)
{
    char *cwd_path = NULL;
    if (*cwd_fd >= 0)
        cwd_path = fd_path(*cwd_fd, "cwd");
    if (userns_fd >= 0 && setns(userns_fd, CLONE_NEWUSER) < 0)
        fail("mounts", errno);
    if (setns(mntns_fd, CLONE_NEWNS) < 0)
        fail("mounts", errno);
    if (netns_fd >= 0 && setns(netns_fd, CLONE_NEWNET) < 0)
        fail("netns", errno);
    if (ipcns_fd >= 0 && setns(ipcns_fd, CLONE_NEWIPC) < 0)
        fail("netns", errno);
    if (cwd_path) {
        int nfd = reopen_here(*cwd_fd, cwd_path, "cwd");
        close(*cwd_fd);
        *cwd_fd = nfd;
        free(cwd_path);
    }
}

#include "sfs_exec_devices.h"  /* --device, --proc-read: granted device nodes */
#include "sfs_exec_root.h"     /* --private-root: the command's own root */
#include "sfs_exec_guard.h"    /* --guard: protected and unreadable entries */

/* ---- egress: the proxy's listener in the target's network namespace ---- */

/* Loopback up, listen on 127.0.0.1:port, hand the listening socket to the host over sock_fd. */
static void egress_listener(int sock_fd, long long port)
{
    struct ifreq ifr;
    memset(&ifr, 0, sizeof ifr);
    memcpy(ifr.ifr_name, "lo", 3);
    int s = socket(AF_INET, SOCK_DGRAM | SOCK_CLOEXEC, 0);
    if (s < 0 || ioctl(s, SIOCGIFFLAGS, &ifr) < 0)
        fail("egress", errno);
    ifr.ifr_flags |= IFF_UP;
    if (ioctl(s, SIOCSIFFLAGS, &ifr) < 0)
        fail("egress", errno);
    close(s);
    int l = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    struct sockaddr_in addr;
    memset(&addr, 0, sizeof addr);
    addr.sin_family = AF_INET;
    addr.sin_port = htons((uint16_t)port);
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    if (l < 0 || bind(l, (struct sockaddr *)&addr, sizeof addr) < 0 || listen(l, 128) < 0)
        fail("egress", errno);
    char byte = 'L';
    struct iovec iov = { &byte, 1 };
    union {
        char buf[CMSG_SPACE(sizeof(int))];
        struct cmsghdr align;
    } u;
    memset(&u, 0, sizeof u);
    struct msghdr msg;
    memset(&msg, 0, sizeof msg);
    msg.msg_iov = &iov;
    msg.msg_iovlen = 1;
    msg.msg_control = u.buf;
    msg.msg_controllen = sizeof u.buf;
    struct cmsghdr *cm = CMSG_FIRSTHDR(&msg);
    cm->cmsg_level = SOL_SOCKET;
    cm->cmsg_type = SCM_RIGHTS;
    cm->cmsg_len = CMSG_LEN(sizeof(int));
    memcpy(CMSG_DATA(cm), &l, sizeof l);
    if (sendmsg(sock_fd, &msg, MSG_NOSIGNAL) != 1)
        fail("egress", errno);
    close(l);
    close(sock_fd);
}

/* ---- the target's environment ------------------------------------------ */

/*
 * Read the environment blob of --env-fd: NUL-terminated "KEY=VALUE"
 * entries.  Returns a NULL-terminated envp (never freed: execve replaces us).
 */
static char **read_env(int fd)
{
    char *buf = malloc(SFS_MAX_ENV + 1);
    char **envp = calloc(SFS_MAX_ENV_ENTRIES + 1, sizeof *envp);
    size_t len = 0, n = 0;
    if (!buf || !envp)
        fail("env", ENOMEM);
    for (;;) {
        ssize_t r = pread(fd, buf + len, SFS_MAX_ENV + 1 - len, (off_t)len);
        if (r < 0 && errno == EINTR)
            continue;
        if (r < 0)
            fail("env", errno);
        if (r == 0)
            break;
        len += (size_t)r;
        if (len > SFS_MAX_ENV)
            fail("env", E2BIG);
    }
    close(fd);
    if (len && buf[len - 1] != '\0')
        fail("env", EINVAL);
    for (size_t off = 0; off < len; off += strlen(buf + off) + 1) {
        char *eq = strchr(buf + off, '=');
        if (!eq || eq == buf + off)
            fail("env", EINVAL);
        if (n == SFS_MAX_ENV_ENTRIES)
            fail("env", E2BIG);
        envp[n++] = buf + off;
    }
    envp[n] = NULL;
    return envp;
}

static const char *env_get(char **envp, const char *name)
{
    size_t len = strlen(name);
    for (; *envp; envp++)
        if (strncmp(*envp, name, len) == 0 && (*envp)[len] == '=')
            return *envp + len + 1;
    return NULL;
}

/* A file execve refused as ENOEXEC is run by /bin/sh, as execvp does. */
static void exec_script(const char *path, char **argv, char **envp)
{
    int argc = 0;
    while (argv[argc])
        argc++;
    char **sh = calloc((size_t)argc + 2, sizeof *sh);
    if (!sh)
        fail("exec", ENOMEM);
    sh[0] = (char *)"/bin/sh";
    sh[1] = (char *)path;
    for (int k = 1; k < argc; k++)
        sh[k + 1] = argv[k];
    execve("/bin/sh", sh, envp);
}

/*
 * execvp over the target's own PATH (not the helper's environment): the
 * same search rules (a name with '/' is used as is; EACCES is remembered
 * and the search goes on; ENOENT/ENOTDIR go on; other errors stop it).
 */
static void exec_target(char **argv, char **envp)
{
    const char *file = argv[0];
    if (strchr(file, '/')) {
        execve(file, argv, envp);
        if (errno == ENOEXEC)
            exec_script(file, argv, envp);
        fail("exec", errno);
    }
    const char *path = env_get(envp, "PATH");
    if (!path)
        path = SFS_DEFAULT_PATH;
    size_t flen = strlen(file);
    int seen_eacces = 0;
    char cand[4096];
    for (const char *p = path;; p++) {
        const char *end = strchrnul(p, ':');
        size_t dlen = (size_t)(end - p);
        if (dlen + flen + 2 <= sizeof cand) {
            if (dlen)
                memcpy(cand, p, dlen);
            else
                cand[dlen++] = '.';
            cand[dlen] = '/';
            memcpy(cand + dlen + 1, file, flen + 1);
            execve(cand, argv, envp);
            if (errno == ENOEXEC)
                exec_script(cand, argv, envp);
            if (errno == EACCES)
                seen_eacces = 1;
            else if (errno != ENOENT && errno != ENOTDIR && errno != ENAMETOOLONG)
                fail("exec", errno);
        }
        if (*end == '\0')
            break;
        p = end;
    }
    fail("exec", seen_eacces ? EACCES : ENOENT);
}


/* ---- seccomp ------------------------------------------------------------ */
/*
 * An allow-list, modelled on the default profile of Docker/moby
 * (profiles/seccomp/default.json) for a container without CAP_SYS_ADMIN:
 *
 *   - every syscall not listed below fails with ENOSYS, so a libc or program
 *     that probes a newer syscall falls back to an older one; clone3 and
 *     openat2 (their arguments live behind a pointer seccomp cannot read),
 *     io_uring (its operations bypass seccomp) and every syscall of another
 *     ABI (x32, 32-bit compat: socketcall hides its arguments) are among them;
 *   - privileged and namespace syscalls (mount, unshare, setns, keyctl, bpf
 *     ...) and clone() with a CLONE_NEW* flag fail with EPERM: a new user
 *     namespace would give back CAP_SETFCAP and friends;
 *   - every syscall that sets a file mode (open/openat/creat with O_CREAT or
 *     O_TMPFILE, mkdir, mknod, chmod, fchmod, fchmodat, fchmodat2) fails with
 *     EPERM when the mode has S_ISUID or S_ISGID: no set-id file can be made;
 *   - mknod and mknodat of a character or block device fail with EPERM
 *     (also the 0:0 "whiteout" an unprivileged caller may otherwise make;
 *     CAP_MKNOD is gone and Landlock grants MAKE_CHAR/MAKE_BLOCK nowhere:
 *     this is the third layer, before any file system sees the request);
 *   - socket() and socketpair() are allowed only for the (family, type after
 *     SOCK_NONBLOCK|SOCK_CLOEXEC, protocol) triples given with --socket;
 *     another family or type fails with EAFNOSUPPORT, another protocol of an
 *     allowed family and type with EPROTONOSUPPORT (MPTCP: programs fall
 *     back to TCP).
 *
 * Blocks that read arguments come first (the hot openat first); the plain
 * lists after them are one binary search over the syscall number, so the
 * kernel's seccomp action cache (Linux >= 5.11) answers those without
 * running the filter at all, and building that cache at attach time (every
 * number through the filter) stays cheap: the longest path is under 40
 * instructions, against about 350 for a linear list.
 */

#if defined(__x86_64__)
#define SFS_AUDIT_ARCH AUDIT_ARCH_X86_64
#elif defined(__aarch64__)
#define SFS_AUDIT_ARCH AUDIT_ARCH_AARCH64
#elif defined(__riscv) && __riscv_xlen == 64
#define SFS_AUDIT_ARCH AUDIT_ARCH_RISCV64
#endif
#define SFS_SECCOMP_KEYS 1
#define SFS_SECCOMP_TCP 2
#define SFS_SECCOMP_BITS (SFS_SECCOMP_KEYS | SFS_SECCOMP_TCP)
#ifndef MSG_FASTOPEN
#define MSG_FASTOPEN 0x20000000
#endif
#ifndef IPPROTO_MPTCP
#define IPPROTO_MPTCP 262
#endif
#define SFS_TCP_FASTOPEN_CONNECT 30
#ifndef SYS_io_uring_setup
#define SYS_io_uring_setup 425
#define SYS_io_uring_enter 426
#define SYS_io_uring_register 427
#endif
#ifndef SYS_openat2
#define SYS_openat2 437
#endif
#ifndef SYS_fchmodat2
#define SYS_fchmodat2 452
#endif
#define SFS_KEYCTL_JOIN_SESSION_KEYRING 1
/* Mode bits refused in every mode argument (the sticky bit grants nothing). */
#define SFS_SETID_BITS (S_ISUID | S_ISGID)
/* open flags under which the kernel uses the mode argument. */
#define SFS_WILL_CREATE (O_CREAT | (O_TMPFILE & ~O_DIRECTORY))
/* clone() flags that make a namespace (CLONE_NEWNS ... CLONE_NEWNET). */
#define SFS_CLONE_NS_FLAGS 0x7E020000U
/* The low 32 bits of argument i (int and unsigned int arguments; little endian). */
#define SFS_ARG(i) ((uint32_t)(offsetof(struct seccomp_data, args) + 8 * (i)))
#define SFS_NR ((uint32_t)offsetof(struct seccomp_data, nr))
#define SFS_MAX_FILTER 1024
#define SFS_MAX_SOCKETS 32
#define SFS_PROTO_ANY (-1LL)

struct sfs_socket_rule {
    int pair;                   /* 0: socket(), 1: socketpair() */
    uint32_t family, type;
    long long proto;            /* SFS_PROTO_ANY: every protocol */
};

struct sfs_filter {
    struct sock_filter insn[SFS_MAX_FILTER];
    unsigned short n;
};

/* Allowed whatever their arguments (the generic table: every 64-bit arch). */
static const long sfs_allowed[] = {
    SYS_accept, SYS_accept4, SYS_adjtimex, SYS_bind, SYS_brk, SYS_capget, SYS_capset,
    SYS_chdir, SYS_clock_adjtime, SYS_clock_getres, SYS_clock_gettime, SYS_clock_nanosleep,
    SYS_close, SYS_close_range, SYS_connect, SYS_copy_file_range, SYS_dup, SYS_dup3,
    SYS_epoll_create1, SYS_epoll_ctl, SYS_epoll_pwait, SYS_epoll_pwait2, SYS_eventfd2,
    SYS_execve, SYS_execveat, SYS_exit, SYS_exit_group, SYS_faccessat, SYS_faccessat2,
    SYS_fadvise64, SYS_fallocate, SYS_fanotify_mark, SYS_fchdir, SYS_fchown, SYS_fchownat,
    SYS_fcntl, SYS_fdatasync, SYS_fgetxattr, SYS_flistxattr, SYS_flock, SYS_fremovexattr,
    SYS_fsetxattr, SYS_fstatfs, SYS_fsync, SYS_ftruncate, SYS_futex,
    SYS_futex_waitv, SYS_getcpu, SYS_getcwd, SYS_getdents64, SYS_getegid, SYS_geteuid,
    SYS_getgid, SYS_getgroups, SYS_getitimer, SYS_getpeername, SYS_getpgid, SYS_getpid,
    SYS_getppid, SYS_getpriority, SYS_getrandom, SYS_getresgid, SYS_getresuid,
    SYS_get_robust_list, SYS_getrusage, SYS_getsid, SYS_getsockname,
    SYS_getsockopt, SYS_gettid, SYS_gettimeofday, SYS_getuid, SYS_getxattr,
    SYS_inotify_add_watch, SYS_inotify_init1, SYS_inotify_rm_watch, SYS_io_cancel,
    SYS_ioctl, SYS_io_destroy, SYS_io_getevents, SYS_io_pgetevents, SYS_ioprio_get,
    SYS_ioprio_set, SYS_io_setup, SYS_io_submit, SYS_kill, SYS_landlock_add_rule,
    SYS_landlock_create_ruleset, SYS_landlock_restrict_self, SYS_lgetxattr, SYS_linkat,
    SYS_listen, SYS_listxattr, SYS_llistxattr, SYS_lremovexattr, SYS_lseek, SYS_lsetxattr,
    SYS_madvise, SYS_membarrier, SYS_memfd_create, SYS_mincore, SYS_mlock, SYS_mlock2,
    SYS_mlockall, SYS_mmap, SYS_mprotect, SYS_mq_getsetattr, SYS_mq_notify, SYS_mq_open,
    SYS_mq_timedreceive, SYS_mq_timedsend, SYS_mq_unlink, SYS_mremap, SYS_msgctl,
    SYS_msgget, SYS_msgrcv, SYS_msgsnd, SYS_msync, SYS_munlock, SYS_munlockall, SYS_munmap,
    SYS_name_to_handle_at, SYS_nanosleep, SYS_pidfd_open,
    SYS_pidfd_send_signal, SYS_pipe2, SYS_pkey_alloc, SYS_pkey_free, SYS_pkey_mprotect,
    SYS_ppoll, SYS_prctl, SYS_pread64, SYS_preadv, SYS_preadv2, SYS_prlimit64,
    SYS_process_mrelease, SYS_process_vm_readv, SYS_process_vm_writev, SYS_pselect6,
    SYS_ptrace, SYS_pwrite64, SYS_pwritev, SYS_pwritev2, SYS_read, SYS_readahead,
    SYS_readlinkat, SYS_readv, SYS_recvfrom, SYS_recvmmsg, SYS_recvmsg,
    SYS_remap_file_pages, SYS_removexattr, SYS_renameat2,
    SYS_restart_syscall, SYS_rseq, SYS_rt_sigaction, SYS_rt_sigpending, SYS_rt_sigprocmask,
    SYS_rt_sigqueueinfo, SYS_rt_sigreturn, SYS_rt_sigsuspend, SYS_rt_sigtimedwait,
    SYS_rt_tgsigqueueinfo, SYS_sched_getaffinity, SYS_sched_getattr, SYS_sched_getparam,
    SYS_sched_get_priority_max, SYS_sched_get_priority_min, SYS_sched_getscheduler,
    SYS_sched_rr_get_interval, SYS_sched_setaffinity, SYS_sched_setattr,
    SYS_sched_setparam, SYS_sched_setscheduler, SYS_sched_yield, SYS_seccomp, SYS_semctl,
    SYS_semget, SYS_semop, SYS_semtimedop, SYS_sendfile, SYS_setfsgid, SYS_setfsuid,
    SYS_setgid, SYS_setgroups, SYS_setitimer, SYS_setpgid, SYS_setpriority, SYS_setregid,
    SYS_setresgid, SYS_setresuid, SYS_setreuid, SYS_set_robust_list,
    SYS_setsid, SYS_set_tid_address, SYS_setuid, SYS_setxattr, SYS_shmat, SYS_shmctl,
    SYS_shmdt, SYS_shmget, SYS_shutdown, SYS_sigaltstack, SYS_signalfd4, SYS_splice,
    SYS_statfs, SYS_statx, SYS_symlinkat, SYS_sync, SYS_sync_file_range, SYS_syncfs,
    SYS_sysinfo, SYS_tee, SYS_tgkill, SYS_timer_create, SYS_timer_delete,
    SYS_timer_getoverrun, SYS_timer_gettime, SYS_timer_settime, SYS_timerfd_create,
    SYS_timerfd_gettime, SYS_timerfd_settime, SYS_times, SYS_tkill, SYS_truncate,
    SYS_umask, SYS_uname, SYS_unlinkat, SYS_utimensat, SYS_vmsplice, SYS_wait4,
    SYS_waitid, SYS_write, SYS_writev,
    /* Not in every generic table (__ARCH_WANT_NEW_STAT, _RENAMEAT, _SET_GET_RLIMIT). */
#ifdef SYS_fstat
    SYS_fstat, SYS_newfstatat,
#endif
#ifdef SYS_renameat
    SYS_renameat,
#endif
#ifdef SYS_getrlimit
    SYS_getrlimit, SYS_setrlimit,
#endif
#if defined(__x86_64__)
    SYS_access, SYS_alarm, SYS_arch_prctl, SYS_chown, SYS_dup2, SYS_epoll_create,
    SYS_epoll_wait, SYS_eventfd, SYS_fork, SYS_futimesat, SYS_getdents, SYS_getpgrp,
    SYS_get_thread_area, SYS_inotify_init, SYS_lchown, SYS_link, SYS_lstat,
    SYS_modify_ldt, SYS_pause, SYS_pipe, SYS_poll, SYS_readlink, SYS_rename, SYS_rmdir,
    SYS_select, SYS_set_thread_area, SYS_signalfd, SYS_stat, SYS_symlink, SYS_time,
    SYS_unlink, SYS_utime, SYS_utimes, SYS_vfork,
#endif
};

/* Known and refused with EPERM (what an unprivileged caller gets anyway). */
static const long sfs_refused[] = {
    SYS_mount, SYS_umount2, SYS_pivot_root, SYS_chroot, SYS_unshare, SYS_setns,
    SYS_keyctl, SYS_add_key, SYS_request_key, SYS_bpf, SYS_perf_event_open,
    SYS_userfaultfd, SYS_kcmp, SYS_pidfd_getfd, SYS_fsopen, SYS_fsconfig, SYS_fsmount,
    SYS_fspick, SYS_open_tree, SYS_move_mount, SYS_mount_setattr, SYS_quotactl,
    SYS_quotactl_fd, SYS_swapon, SYS_swapoff, SYS_reboot, SYS_kexec_load,
    SYS_kexec_file_load, SYS_init_module, SYS_finit_module, SYS_delete_module, SYS_acct,
    SYS_settimeofday, SYS_clock_settime, SYS_sethostname, SYS_setdomainname, SYS_syslog,
    SYS_vhangup, SYS_fanotify_init, SYS_open_by_handle_at,
#if defined(__x86_64__)
    SYS_iopl, SYS_ioperm,
#endif
};

/* Refused with ENOSYS even if a later edit listed them above. */
static const long sfs_unseen[] = {
    SYS_clone3, SYS_openat2, SYS_io_uring_setup, SYS_io_uring_enter, SYS_io_uring_register,
};

static void emit(struct sfs_filter *f, unsigned short code, unsigned char jt, unsigned char jf, uint32_t k)
{
    if (f->n >= SFS_MAX_FILTER)
        fail("seccomp", E2BIG);
    struct sock_filter insn = { code, jt, jf, k };
    f->insn[f->n++] = insn;
}

#define LD_ABS(f, off) emit(f, BPF_LD | BPF_W | BPF_ABS, 0, 0, off)
#define RET(f, v) emit(f, BPF_RET | BPF_K, 0, 0, v)
#define JEQ(f, k, jt, jf) emit(f, BPF_JMP | BPF_JEQ | BPF_K, jt, jf, k)
#define JSET(f, k, jt, jf) emit(f, BPF_JMP | BPF_JSET | BPF_K, jt, jf, k)
#define DENY(err) (SECCOMP_RET_ERRNO | ((err) & SECCOMP_RET_DATA))

/* Point the false branch of the jump at index at to the next instruction. */
static void patch_jf(struct sfs_filter *f, unsigned short at)
{
    unsigned int d = (unsigned int)(f->n - at - 1);
    if (d > 255)
        fail("seccomp", E2BIG);
    f->insn[at].jf = (unsigned char)d;
}

/*
 * "JEQ nr" whose false branch skips the body that follows (patched by
 * end_block).  A holds the syscall number between blocks: every body ends
 * in a RET, so a block never falls through with an argument loaded.
 */
static unsigned short begin_block(struct sfs_filter *f, long nr)
{
    JEQ(f, (uint32_t)nr, 0, 0);
    return (unsigned short)(f->n - 1);
}

/* nr fails with EPERM when its mode argument has a set-id bit; when
 * flags_arg >= 0, only if that flags argument asks for a file to be created. */
static void mode_block(struct sfs_filter *f, long nr, int mode_arg, int flags_arg)
{
    unsigned short at = begin_block(f, nr);
    if (flags_arg >= 0) {
        LD_ABS(f, SFS_ARG(flags_arg));
        JSET(f, SFS_WILL_CREATE, 1, 0);
        RET(f, SECCOMP_RET_ALLOW);
    }
    LD_ABS(f, SFS_ARG(mode_arg));
    JSET(f, SFS_SETID_BITS, 0, 1);
    RET(f, DENY(EPERM));
    RET(f, SECCOMP_RET_ALLOW);
    patch_jf(f, at);
}

/* mknod/mknodat: EPERM for a set-id mode and for a character or block device node. */
static void mknod_block(struct sfs_filter *f, long nr, int mode_arg)
{
    unsigned short at = begin_block(f, nr);
    LD_ABS(f, SFS_ARG(mode_arg));
    JSET(f, SFS_SETID_BITS, 4, 0);
    emit(f, BPF_ALU | BPF_AND | BPF_K, 0, 0, S_IFMT);
    JEQ(f, S_IFCHR, 2, 0);
    JEQ(f, S_IFBLK, 1, 0);
    RET(f, SECCOMP_RET_ALLOW);
    RET(f, DENY(EPERM));
    patch_jf(f, at);
}

static void mode_blocks(struct sfs_filter *f)
{
    mode_block(f, SYS_openat, 3, 2);
    mode_block(f, SYS_mkdirat, 2, -1);
    mknod_block(f, SYS_mknodat, 2);
    mode_block(f, SYS_fchmod, 1, -1);
    mode_block(f, SYS_fchmodat, 2, -1);
    mode_block(f, SYS_fchmodat2, 2, -1);
#if defined(__x86_64__)
    mode_block(f, SYS_open, 2, 1);
    mode_block(f, SYS_creat, 1, -1);
    mode_block(f, SYS_mkdir, 1, -1);
    mknod_block(f, SYS_mknod, 1);
    mode_block(f, SYS_chmod, 1, -1);
#endif
}

/* One (family, type) group of the rules: allow its protocols, EPROTONOSUPPORT
 * for the others; a family or type that differs goes on to the next group. */
static void socket_group(struct sfs_filter *f, const struct sfs_socket_rule *rules, int nrules,
                         const struct sfs_socket_rule *g)
{
    int any = 0, nproto = 0;
    for (int r = 0; r < nrules; r++) {
        if (rules[r].pair == g->pair && rules[r].family == g->family && rules[r].type == g->type) {
            any |= rules[r].proto == SFS_PROTO_ANY;
            nproto++;
        }
    }
    LD_ABS(f, SFS_ARG(0));
    unsigned short fam = (unsigned short)f->n;
    JEQ(f, g->family, 0, 0);
    LD_ABS(f, SFS_ARG(1));
    emit(f, BPF_ALU | BPF_AND | BPF_K, 0, 0, ~(uint32_t)(SOCK_NONBLOCK | SOCK_CLOEXEC));
    unsigned short type = (unsigned short)f->n;
    JEQ(f, g->type, 0, 0);
    if (any) {
        RET(f, SECCOMP_RET_ALLOW);
    } else {
        LD_ABS(f, SFS_ARG(2));
        int left = nproto;
        for (int r = 0; r < nrules; r++) {
            if (rules[r].pair == g->pair && rules[r].family == g->family && rules[r].type == g->type) {
                left--;
                JEQ(f, (uint32_t)rules[r].proto, (unsigned char)(left + 1), 0);
            }
        }
        RET(f, DENY(EPROTONOSUPPORT));
        RET(f, SECCOMP_RET_ALLOW);
    }
    patch_jf(f, fam);
    patch_jf(f, type);
}

/* socket() (pair 0) or socketpair() (pair 1): only the rules' triples. */
static void socket_block(struct sfs_filter *f, long nr, int pair,
                         const struct sfs_socket_rule *rules, int nrules)
{
    unsigned short at = begin_block(f, nr);
    for (int r = 0; r < nrules; r++) {
        int first = rules[r].pair == pair;
        for (int q = 0; first && q < r; q++)
            if (rules[q].pair == pair && rules[q].family == rules[r].family
                && rules[q].type == rules[r].type)
                first = 0;
        if (first)
            socket_group(f, rules, nrules, &rules[r]);
    }
    RET(f, DENY(EAFNOSUPPORT));
    patch_jf(f, at);
}

/* Ways around Landlock's TCP connect rule: data in the SYN (TCP Fast Open). */
static void tcp_blocks(struct sfs_filter *f)
{
    static const struct { long nr; int arg; } sends[] = {
        { SYS_sendto, 3 }, { SYS_sendmsg, 2 }, { SYS_sendmmsg, 3 },
    };
    for (size_t k = 0; k < 3; k++) {
        unsigned short at = begin_block(f, sends[k].nr);
        LD_ABS(f, SFS_ARG(sends[k].arg));
        JSET(f, MSG_FASTOPEN, 0, 1);
        RET(f, DENY(EOPNOTSUPP));
        RET(f, SECCOMP_RET_ALLOW);
        patch_jf(f, at);
    }
    unsigned short at = begin_block(f, SYS_setsockopt);
    LD_ABS(f, SFS_ARG(1));
    JEQ(f, IPPROTO_TCP, 0, 3);
    LD_ABS(f, SFS_ARG(2));
    JEQ(f, SFS_TCP_FASTOPEN_CONNECT, 0, 1);
    RET(f, DENY(EOPNOTSUPP));
    RET(f, SECCOMP_RET_ALLOW);
    patch_jf(f, at);
}

/* clone() without namespace flags; personality() only for the values Docker allows. */
static void process_blocks(struct sfs_filter *f)
{
    unsigned short at = begin_block(f, SYS_clone);
    LD_ABS(f, SFS_ARG(0));
    JSET(f, SFS_CLONE_NS_FLAGS, 0, 1);
    RET(f, DENY(EPERM));
    RET(f, SECCOMP_RET_ALLOW);
    patch_jf(f, at);
    static const uint32_t personas[] = { 0, 8, 0x20000, 0x20008, 0xffffffffU };
    at = begin_block(f, SYS_personality);
    LD_ABS(f, SFS_ARG(0));
    for (unsigned char k = 0; k < 5; k++)
        JEQ(f, personas[k], (unsigned char)(5 - k), 0);
    RET(f, DENY(EPERM));
    RET(f, SECCOMP_RET_ALLOW);
    patch_jf(f, at);
}

struct sfs_nr_action {
    uint32_t nr, ret;
};

/* Every syscall number of the native ABI is below this (x86_64 and aarch64: < 470). */
#define SFS_NR_SPAN 1024
#define SFS_DEFAULT DENY(ENOSYS)

/* act[nr] = ret for nrs[]; a number an earlier list set keeps its action. */
static void set_actions(uint32_t *act, const long *nrs, size_t count, uint32_t ret)
{
    for (size_t i = 0; i < count; i++) {
        if (nrs[i] < 0 || nrs[i] >= SFS_NR_SPAN)
            fail("seccomp", E2BIG);
        if (!act[nrs[i]])
            act[nrs[i]] = ret;
    }
}

/*
 * Binary search over intervals [iv[k].nr, iv[k + 1].nr) of one action each:
 * "JGE start(mid); JA right; left...; right...".  A path is about
 * 2 * log2(intervals) instructions, so the kernel's action-cache emulation
 * (every syscall number through the filter, at attach time) stays cheap.
 */
static void interval_tree(struct sfs_filter *f, const struct sfs_nr_action *iv, size_t lo, size_t hi)
{
    if (hi - lo == 1) {
        RET(f, iv[lo].ret);
        return;
    }
    size_t mid = lo + (hi - lo) / 2;
    emit(f, BPF_JMP | BPF_JGE | BPF_K, 0, 1, iv[mid].nr);
    unsigned short ja = f->n;
    emit(f, BPF_JMP | BPF_JA, 0, 0, 0);
    interval_tree(f, iv, lo, mid);
    f->insn[ja].k = (uint32_t)(f->n - ja - 1);
    interval_tree(f, iv, mid, hi);
}

/* The plain lists: unseen ENOSYS, refused EPERM, allowed; every other number ENOSYS. */
static void number_tree(struct sfs_filter *f)
{
    static uint32_t act[SFS_NR_SPAN];
    static struct sfs_nr_action iv[SFS_NR_SPAN + 1];
    static const long sockio[] = { SYS_sendto, SYS_sendmsg, SYS_sendmmsg, SYS_setsockopt };
    set_actions(act, sfs_unseen, sizeof sfs_unseen / sizeof sfs_unseen[0], DENY(ENOSYS));
    set_actions(act, sfs_refused, sizeof sfs_refused / sizeof sfs_refused[0], DENY(EPERM));
    set_actions(act, sockio, 4, SECCOMP_RET_ALLOW);     /* the TCP blocks, when on, come first */
    set_actions(act, sfs_allowed, sizeof sfs_allowed / sizeof sfs_allowed[0], SECCOMP_RET_ALLOW);
    size_t m = 0;
    for (uint32_t nr = 0; nr < SFS_NR_SPAN; nr++) {
        uint32_t ret = act[nr] ? act[nr] : SFS_DEFAULT;
        if (m == 0 || iv[m - 1].ret != ret) {
            iv[m].nr = nr;
            iv[m++].ret = ret;
        }
    }
    if (iv[m - 1].ret != SFS_DEFAULT) {
        iv[m].nr = SFS_NR_SPAN;
        iv[m++].ret = SFS_DEFAULT;
    }
    interval_tree(f, iv, 0, m);
}

static void install_seccomp(long long bits, const struct sfs_socket_rule *rules, int nrules)
{
#ifndef SFS_AUDIT_ARCH
    (void)bits;
    (void)rules;
    (void)nrules;
    fail("seccomp", ENOSYS);
#else
    static struct sfs_filter f;
    f.n = 0;
    LD_ABS(&f, offsetof(struct seccomp_data, arch));
    JEQ(&f, SFS_AUDIT_ARCH, 1, 0);
    RET(&f, DENY(ENOSYS));
    LD_ABS(&f, SFS_NR);
#if defined(__x86_64__)
    emit(&f, BPF_JMP | BPF_JGE | BPF_K, 0, 1, 0x40000000U);     /* x32 */
    RET(&f, DENY(ENOSYS));
#endif
    mode_blocks(&f);
    socket_block(&f, SYS_socket, 0, rules, nrules);
    socket_block(&f, SYS_socketpair, 1, rules, nrules);
    process_blocks(&f);
    if (bits & SFS_SECCOMP_TCP)
        tcp_blocks(&f);
    number_tree(&f);
    if (bits & SFS_SECCOMP_KEYS) {
        /* Leave the inherited session keyring (possessed keys) for a fresh one. */
        if (syscall(SYS_keyctl, SFS_KEYCTL_JOIN_SESSION_KEYRING, NULL) < 0 && errno != ENOSYS)
            fail("keyring", errno);
    }
    struct sock_fprog prog = { f.n, f.insn };
    if (prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, &prog, 0, 0) < 0)
        fail("seccomp", errno);
#endif
}

/* "--socket KIND:FAMILY:TYPE:PROTO": KIND s (socket) or p (socketpair), PROTO a number or '*'. */
static void parse_socket_rule(const char *spec, struct sfs_socket_rule *rule)
{
    char buf[64], *parts[4], *save = NULL;
    long long v[3];
    if (strlen(spec) >= sizeof buf)
        fail("usage", EINVAL);
    strcpy(buf, spec);
    for (int k = 0; k < 4; k++) {
        parts[k] = strtok_r(k ? NULL : buf, ":", &save);
        if (!parts[k])
            fail("usage", EINVAL);
    }
    if (strtok_r(NULL, ":", &save) || (strcmp(parts[0], "s") && strcmp(parts[0], "p")))
        fail("usage", EINVAL);
    for (int k = 0; k < 2; k++)
        if (parse_int(parts[k + 1], &v[k]) || v[k] < 0 || v[k] > 0xffff)
            fail("usage", EINVAL);
    if (strcmp(parts[3], "*") == 0)
        v[2] = SFS_PROTO_ANY;
    else if (parse_int(parts[3], &v[2]) || v[2] < 0 || v[2] > 0xffff)
        fail("usage", EINVAL);
    rule->pair = parts[0][0] == 'p';
    rule->family = (uint32_t)v[0];
    rule->type = (uint32_t)v[1];
    rule->proto = v[2];
}

/* A Landlock rule for a directory of our own (after the mount steps): /proc/self, the private /tmp. */
static void add_path_rule(int ruleset_fd, const char *path, long long access, const char *stage)
{
    int fd = open(path, O_PATH | O_DIRECTORY | O_CLOEXEC);
    if (fd < 0)
        fail(stage, errno);
    struct sfs_path_beneath rule = { (uint64_t)access, fd };
    if (syscall(SYS_landlock_add_rule, ruleset_fd, 1 /* PATH_BENEATH */, &rule, 0U) < 0)
        fail(stage, errno);
    close(fd);
}

int main(int argc, char **argv)
{
    int ruleset_fd = -1, cwd_fd = -1, cgroup_fd = -1, tty = 0, drop_caps = 0, ro_mounts = 0;
    struct sfs_binds binds = { .npins = 0, .nro = 0 };
    int trees[SFS_MAX_TREES], ntrees = 0, hold_ns = 0, mntns_fd = -1, userns_fd = -1, netns_fd = -1;
    int ipcns_fd = -1, env_fd = -1, pids_procs_fd = -1, init = 0, lifeline_fd = -1, want_pid_ns = 1;
    char **envp = environ;
    char *masks[SFS_MAX_MASKS];
    int nmasks = 0;
    long long unshare_flags = 0, proc_self_access = 0, seccomp_bits = -1, tmp_access = 0;
    long long egress_port = 0;
    int egress_fd = -1;
    long long ruleset_flags = 0;        /* landlock_restrict_self flags (--ruleset-flags) */
    const char *domain_tag = NULL;      /* comm during landlock_restrict_self (--domain-tag) */
    struct sfs_socket_rule sockets[SFS_MAX_SOCKETS];
    int nsockets = 0;
    long long run_uid = -1, run_gid = -1;
    int reach[SFS_MAX_TREES], nreach = 0;
    struct sfs_private priv = { .ws_fd = -1, .ws_path = NULL, .cwd_rel = NULL, .nsys = 0, .nlinks = 0 };
    int i;

    /* First pass: --status, so later usage errors are reported through it. */
    for (i = 1; i + 1 < argc && strcmp(argv[i], "--") != 0; i++)
        if (strcmp(argv[i], "--status") == 0)
            status_fd = parse_fd(argv[++i]);

    for (i = 1; i < argc; i++) {
        const char *a = argv[i];
        if (strcmp(a, "--") == 0) {
            i++;
            break;
        }
        if (strcmp(a, "--tty") == 0) {
            tty = 1;
            continue;
        }
        if (strcmp(a, "--ro-mounts") == 0) {
            ro_mounts = 1;
            continue;
        }
        if (strcmp(a, "--hold-ns") == 0) {
            hold_ns = 1;
            continue;
        }
        if (strcmp(a, "--init") == 0 || strcmp(a, "--no-pid-ns") == 0) {
            init = 1;
            want_pid_ns = want_pid_ns && a[2] == 'i';
            continue;
        }
        if (strcmp(a, "--drop-caps") == 0) {
            drop_caps = 1;
            continue;
        }
        if (i + 1 >= argc)
            fail("usage", EINVAL);
        const char *v = argv[++i];
        if (strcmp(a, "--status") == 0)
            continue;
        else if (strcmp(a, "--ruleset") == 0)
            ruleset_fd = parse_fd(v);
        else if (strcmp(a, "--cwd") == 0)
            cwd_fd = parse_fd(v);
        else if (strcmp(a, "--mntns") == 0)
            mntns_fd = parse_fd(v);
        else if (strcmp(a, "--userns") == 0)
            userns_fd = parse_fd(v);
        else if (strcmp(a, "--lifeline") == 0)
            lifeline_fd = parse_fd(v);
        else if (strcmp(a, "--netns") == 0)
            netns_fd = parse_fd(v);
        else if (strcmp(a, "--ipcns") == 0)
            ipcns_fd = parse_fd(v);
        else if (strcmp(a, "--mask") == 0) {
            if (nmasks == SFS_MAX_MASKS || v[0] != '/')
                fail("usage", EINVAL);
            masks[nmasks++] = (char *)v;
        } else if (strcmp(a, "--seccomp") == 0) {
            if (parse_int(v, &seccomp_bits) || seccomp_bits < 0 || seccomp_bits & ~SFS_SECCOMP_BITS)
                fail("usage", EINVAL);
        } else if (strcmp(a, "--socket") == 0) {
            if (nsockets == SFS_MAX_SOCKETS)
                fail("usage", E2BIG);
            parse_socket_rule(v, &sockets[nsockets++]);
        }
        else if (strcmp(a, "--uid") == 0 || strcmp(a, "--gid") == 0) {
            long long *dst = a[2] == 'u' ? &run_uid : &run_gid;
            if (parse_int(v, dst) || *dst < 0 || *dst >= 0xFFFFFFFFLL)
                fail("usage", EINVAL);
        } else if (strcmp(a, "--reach-tree") == 0) {
            if (nreach == SFS_MAX_TREES)
                fail("usage", E2BIG);
            reach[nreach++] = parse_fd(v);
        }
        else if (strcmp(a, "--private-root") == 0)
            priv.ws_fd = parse_fd(v);
        else if (strcmp(a, "--workspace-path") == 0) {
            if (!plain_abs_path(v))
                fail("usage", EINVAL);
            priv.ws_path = v;
        }
        else if (strcmp(a, "--cwd-rel") == 0)
            priv.cwd_rel = v;
        else if (strcmp(a, "--device") == 0)
            add_device_fd(parse_fd(v));
        else if (strcmp(a, "--proc-read") == 0)
            add_proc_read((char *)v);
        else if (strcmp(a, "--sys-tree") == 0) {
            if (priv.nsys == SFS_MAX_TREES)
                fail("usage", E2BIG);
            priv.sys[priv.nsys++] = parse_fd(v);
        } else if (strcmp(a, "--sys-link") == 0) {
            if (priv.nlinks == SFS_MAX_LINKS)
                fail("usage", E2BIG);
            if (!sys_link_spec(v))
                fail("usage", EINVAL);
            priv.links[priv.nlinks++] = (char *)v;
        }
        else if (strcmp(a, "--guard") == 0)
            add_guard(v);
        else if (strcmp(a, "--rw-tree") == 0) {
            if (ntrees == SFS_MAX_TREES)
                fail("usage", E2BIG);
            trees[ntrees++] = parse_fd(v);
        } else if (strcmp(a, "--ro-tree") == 0 || strcmp(a, "--pin-tree") == 0) {
            int ro = strcmp(a, "--ro-tree") == 0;
            int *n = ro ? &binds.nro : &binds.npins;
            if (*n == SFS_MAX_TREES)
                fail("usage", E2BIG);
            (ro ? binds.ro : binds.pins)[(*n)++] = parse_fd(v);
        } else if (strcmp(a, "--cgroup") == 0)
            cgroup_fd = parse_fd(v);
        else if (strcmp(a, "--rlimit") == 0)
            set_rlimit(v);
        else if (strcmp(a, "--env-fd") == 0)
            env_fd = parse_fd(v);
        else if (strcmp(a, "--pids-procs") == 0)
            pids_procs_fd = parse_fd(v);
        else if (strcmp(a, "--unshare") == 0) {
            if (parse_int(v, &unshare_flags))
                fail("usage", EINVAL);
        } else if (strcmp(a, "--egress-listen") == 0) {
            if (parse_int(v, &egress_port) || egress_port < 1 || egress_port > 65535)
                fail("usage", EINVAL);
        } else if (strcmp(a, "--egress-sock") == 0)
            egress_fd = parse_fd(v);
        else if (strcmp(a, "--ruleset-flags") == 0) {
            if (parse_int(v, &ruleset_flags) || ruleset_flags < 0 || ruleset_flags > 0xff)
                fail("usage", EINVAL);
        } else if (strcmp(a, "--domain-tag") == 0) {
            if (strlen(v) == 0 || strlen(v) > 15)
                fail("usage", EINVAL);
            domain_tag = v;
        } else if (strcmp(a, "--proc-self") == 0 || strcmp(a, "--tmp-access") == 0) {
            if (parse_int(v, a[2] == 'p' ? &proc_self_access : &tmp_access))
                fail("usage", EINVAL);
        } else
            fail("usage", EINVAL);
    }
    if (i >= argc || (run_uid < 0) != (run_gid < 0) || (priv.ws_fd >= 0) != (priv.ws_path != NULL)
        || (priv.ws_fd >= 0 && (ro_mounts || mntns_fd >= 0 || hold_ns))
        || (egress_port > 0) != (egress_fd >= 0)
        || (egress_fd >= 0 && !(unshare_flags & CLONE_NEWNET) && netns_fd < 0)
        || (granted.n && (mntns_fd >= 0 || hold_ns)))
        fail("usage", EINVAL);
    if (sfs_nguards && (mntns_fd >= 0 || hold_ns || (!ro_mounts && priv.ws_fd < 0)))
        fail("usage", EINVAL);          /* guards need a mount namespace of this run's own */
    if (env_fd >= 0)
        envp = read_env(env_fd);        /* data for the target's execve only */

    if (init)
        start_init(cgroup_fd, lifeline_fd, &userns_fd, want_pid_ns); /* from here on: the target */
    else if (cgroup_fd >= 0)
        fork_into_cgroup(cgroup_fd);    /* from here on: the target's process */
    if (pids_procs_fd >= 0)
        join_pids_v1(pids_procs_fd);    /* first: nothing runs outside pids.max */

    if (setsid() < 0)
        fail("setsid", errno);
    if (tty && ioctl(0, TIOCSCTTY, 0) < 0)
        fail("tty", errno);
    guards_note_paths();
    if (mntns_fd >= 0)
        join_mount_ns(userns_fd, mntns_fd, netns_fd, ipcns_fd, &cwd_fd);
    else if (priv.ws_fd >= 0)
        private_root(&priv, trees, ntrees, reach, nreach, &binds, tty, &cwd_fd);
    else if (ro_mounts) {
        clone_devices(geteuid() == 0);  /* in the host's namespace, before any stub hides a node */
        read_only_mounts(trees, ntrees, &binds, reach, nreach, masks, nmasks, &cwd_fd);
        attach_devices_in_place();
    }
    if (unshare_flags && unshare((int)unshare_flags) < 0)
        fail("unshare", errno);
    if (egress_fd >= 0)
        egress_listener(egress_fd, egress_port);
    if (hold_ns) {
        /* Keep this namespace alive until the parent holds its nsfs fds. */
        char c;
        ssize_t w = write(status_fd, "ready\n", 6);
        (void)w;
        while (read(0, &c, 1) > 0)
            ;
        _exit(0);
    }
    if (cwd_fd >= 0) {
        if (fchdir(cwd_fd) < 0)
            fail("cwd", errno);
        close(cwd_fd);
    }
    if (drop_caps)
        drop_bounding_set();
    if (run_uid >= 0)
        switch_identity(run_uid, run_gid);
    if (drop_caps)
        drop_capabilities();
    if (prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) < 0)
        fail("no_new_privs", errno);
    if (ruleset_fd >= 0) {
        if (proc_self_access)
            add_path_rule(ruleset_fd, "/proc/self", proc_self_access, "proc_self");
        if (tmp_access && priv.ws_fd >= 0)
            add_path_rule(ruleset_fd, "/tmp", tmp_access, "privroot");
        if (granted.nprocs)
            add_proc_read_rules(ruleset_fd, 4 | 8 /* READ_FILE | READ_DIR */);
        if (domain_tag != NULL && prctl(PR_SET_NAME, domain_tag, 0, 0, 0) < 0)
            fail("landlock", errno);
        if (syscall(SYS_landlock_restrict_self, ruleset_fd, (unsigned)ruleset_flags) < 0)
            fail("landlock", errno);
        close(ruleset_fd);
    }
    if (seccomp_bits >= 0)
        install_seccomp(seccomp_bits, sockets, nsockets);
    /* Every fd but 0/1/2 (the status fd included) is gone at execve. */
    if (syscall(SYS_close_range, 3U, ~0U, CLOSE_RANGE_CLOEXEC) < 0) {
        int maxfd = (int)sysconf(_SC_OPEN_MAX);
        for (int fd = 3; fd < maxfd; fd++)
            fcntl(fd, F_SETFD, FD_CLOEXEC);
    }
    exec_target(argv + i, envp);
    return 127;
}
