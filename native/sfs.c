/*
 * sandbox-fs native core: syscalls only, no policy.
 *
 * Every function returns a non-negative result (fd, count, ABI number) or a
 * negative errno.  errno itself is never the error channel, and nothing here
 * keeps global state.  Policy (what is allowed, what an error means) lives in
 * Python (sandbox_fs/_native.py and sandbox_fs/_root.py).
 */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/vfs.h>
#include <sys/syscall.h>
#include <sys/types.h>
#include <unistd.h>
#include <linux/openat2.h>

#include "sfs.h"

#ifndef SYS_openat2
#define SYS_openat2 437
#endif
#ifndef SYS_landlock_create_ruleset
#define SYS_landlock_create_ruleset 444
#endif
#ifndef SYS_landlock_add_rule
#define SYS_landlock_add_rule 445
#endif

/* ------------------------------------------------------------------ */
/* openat2                                                             */
/* ------------------------------------------------------------------ */

int sfs_openat2(int dirfd, const char *path, uint64_t flags, uint64_t mode, uint64_t resolve)
{
    struct open_how how;
    memset(&how, 0, sizeof how);
    how.flags = flags | O_CLOEXEC;
    /* openat2 rejects a non-zero mode unless a file may be created. */
    how.mode = ((flags & O_CREAT) || (flags & O_TMPFILE) == O_TMPFILE) ? (mode & 07777) : 0;
    how.resolve = resolve;
    for (int attempt = 0; attempt < SFS_EAGAIN_RETRIES; attempt++) {
        long fd = syscall(SYS_openat2, dirfd, path, &how, sizeof how);
        if (fd >= 0)
            return (int)fd;
        /* EAGAIN: a concurrent rename raced a ".." step; retrying is safe. */
        if (errno != EAGAIN && errno != EINTR)
            return -errno;
    }
    return -EAGAIN;
}

/* ------------------------------------------------------------------ */
/* Fallback resolver: one component at a time, O_PATH|O_NOFOLLOW.     */
/* Same answers as openat2(RESOLVE_BENEATH|RESOLVE_NO_MAGICLINKS).     */
/* ------------------------------------------------------------------ */

struct walk {
    int *fds;      /* fds[0..depth-1] are owned O_PATH fds below the root */
    int depth;
    int cap;
    int rootfd;    /* not owned */
};

static int walk_cur(const struct walk *w)
{
    return w->depth ? w->fds[w->depth - 1] : w->rootfd;
}

static int walk_push(struct walk *w, int fd)
{
    if (w->depth == w->cap) {
        int ncap = w->cap ? w->cap * 2 : 16;
        int *n = realloc(w->fds, (size_t)ncap * sizeof *n);
        if (!n)
            return -ENOMEM;
        w->fds = n;
        w->cap = ncap;
    }
    w->fds[w->depth++] = fd;
    return 0;
}

static void walk_free(struct walk *w)
{
    for (int i = 0; i < w->depth; i++)
        close(w->fds[i]);
    free(w->fds);
}

/*
 * procfs "magic links" (/proc/PID/fd/N, /proc/PID/root, cwd, exe, ns/...) do
 * not resolve by their text.  Their text is absolute or of the form
 * "type:[inode]"; ordinary procfs symlinks (/proc/self -> "1234") are plain
 * relative names.  Refuse the first kind as openat2 does with
 * RESOLVE_NO_MAGICLINKS.
 */
#define SFS_PROC_SUPER_MAGIC 0x9fa0
static int is_proc_magic(int on_proc, const char *target)
{
    return on_proc && (target[0] == '/' || strchr(target, ':') != NULL);
}

/* Replace the unprocessed tail "rest" by "target/rest" in a fresh buffer. */
static char *path_splice(const char *target, size_t tlen, const char *rest)
{
    size_t rlen = strlen(rest);
    char *n = malloc(tlen + 1 + rlen + 1);
    if (!n)
        return NULL;
    memcpy(n, target, tlen);
    n[tlen] = '/';
    memcpy(n + tlen + 1, rest, rlen + 1);
    if (rlen == 0)
        n[tlen] = '\0';
    return n;
}

