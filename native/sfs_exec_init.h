/*
 * Supervision for sfs-exec (--init, --lifeline): included by sfs_exec.c after
 * fail(), status_fd, write_file() and join_cgroup().
 *
 * With --init the helper puts the target under a tiny init of its own:
 *
 *   Python (host) ── helper ──clone(CLONE_PARENT)──> init ──fork──> target
 *                    exits after "pid N MODE"        (our child)     (its child)
 *
 * MODE "ns": init is pid 1 of a new PID namespace (root directly; otherwise
 * inside a user namespace mapping only our own uid/gid, the supervisor's held
 * one when given).  When init exits the kernel SIGKILLs every process left in
 * the namespace, and orphans (CLONE_PARENT children of the target included)
 * are init's children, reaped by it, never the host's.
 * MODE "sub": no PID namespace could be made (or --no-pid-ns asked for
 * none: the tests of this fallback use it); init is a child subreaper
 * (PR_SET_CHILD_SUBREAPER), so orphans still reparent to it, and it ends the
 * tree by SIGKILLing its own unreaped children (whose pids cannot be reused
 * before it reaps them) until it has none.
 *
 * init's loop: SIGTERM, SIGINT, SIGHUP and SIGQUIT are forwarded to the tree;
 * SIGUSR1 means "kill the tree now"; every child is reaped; when the target
 * exits, init ends the tree, writes "exit WSTATUS" (the raw wait status) on
 * the status fd and exits with the target's code (128 + signal if signalled);
 * EOF or hangup on the lifeline fd (a pipe whose write end only the host
 * holds, so it closes when the host process dies, SIGKILL included) ends the
 * tree and init.  init also watches a pidfd of the host process (its parent
 * by CLONE_PARENT),
 * which covers a lifeline write end inherited by a child the host forked
 * without exec (the helper opens it before the clone, and checks the host is
 * still its parent afterwards).  PR_SET_PDEATHSIG is not used: it follows the thread that
 * forked (trio forks from a worker thread that exits when idle), where a
 * pidfd of the process follows the whole process.
 *
 * Status protocol with --init: the helper writes "pid N MODE"; then init
 * writes either "ok" (the target reached execve) or the target's failure
 * line "STAGE ERRNO", and at the end "exit WSTATUS".  The target reports its
 * failure through a private close-on-exec pipe to init, so EOF there means
 * the execve happened.
 */
#include <poll.h>
#include <sys/signalfd.h>
#include <sys/wait.h>
#include <dirent.h>

#ifndef PR_SET_CHILD_SUBREAPER
#define PR_SET_CHILD_SUBREAPER 36
#endif
#ifndef SYS_pidfd_open
#define SYS_pidfd_open 434
#endif

/* Map only our own uid and gid in a new user namespace (unprivileged hosts). */
static int own_user_ns(void)
{
    uid_t uid = geteuid();
    gid_t gid = getegid();
    char map[64];
    if (unshare(CLONE_NEWUSER) < 0)
        return -1;
    write_file("/proc/self/setgroups", "deny");
    snprintf(map, sizeof map, "%u %u 1", (unsigned)uid, (unsigned)uid);
    write_file("/proc/self/uid_map", map);
    snprintf(map, sizeof map, "%u %u 1", (unsigned)gid, (unsigned)gid);
    write_file("/proc/self/gid_map", map);
    return 0;
}

/*
 * Make the PID namespace our next child starts in.  Returns 1 when made, 0
 * when the system refuses one (the subreaper mode).  *userns_fd (the
 * supervisor's held user namespace, unprivileged hosts) is joined here and
 * set to -1 so the mount step does not join it again.
 */
static int make_pid_ns(int *userns_fd)
{
    if (geteuid() != 0) {
        if (*userns_fd >= 0) {
            if (setns(*userns_fd, CLONE_NEWUSER) < 0)
                fail("mounts", errno);
            close(*userns_fd);
            *userns_fd = -1;
        } else if (own_user_ns() < 0)
            return 0;
    }
    return unshare(CLONE_NEWPID) == 0;
}

