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
 *   --seccomp BITS     after no_new_privs, install a seccomp filter refusing:
 *                      1: keyctl, add_key, request_key (after joining a fresh
 *                         anonymous session keyring); 2: socket(IPPROTO_MPTCP),
 *                         sendto/sendmsg/sendmmsg with MSG_FASTOPEN and
 *                         setsockopt(TCP_FASTOPEN_CONNECT) (ways around
 *                         Landlock's TCP connect rule); 4: socket(AF_UNIX) and
 *                         socketpair(AF_UNIX, SOCK_DGRAM) (a datagram socket
 *                         can be re-connected to any path).  Any bit also
 *                         refuses io_uring (its ops bypass seccomp) and every
 *                         syscall of another ABI (x32, 32-bit compat)
 *   --tty              setsid() then ioctl(0, TIOCSCTTY): fd 0 becomes the
 *                      controlling terminal (PTY sessions)
 *   --cwd FD           fchdir(FD): the working directory, opened by the
 *                      parent through a Root (never a host path string)
 *   --ro-mounts        a private mount namespace in which every mount is
 *                      read-only except clones of the --rw-tree directories
 *                      (not root: inside a user namespace mapping only our
 *                      own uid and gid).  Landlock does not cover chmod, chown,
 *                      utime or xattr changes; a read-only mount does (EROFS)
 *   --rw-tree FD       with --ro-mounts: keep the tree at directory FD
 *                      writable (the workspace, read-write grants); repeatable
 *   --hold-ns          with --ro-mounts: after making the namespace, write
 *                      "ready" on the status fd and wait for EOF on stdin
 *                      (the parent opens /proc/PID/ns/mnt meanwhile)
 *   --mntns FD         enter that mount namespace (made by --hold-ns)
 *                      instead of making one; --userns FD first when it
 *                      lives in a user namespace (unprivileged hosts)
 *   --drop-caps        empty the capability bounding, ambient, inheritable,
 *                      permitted and effective sets (root keeps uid 0 but no
 *                      capabilities)
 *   --ruleset FD       landlock_restrict_self(FD) after PR_SET_NO_NEW_PRIVS
 *   --proc-self ACCESS add a Landlock rule for this process's own /proc/PID
 *                      directory (it is the target's after execve) with the
 *                      given access bits, before restricting
 *
 * setsid() always runs (a new session and process group, so the parent can
 * signal the whole group), PR_SET_NO_NEW_PRIVS is always set, and every fd
 * but 0/1/2 is marked close-on-exec (close_range), so the target starts with
 * exactly stdin/stdout/stderr.
 *
 * PR_SET_PDEATHSIG is deliberately not used: trio forks from a worker
 * thread, and the death signal fires when that *thread* exits, which trio's
 * thread cache does after a few idle seconds.  The ProcessSupervisor (process
 * group + cgroup v2 leaf) is what ends confined processes.  Exit status 127 with a status line means the
 * helper failed before execve; the target's own 127 comes with no line.
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
#include <netinet/in.h>

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

static void drop_capabilities(void)
{
    for (int cap = 0; cap < 64; cap++) {
        if (prctl(PR_CAPBSET_DROP, cap, 0, 0, 0) < 0 && errno != EINVAL)
            fail("capabilities", errno);
    }
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

/* Every mount read-only except clones of the trees[] directories. */
static void read_only_mounts(const int *trees, int ntrees, char **masks, int nmasks, int *cwd_fd)
{
    int clones[SFS_MAX_TREES], targets[SFS_MAX_TREES];
    char *paths[SFS_MAX_TREES], *cwd_path = NULL;
    for (int t = 0; t < ntrees; t++)
        paths[t] = fd_path(trees[t], "mounts");
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
    }
    struct sfs_mount_attr attr = { SFS_MOUNT_ATTR_RDONLY, 0, 0, 0 };
    if (syscall(SYS_mount_setattr, AT_FDCWD, "/", SFS_AT_RECURSIVE, &attr, sizeof attr) < 0)
        fail("mounts", errno);
    for (int t = 0; t < ntrees; t++) {
        if (syscall(SYS_move_mount, clones[t], "", targets[t], "",
                    SFS_MOVE_MOUNT_F_EMPTY_PATH | SFS_MOVE_MOUNT_T_EMPTY_PATH) < 0)
            fail("mounts", errno);
        close(clones[t]);
        close(targets[t]);
        free(paths[t]);             /* trees[t] is closed at execve (it may also be the cwd fd) */
    }
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

#if defined(__x86_64__)
#define SFS_AUDIT_ARCH AUDIT_ARCH_X86_64
#elif defined(__aarch64__)
#define SFS_AUDIT_ARCH AUDIT_ARCH_AARCH64
#elif defined(__riscv) && __riscv_xlen == 64
#define SFS_AUDIT_ARCH AUDIT_ARCH_RISCV64
#endif
#define SFS_SECCOMP_KEYS 1
#define SFS_SECCOMP_TCP 2
#define SFS_SECCOMP_UNIX 4
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
#define SFS_KEYCTL_JOIN_SESSION_KEYRING 1
/* The low 32 bits of argument i (int and unsigned int arguments; little endian). */
#define SFS_ARG(i) ((uint32_t)(offsetof(struct seccomp_data, args) + 8 * (i)))
#define SFS_MAX_FILTER 96

struct sfs_filter {
    struct sock_filter insn[SFS_MAX_FILTER];
    unsigned short n;
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
#define DENY(err) (SECCOMP_RET_ERRNO | ((err) & SECCOMP_RET_DATA))

/* One syscall whose arguments decide: "LD nr; JEQ nr else skip the body". */
static void begin_block(struct sfs_filter *f, long nr, unsigned char body_len)
{
    LD_ABS(f, offsetof(struct seccomp_data, nr));
    emit(f, BPF_JMP | BPF_JEQ | BPF_K, 0, body_len, (uint32_t)nr);
}

static void install_seccomp(long long bits)
{
#ifndef SFS_AUDIT_ARCH
    (void)bits;
    fail("seccomp", ENOSYS);
#else
    struct sfs_filter f = { .n = 0 };
    /* Another ABI (32-bit compat: socketcall hides its arguments) is refused. */
    LD_ABS(&f, offsetof(struct seccomp_data, arch));
    emit(&f, BPF_JMP | BPF_JEQ | BPF_K, 1, 0, SFS_AUDIT_ARCH);
    RET(&f, DENY(ENOSYS));
    LD_ABS(&f, offsetof(struct seccomp_data, nr));
#if defined(__x86_64__)
    emit(&f, BPF_JMP | BPF_JGE | BPF_K, 0, 1, 0x40000000U);     /* x32 */
    RET(&f, DENY(ENOSYS));
#endif
    /* io_uring submits socket, connect and sendmsg without seccomp seeing them. */
    static const long uring[] = { SYS_io_uring_setup, SYS_io_uring_enter, SYS_io_uring_register };
    for (size_t k = 0; k < 3; k++) {
        emit(&f, BPF_JMP | BPF_JEQ | BPF_K, 0, 1, (uint32_t)uring[k]);
        RET(&f, DENY(ENOSYS));
    }
    if (bits & SFS_SECCOMP_KEYS) {
        static const long keys[] = { SYS_keyctl, SYS_add_key, SYS_request_key };
        for (size_t k = 0; k < 3; k++) {
            emit(&f, BPF_JMP | BPF_JEQ | BPF_K, 0, 1, (uint32_t)keys[k]);
            RET(&f, DENY(EPERM));
        }
    }
    if (bits & (SFS_SECCOMP_TCP | SFS_SECCOMP_UNIX)) {
        unsigned char len = (unsigned char)(1 + ((bits & SFS_SECCOMP_UNIX) ? 3 : 0)
                                            + ((bits & SFS_SECCOMP_TCP) ? 3 : 0));
        begin_block(&f, SYS_socket, len);
        if (bits & SFS_SECCOMP_UNIX) {
            LD_ABS(&f, SFS_ARG(0));
            emit(&f, BPF_JMP | BPF_JEQ | BPF_K, 0, 1, AF_UNIX);
            RET(&f, DENY(EACCES));
        }
        if (bits & SFS_SECCOMP_TCP) {
            LD_ABS(&f, SFS_ARG(2));
            emit(&f, BPF_JMP | BPF_JEQ | BPF_K, 0, 1, IPPROTO_MPTCP);
            RET(&f, DENY(EPROTONOSUPPORT));
        }
        RET(&f, SECCOMP_RET_ALLOW);
    }
    if (bits & SFS_SECCOMP_UNIX) {
        /* Stream and seqpacket pairs are connected for good; a datagram one
         * can connect()/sendto() any socket path. */
        begin_block(&f, SYS_socketpair, 7);
        LD_ABS(&f, SFS_ARG(0));
        emit(&f, BPF_JMP | BPF_JEQ | BPF_K, 0, 4, AF_UNIX);
        LD_ABS(&f, SFS_ARG(1));
        emit(&f, BPF_ALU | BPF_AND | BPF_K, 0, 0, 0xf);
        emit(&f, BPF_JMP | BPF_JEQ | BPF_K, 0, 1, SOCK_DGRAM);
        RET(&f, DENY(EACCES));
        RET(&f, SECCOMP_RET_ALLOW);
    }
    if (bits & SFS_SECCOMP_TCP) {
        static const struct { long nr; int arg; } sends[] = {
            { SYS_sendto, 3 }, { SYS_sendmsg, 2 }, { SYS_sendmmsg, 3 },
        };
        for (size_t k = 0; k < 3; k++) {
            begin_block(&f, sends[k].nr, 4);
            LD_ABS(&f, SFS_ARG(sends[k].arg));
            emit(&f, BPF_JMP | BPF_JSET | BPF_K, 0, 1, MSG_FASTOPEN);
            RET(&f, DENY(EOPNOTSUPP));
            RET(&f, SECCOMP_RET_ALLOW);
        }
        begin_block(&f, SYS_setsockopt, 6);
        LD_ABS(&f, SFS_ARG(1));
        emit(&f, BPF_JMP | BPF_JEQ | BPF_K, 0, 3, IPPROTO_TCP);
        LD_ABS(&f, SFS_ARG(2));
        emit(&f, BPF_JMP | BPF_JEQ | BPF_K, 0, 1, SFS_TCP_FASTOPEN_CONNECT);
        RET(&f, DENY(EOPNOTSUPP));
        RET(&f, SECCOMP_RET_ALLOW);
    }
    RET(&f, SECCOMP_RET_ALLOW);
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

int main(int argc, char **argv)
{
    int ruleset_fd = -1, cwd_fd = -1, cgroup_fd = -1, tty = 0, drop_caps = 0, ro_mounts = 0;
    int trees[SFS_MAX_TREES], ntrees = 0, hold_ns = 0, mntns_fd = -1, userns_fd = -1, netns_fd = -1;
    int ipcns_fd = -1, env_fd = -1, pids_procs_fd = -1;
    char **envp = environ;
    char *masks[SFS_MAX_MASKS];
    int nmasks = 0;
    long long unshare_flags = 0, proc_self_access = 0, seccomp_bits = 0;
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
        else if (strcmp(a, "--netns") == 0)
            netns_fd = parse_fd(v);
        else if (strcmp(a, "--ipcns") == 0)
            ipcns_fd = parse_fd(v);
        else if (strcmp(a, "--mask") == 0) {
            if (nmasks == SFS_MAX_MASKS || v[0] != '/')
                fail("usage", EINVAL);
            masks[nmasks++] = (char *)v;
        } else if (strcmp(a, "--seccomp") == 0) {
            if (parse_int(v, &seccomp_bits) || seccomp_bits < 0)
                fail("usage", EINVAL);
        }
        else if (strcmp(a, "--rw-tree") == 0) {
            if (ntrees == SFS_MAX_TREES)
                fail("usage", E2BIG);
            trees[ntrees++] = parse_fd(v);
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
        } else if (strcmp(a, "--proc-self") == 0) {
            if (parse_int(v, &proc_self_access))
                fail("usage", EINVAL);
        } else
            fail("usage", EINVAL);
    }
    if (i >= argc)
        fail("usage", EINVAL);
    if (env_fd >= 0)
        envp = read_env(env_fd);        /* data for the target's execve only */

    if (cgroup_fd >= 0)
        fork_into_cgroup(cgroup_fd);    /* from here on: the target's process */
    if (pids_procs_fd >= 0)
        join_pids_v1(pids_procs_fd);    /* first: nothing runs outside pids.max */

    if (setsid() < 0)
        fail("setsid", errno);
    if (tty && ioctl(0, TIOCSCTTY, 0) < 0)
        fail("tty", errno);
    if (mntns_fd >= 0)
        join_mount_ns(userns_fd, mntns_fd, netns_fd, ipcns_fd, &cwd_fd);
    else if (ro_mounts)
        read_only_mounts(trees, ntrees, masks, nmasks, &cwd_fd);
    if (unshare_flags && unshare((int)unshare_flags) < 0)
        fail("unshare", errno);
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
        drop_capabilities();
    if (prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) < 0)
        fail("no_new_privs", errno);
    if (ruleset_fd >= 0) {
        if (proc_self_access) {
            int pfd = open("/proc/self", O_PATH | O_DIRECTORY | O_CLOEXEC);
            if (pfd < 0)
                fail("proc_self", errno);
            struct sfs_path_beneath rule = { (uint64_t)proc_self_access, pfd };
            if (syscall(SYS_landlock_add_rule, ruleset_fd, 1 /* PATH_BENEATH */, &rule, 0U) < 0)
                fail("proc_self", errno);
            close(pfd);
        }
        if (syscall(SYS_landlock_restrict_self, ruleset_fd, 0U) < 0)
            fail("landlock", errno);
        close(ruleset_fd);
    }
    if (seccomp_bits)
        install_seccomp(seccomp_bits);
    /* Every fd but 0/1/2 (the status fd included) is gone at execve. */
    if (syscall(SYS_close_range, 3U, ~0U, CLOSE_RANGE_CLOEXEC) < 0) {
        int maxfd = (int)sysconf(_SC_OPEN_MAX);
        for (int fd = 3; fd < maxfd; fd++)
            fcntl(fd, F_SETFD, FD_CLOEXEC);
    }
    exec_target(argv + i, envp);
    return 127;
}