int sfs_open_fallback(int rootfd, const char *path, uint64_t flags, uint64_t mode, uint64_t resolve)
{
    struct walk w = { NULL, 0, 0, rootfd };
    struct stat rootst;
    char *buf = NULL;
    const char *p;
    int hops = 0, ret;
    char name[NAME_MAX + 1];
    char target[PATH_MAX + 1];

    if (path[0] == '\0')
        return -ENOENT;
    if (path[0] == '/')
        return -EXDEV;                  /* RESOLVE_BENEATH: absolute is an escape */
    if (fstat(rootfd, &rootst) < 0)
        return -errno;
    buf = strdup(path);
    if (!buf)
        return -ENOMEM;
    p = buf;

    for (;;) {
        while (*p == '/')
            p++;
        const char *end = strchrnul(p, '/');
        size_t len = (size_t)(end - p);
        const char *after = end;
        while (*after == '/')
            after++;
        int last = (*after == '\0');
        int trailing_slash = last && *end == '/';

        if (len == 0) {
            /* The path was only slashes after a symlink splice: means "."  */
            ret = openat(walk_cur(&w), ".", (int)(flags | O_CLOEXEC), (mode_t)mode);
            ret = ret < 0 ? -errno : ret;
            goto out;
        }
        if (len > NAME_MAX) {
            ret = -ENAMETOOLONG;
            goto out;
        }
        memcpy(name, p, len);
        name[len] = '\0';

        if (strcmp(name, "..") == 0) {
            if (w.depth == 0) {
                ret = -EXDEV;           /* would climb above the root */
                goto out;
            }
            close(w.fds[--w.depth]);
            if (last) {
                ret = openat(walk_cur(&w), ".", (int)(flags | O_CLOEXEC), (mode_t)mode);
                ret = ret < 0 ? -errno : ret;
                goto out;
            }
            p = after;
            continue;
        }
        if (strcmp(name, ".") == 0) {
            if (last) {
                ret = openat(walk_cur(&w), ".", (int)(flags | O_CLOEXEC), (mode_t)mode);
                ret = ret < 0 ? -errno : ret;
                goto out;
            }
            p = after;
            continue;
        }

        int fd;
        struct stat st;
        if (!last || trailing_slash) {
            /* Intermediate component: must be a directory or a symlink. */
            fd = openat(walk_cur(&w), name, O_PATH | O_NOFOLLOW | O_CLOEXEC);
            if (fd < 0) {
                ret = -errno;
                goto out;
            }
        } else {
            /* Final component: open it for real, never through a symlink. */
            fd = openat(walk_cur(&w), name, (int)(flags | O_NOFOLLOW | O_CLOEXEC), (mode_t)mode);
            if (fd < 0) {
                int err = errno;
                /* ELOOP (or ENOTDIR with O_DIRECTORY) under our O_NOFOLLOW may
                 * mean the name is a symlink the caller wants followed. */
                if ((err != ELOOP && err != ENOTDIR) || (flags & O_NOFOLLOW)) {
                    ret = -err;
                    goto out;
                }
                fd = openat(walk_cur(&w), name, O_PATH | O_NOFOLLOW | O_CLOEXEC);
                if (fd < 0) {
                    ret = -errno;
                    goto out;
                }
                if (fstat(fd, &st) < 0 || !S_ISLNK(st.st_mode)) {
                    close(fd);
                    ret = -err;         /* not a symlink: the first error stands */
                    goto out;
                }
            }
        }
        if (fstat(fd, &st) < 0) {
            ret = -errno;
            close(fd);
            goto out;
        }
        if (S_ISLNK(st.st_mode) && !(last && !trailing_slash && (flags & O_NOFOLLOW))) {
            /* Follow the symlink: splice its target in front of the rest. */
            struct statfs sfs;
            int st_dev_fs_is_proc = fstatfs(fd, &sfs) == 0 && sfs.f_type == SFS_PROC_SUPER_MAGIC;
            ssize_t n = readlinkat(fd, "", target, sizeof target - 1);
            close(fd);
            if (resolve & RESOLVE_NO_SYMLINKS) {
                ret = -ELOOP;
                goto out;
            }
            if (++hops > SFS_MAX_SYMLINK_HOPS) {
                ret = -ELOOP;
                goto out;
            }
            if (n < 0) {
                ret = -errno;
                goto out;
            }
            target[n] = '\0';
            if (is_proc_magic(st_dev_fs_is_proc, target)) {
                ret = -ELOOP;           /* RESOLVE_NO_MAGICLINKS */
                goto out;
            }
            if (n == 0) {
                ret = -ENOENT;
                goto out;
            }
            if (target[0] == '/') {
                ret = -EXDEV;           /* absolute target: an escape */
                goto out;
            }
            char *nb = path_splice(target, (size_t)n, trailing_slash ? "." : after);
            if (!nb) {
                ret = -ENOMEM;
                goto out;
            }
            free(buf);
            buf = nb;
            p = buf;
            continue;
        }
        if ((resolve & RESOLVE_NO_XDEV) && st.st_dev != rootst.st_dev) {
            close(fd);
            ret = -EXDEV;
            goto out;
        }
        if (last && !trailing_slash) {
            ret = fd;                   /* done: fd is the opened final object */
            goto out;
        }
        if (!S_ISDIR(st.st_mode)) {
            close(fd);
            ret = -ENOTDIR;
            goto out;
        }
        if ((ret = walk_push(&w, fd)) < 0) {
            close(fd);
            goto out;
        }
        if (trailing_slash) {
            ret = openat(walk_cur(&w), ".", (int)(flags | O_CLOEXEC), (mode_t)mode);
            ret = ret < 0 ? -errno : ret;
            goto out;
        }
        p = after;
    }
out:
    walk_free(&w);
    free(buf);
    return ret;
}