/* clone(CLONE_PARENT), into the cgroup directory cgroup_fd when >= 0. */
static long clone_sibling(int cgroup_fd)
{
    struct sfs_clone_args args;
    memset(&args, 0, sizeof args);
    args.flags = CLONE_PARENT | (cgroup_fd >= 0 ? SFS_CLONE_INTO_CGROUP : 0);
    args.exit_signal = SIGCHLD;
    args.cgroup = cgroup_fd >= 0 ? (uint64_t)cgroup_fd : 0;
    long pid = syscall(SYS_clone3, &args, sizeof args);
    if (pid < 0 && (errno == ENOSYS || errno == E2BIG || errno == EINVAL)) {
        if (cgroup_fd >= 0)
            join_cgroup(cgroup_fd);
        pid = syscall(SYS_clone, CLONE_PARENT | SIGCHLD, 0, 0, 0, 0);
    }
    if (pid < 0)
        fail("init", errno);
    return pid;
}

/* Send sig to the whole tree: every process of the namespace, or our own children. */
static void signal_tree(int ns, int sig)
{
    if (ns) {
        kill(-1, sig);              /* from pid 1: every process in the namespace but us */
        return;
    }
    char path[64], buf[4096];
    snprintf(path, sizeof path, "/proc/self/task/%d/children", (int)syscall(SYS_gettid));
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0)
        return;
    ssize_t n = read(fd, buf, sizeof buf - 1);
    close(fd);
    if (n <= 0)
        return;
    buf[n] = '\0';
    for (char *p = buf; *p;) {
        char *end;
        long pid = strtol(p, &end, 10);
        if (end == p)
            break;
        if (pid > 0)
            kill((pid_t)pid, sig);  /* our unreaped child: its pid is still ours */
        p = end;
    }
}

/*
 * End everything under init.  In a namespace, init's exit does it (the
 * kernel kills the rest); as a subreaper, kill our children, reap them,
 * adopt theirs, repeat until none is left.
 */
static void end_tree(int ns)
{
    if (ns)
        return;
    for (;;) {
        signal_tree(0, SIGKILL);
        pid_t w = waitpid(-1, NULL, 0);
        if (w < 0 && errno == ECHILD)
            return;
        while (waitpid(-1, NULL, WNOHANG) > 0)
            ;
    }
}

static void say(const char *line)
{
    ssize_t w = write(status_fd, line, strlen(line));
    (void)w;
}

/* Relay the target's pre-exec report (or "ok" at EOF); returns 1 when done. */
static int relay_exec_pipe(int fd, int *relayed)
{
    char buf[128];
    ssize_t n = read(fd, buf, sizeof buf - 1);
    if (n < 0 && errno == EINTR)
        return 0;
    if (n > 0) {
        buf[n] = '\0';
        say(buf);
        *relayed = 1;
        return 0;
    }
    if (!*relayed)
        say("ok\n");
    close(fd);
    return 1;
}

static void finish(int ns, int exec_fd, int relayed, int wstatus)
{
    char line[48];
    while (exec_fd >= 0 && !relay_exec_pipe(exec_fd, &relayed))
        ;                           /* the target is gone: EOF comes */
    end_tree(ns);
    snprintf(line, sizeof line, "exit %d\n", wstatus);
    say(line);
    _exit(WIFEXITED(wstatus) ? WEXITSTATUS(wstatus) : 128 + WTERMSIG(wstatus));
}

static void init_loop(int ns, pid_t target, int sig_fd, int lifeline_fd, int exec_fd, int host_fd)
{
    struct pollfd p[4] = { { sig_fd, POLLIN, 0 }, { lifeline_fd, POLLIN, 0 }, { exec_fd, POLLIN, 0 },
                           { host_fd, POLLIN, 0 } };
    int relayed = 0;
    for (;;) {
        if (poll(p, 4, -1) < 0) {
            if (errno == EINTR)
                continue;
            end_tree(ns);
            _exit(125);
        }
        if (p[2].revents && relay_exec_pipe(p[2].fd, &relayed))
            p[2].fd = -1;
        if (p[1].revents || p[3].revents) {     /* the host is gone */
            end_tree(ns);
            _exit(137);
        }
        if (!(p[0].revents & POLLIN))
            continue;
        struct signalfd_siginfo si;
        if (read(sig_fd, &si, sizeof si) != (ssize_t)sizeof si)
            continue;
        if (si.ssi_signo == SIGUSR1)
            signal_tree(ns, SIGKILL);
        else if (si.ssi_signo != SIGCHLD)
            signal_tree(ns, (int)si.ssi_signo);
        int st;
        pid_t w;
        while ((w = waitpid(-1, &st, WNOHANG)) > 0)
            if (w == target)
                finish(ns, p[2].fd, relayed, st);
    }
}

/*
 * --init: fork init (see the top of this file).  Returns in the target only,
 * with status_fd replaced by the private pipe to init.
 */
static void start_init(int cgroup_fd, int lifeline_fd, int *userns_fd, int want_pid_ns)
{
    if (lifeline_fd < 0)
        fail("usage", EINVAL);
    int ns = want_pid_ns && make_pid_ns(userns_fd);
    int sync_fds[2], exec_fds[2];
    /* Opened here, in the host's PID namespace (init's own cannot name it). */
    pid_t host = getppid();
    int host_fd = (int)syscall(SYS_pidfd_open, host, 0);
    if (host_fd < 0 || getppid() != host)
        _exit(137);                 /* the host is already gone: run nothing */
    if (pipe2(sync_fds, O_CLOEXEC) < 0)
        fail("init", errno);
    long pid = clone_sibling(cgroup_fd);
    if (pid > 0) {                  /* the helper: report init's pid and go */
        char line[48];
        int n = snprintf(line, sizeof line, "pid %ld %s\n", pid, ns ? "ns" : "sub");
        if (write(status_fd, line, (size_t)n) != n)
            _exit(126);
        _exit(0);
    }
    close(sync_fds[1]);
    if (cgroup_fd >= 0)
        close(cgroup_fd);
    if (!ns && prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) < 0)
        fail("init", errno);
    if (setsid() < 0)
        fail("setsid", errno);
    sigset_t set, old;
    sigemptyset(&set);
    int sigs[] = { SIGCHLD, SIGTERM, SIGINT, SIGHUP, SIGQUIT, SIGUSR1 };
    for (size_t k = 0; k < sizeof sigs / sizeof sigs[0]; k++)
        sigaddset(&set, sigs[k]);
    if (sigprocmask(SIG_BLOCK, &set, &old) < 0)
        fail("init", errno);
    int sig_fd = signalfd(-1, &set, SFD_CLOEXEC);
    if (sig_fd < 0 || pipe2(exec_fds, O_CLOEXEC) < 0)
        fail("init", errno);
    pid_t target = fork();
    if (target < 0)
        fail("init", errno);
    if (target == 0) {
        sigprocmask(SIG_SETMASK, &old, NULL);
        close(sig_fd);
        close(lifeline_fd);
        close(host_fd);
        close(sync_fds[0]);
        close(exec_fds[0]);
        close(status_fd);
        status_fd = exec_fds[1];
        in_own_pid_ns = ns;
        return;
    }
    close(exec_fds[1]);
    char c;
    while (read(sync_fds[0], &c, 1) < 0 && errno == EINTR)
        ;                           /* EOF: the helper's "pid" line went first */
    close(sync_fds[0]);
    init_loop(ns, target, sig_fd, lifeline_fd, exec_fds[0], host_fd);
}