/* ------------------------------------------------------------------ */
/* Calls the os module cannot make with dir_fd                         */
/* ------------------------------------------------------------------ */

int sfs_renameat2(int olddirfd, const char *oldpath, int newdirfd, const char *newpath, unsigned int flags)
{
    if (syscall(SYS_renameat2, olddirfd, oldpath, newdirfd, newpath, flags) < 0)
        return -errno;
    return 0;
}

/*
 * Copy at most max_bytes from in_fd to out_fd (both at their current
 * offsets).  Returns the byte count, or -EFBIG when the source holds more
 * than max_bytes (nothing past max_bytes is written), or -errno.
 * copy_file_range first; read/write when the kernel or filesystem refuses.
 */
int64_t sfs_copy(int in_fd, int out_fd, int64_t max_bytes)
{
    int64_t done = 0;
    int use_rw = 0;
    char buf[SFS_COPY_BUF];

    while (done < max_bytes) {
        size_t want = (size_t)((max_bytes - done) < (1 << 30) ? (max_bytes - done) : (1 << 30));
        ssize_t n;
        if (!use_rw) {
            n = copy_file_range(in_fd, NULL, out_fd, NULL, want, 0);
            if (n < 0) {
                if (errno == EINTR)
                    continue;
                if (errno == EXDEV || errno == EINVAL || errno == ENOSYS ||
                    errno == EOPNOTSUPP || errno == EBADF || errno == EPERM) {
                    use_rw = 1;
                    continue;
                }
                return -errno;
            }
            if (n == 0)
                return done;
            done += n;
            continue;
        }
        if (want > sizeof buf)
            want = sizeof buf;
        n = read(in_fd, buf, want);
        if (n < 0) {
            if (errno == EINTR)
                continue;
            return -errno;
        }
        if (n == 0)
            return done;
        for (ssize_t off = 0; off < n;) {
            ssize_t m = write(out_fd, buf + off, (size_t)(n - off));
            if (m < 0) {
                if (errno == EINTR)
                    continue;
                return -errno;
            }
            off += m;
        }
        done += n;
    }
    /* At the bound: is there more?  One byte probe, never written. */
    for (;;) {
        char probe;
        ssize_t n = read(in_fd, &probe, 1);
        if (n < 0 && errno == EINTR)
            continue;
        if (n < 0)
            return -errno;
        return n == 0 ? done : -EFBIG;
    }
}

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
