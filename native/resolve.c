/*
 * sandbox-fs native: resolution beneath a directory fd (openat2, and the
 * component-walking fallback with the same answers), and the *at and fd
 * calls the os module cannot make.  Syscalls only, no policy.
 *
 * Every function returns a non-negative result (fd, count, ABI number) or a
 * negative errno.  errno itself is never the error channel, and nothing here
 * keeps global state.  Policy (what is allowed, what an error means) lives in
 * Python (sandbox_fs/_native.py and sandbox_fs/root.py).
 */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <sys/vfs.h>
#include <sys/syscall.h>
#include <sys/types.h>
#include <unistd.h>
#include <linux/openat2.h>

#include "sfs.h"
#include "internal.h"

#define SFS_EAGAIN_RETRIES 128   /* tries while a concurrent rename makes openat2 or the walk return EAGAIN */

#ifndef SYS_openat2
#define SYS_openat2 437
#endif

/* ------------------------------------------------------------------ */
/* openat2                                                             */
/* ------------------------------------------------------------------ */

int sfs_openat2(int dirfd, const char *path, uint64_t flags, uint64_t mode, uint64_t resolve)
{
    struct open_how how;
    memset(&how, 0, sizeof how);
    if (strnlen(path, PATH_MAX) >= PATH_MAX)
        return -ENAMETOOLONG;
    how.flags = flags | O_CLOEXEC;
    /* openat2 rejects a non-zero mode unless a file may be created. */
    how.mode = ((flags & O_CREAT) || (flags & O_TMPFILE) == O_TMPFILE) ? (mode & 07777) : 0;
    how.resolve = resolve;
    for (int attempt = 0; attempt < SFS_EAGAIN_RETRIES; attempt++) {
        long fd = syscall(SYS_openat2, dirfd, path, &how, sizeof how);
        if (fd >= 0)
            return (int)fd;
        /* EAGAIN: a concurrent rename raced a ".." step; retrying is safe.
         * EINTR goes back to Python, which runs signal handlers and retries. */
        if (errno != EAGAIN)
            return -errno;
    }
    return -EAGAIN;
}

/* ------------------------------------------------------------------ */
/* Fallback resolver: one component at a time, O_PATH|O_NOFOLLOW.     */
/* Same answers as openat2(RESOLVE_BENEATH|RESOLVE_NO_MAGICLINKS).     */
/*                                                                    */
/* Only the current directory is held open.  The walk keeps the       */
/* identity (dev, ino) of every directory from the root down; ".."    */
/* opens the real parent and must find the recorded identity (else a  */
/* rename raced us: -EAGAIN, retried like openat2's rename check), and */
/* before returning, the chain from the result's directory up to the  */
/* root is checked again, so the result was beneath the root when we  */
/* returned it.                                                        */
/* ------------------------------------------------------------------ */

struct ident {
    dev_t dev;
    ino_t ino;
};

struct walk {
    struct ident *ids;  /* ids[0] is the root, ids[i] the directory at depth i */
    int depth;          /* ids[depth] is the current directory */
    int cap;
    int cur;            /* owned O_PATH fd of the current directory, -1 = rootfd */
    int rootfd;         /* not owned */
};

static int walk_cur(const struct walk *w)
{
    return w->cur >= 0 ? w->cur : w->rootfd;
}

static int same(const struct stat *st, const struct ident *id)
{
    return st->st_dev == id->dev && st->st_ino == id->ino;
}

/* Enter directory fd (owned from now on) whose stat is st. */
static int walk_descend(struct walk *w, int fd, const struct stat *st)
{
    if (w->depth + 1 >= w->cap) {
        int ncap = w->cap * 2;
        struct ident *n = realloc(w->ids, (size_t)ncap * sizeof *n);
        if (!n) {
            close(fd);
            return -ENOMEM;
        }
        w->ids = n;
        w->cap = ncap;
    }
    w->depth++;
    w->ids[w->depth].dev = st->st_dev;
    w->ids[w->depth].ino = st->st_ino;
    if (w->cur >= 0)
        close(w->cur);
    w->cur = fd;
    return 0;
}

/*
 * Open ".." of the current directory with the given flags, check it is the
 * recorded parent.  On success returns the fd (owned by the caller) and
 * pops one level (the walk's current fd becomes invalid: caller must use
 * walk_set_cur or return).
 */
static int walk_open_parent(struct walk *w, int flags, int *out_fd)
{
    struct stat st;
    if (w->depth == 0)
        return -EXDEV;                      /* would climb above the root */
    int fd = openat(walk_cur(w), "..", flags | O_CLOEXEC);
    if (fd < 0)
        return -errno;
    if (fstat(fd, &st) < 0) {
        int e = -errno;
        close(fd);
        return e;
    }
    if (!same(&st, &w->ids[w->depth - 1])) {
        close(fd);
        return -EAGAIN;                     /* a rename raced the walk */
    }
    *out_fd = fd;
    return 0;
}

static int walk_ascend(struct walk *w)
{
    int fd, ret = walk_open_parent(w, O_PATH | O_DIRECTORY, &fd);
    if (ret < 0)
        return ret;
    if (w->cur >= 0)
        close(w->cur);
    w->depth--;
    if (w->depth == 0) {
        close(fd);
        w->cur = -1;
    } else {
        w->cur = fd;
    }
    return 0;
}

/* The current directory is still below the root through the recorded chain. */
static int walk_verify(const struct walk *w)
{
    int ret = 0;
    if (w->depth == 0)
        return 0;
    int fd = dup(walk_cur(w));
    if (fd < 0)
        return -errno;
    for (int d = w->depth; d > 0; d--) {
        struct stat st;
        int up = openat(fd, "..", O_PATH | O_DIRECTORY | O_CLOEXEC);
        close(fd);
        if (up < 0)
            return -errno;
        fd = up;
        if (fstat(fd, &st) < 0) {
            ret = -errno;
            break;
        }
        if (!same(&st, &w->ids[d - 1])) {
            ret = -EAGAIN;
            break;
        }
    }
    close(fd);
    return ret;
}

static void walk_free(struct walk *w)
{
    if (w->cur >= 0)
        close(w->cur);
    free(w->ids);
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

/* A fresh buffer holding "target" + (rest ? "/" rest : ""). */
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

/* Finish: the result fd (>= 0) is returned only if the walk is still beneath. */
static int walk_finish(struct walk *w, int fd)
{
    if (fd < 0)
        return fd;
    int v = walk_verify(w);
    if (v < 0) {
        close(fd);
        return v;
    }
    return fd;
}

static int walk_once(int rootfd, const char *path, uint64_t flags, uint64_t mode, uint64_t resolve,
                     const struct stat *rootst)
{
    struct walk w;
    char *buf = NULL;
    const char *p;
    int hops = 0, ret;
    char name[NAME_MAX + 1];
    char target[PATH_MAX + 1];
    const int oflags = (int)(flags | O_CLOEXEC);

    w.cap = 64;
    w.ids = malloc((size_t)w.cap * sizeof *w.ids);
    if (!w.ids)
        return -ENOMEM;
    w.depth = 0;
    w.ids[0].dev = rootst->st_dev;
    w.ids[0].ino = rootst->st_ino;
    w.cur = -1;
    w.rootfd = rootfd;

    buf = strdup(path);
    if (!buf) {
        free(w.ids);
        return -ENOMEM;
    }
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
            /* Nothing left (a symlink spliced to "x/" or similar): the current dir. */
            if (flags & O_CREAT) {
                ret = -EISDIR;
                goto out;
            }
            ret = openat(walk_cur(&w), ".", oflags, (mode_t)mode);
            ret = walk_finish(&w, ret < 0 ? -errno : ret);
            goto out;
        }
        if (len > NAME_MAX) {
            ret = -ENAMETOOLONG;
            goto out;
        }
        memcpy(name, p, len);
        name[len] = '\0';

        if (strcmp(name, "..") == 0) {
            if (last) {
                int fd;
                if (flags & O_CREAT) {
                    /* as open(2): the parent exists and is a directory */
                    if ((ret = walk_ascend(&w)) < 0)
                        goto out;
                    ret = (flags & O_EXCL) ? -EEXIST : -EISDIR;
                    goto out;
                }
                /* Open the parent itself with the caller's flags. */
                ret = walk_open_parent(&w, oflags, &fd);
                if (ret < 0)
                    goto out;
                /* verify the grandparent chain: ascend our bookkeeping */
                ret = walk_ascend(&w);
                if (ret < 0) {
                    close(fd);
                    goto out;
                }
                ret = walk_finish(&w, fd);
                goto out;
            }
            if ((ret = walk_ascend(&w)) < 0)
                goto out;
            p = after;
            continue;
        }
        if (strcmp(name, ".") == 0) {
            if (last) {
                if (flags & O_CREAT) {
                    ret = (flags & O_EXCL) ? -EEXIST : -EISDIR;
                    goto out;
                }
                ret = openat(walk_cur(&w), ".", oflags, (mode_t)mode);
                ret = walk_finish(&w, ret < 0 ? -errno : ret);
                goto out;
            }
            p = after;
            continue;
        }

        int fd;
        struct stat st;
        if (!last) {
            /* Intermediate component: must be a directory or a symlink. */
            fd = openat(walk_cur(&w), name, O_PATH | O_NOFOLLOW | O_CLOEXEC);
            if (fd < 0) {
                ret = -errno;
                goto out;
            }
        } else {
            if (trailing_slash && (flags & O_CREAT)) {
                ret = -EISDIR;              /* as open(2): O_CREAT on "name/" */
                goto out;
            }
            /* Final component: open it for real, never through a symlink. */
            int f = oflags | O_NOFOLLOW | (trailing_slash ? O_DIRECTORY : 0);
            fd = openat(walk_cur(&w), name, f, (mode_t)mode);
            if (fd < 0) {
                int err = errno;
                /* ELOOP (or ENOTDIR with O_DIRECTORY) under our O_NOFOLLOW may
                 * mean the name is a symlink the caller wants followed. */
                int may_follow = !(flags & O_NOFOLLOW) || trailing_slash;
                if ((err != ELOOP && err != ENOTDIR) || !may_follow) {
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
                    ret = -err;             /* not a symlink: the first error stands */
                    goto out;
                }
            }
        }
        if (fstat(fd, &st) < 0) {
            ret = -errno;
            close(fd);
            goto out;
        }
        int follow = S_ISLNK(st.st_mode) &&
                     (!last || trailing_slash || !(flags & O_NOFOLLOW));
        if (follow) {
            /* Follow the symlink: splice its target in front of the rest. */
            struct statfs sfs;
            int on_proc = fstatfs(fd, &sfs) == 0 && sfs.f_type == SFS_PROC_SUPER_MAGIC;
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
            if (is_proc_magic(on_proc, target)) {
                ret = -ELOOP;               /* RESOLVE_NO_MAGICLINKS */
                goto out;
            }
            if (n == 0) {
                ret = -ENOENT;
                goto out;
            }
            if (target[0] == '/') {
                ret = -EXDEV;               /* absolute target: an escape */
                goto out;
            }
            /* A trailing slash carries over to the link's target. */
            char *nb = path_splice(target, (size_t)n, trailing_slash ? "" : after);
            if (!nb) {
                ret = -ENOMEM;
                goto out;
            }
            if (trailing_slash)
                strcat(nb, "/");
            free(buf);
            buf = nb;
            p = buf;
            continue;
        }
        if ((resolve & RESOLVE_NO_XDEV) && st.st_dev != w.ids[0].dev) {
            close(fd);
            ret = -EXDEV;
            goto out;
        }
        if (last) {
            ret = walk_finish(&w, fd);      /* fd is the opened final object */
            goto out;
        }
        if (!S_ISDIR(st.st_mode)) {
            close(fd);
            ret = -ENOTDIR;
            goto out;
        }
        if ((ret = walk_descend(&w, fd, &st)) < 0)
            goto out;
        p = after;
    }
out:
    walk_free(&w);
    free(buf);
    return ret;
}

/* The kernel's VALID_OPEN_FLAGS (include/linux/fcntl.h). */
#define SFS_VALID_OPEN_FLAGS (O_RDONLY | O_WRONLY | O_RDWR | O_CREAT | O_EXCL | O_NOCTTY | O_TRUNC | \
    O_APPEND | O_NDELAY | O_NONBLOCK | O_SYNC | O_DSYNC | O_ASYNC | O_DIRECT | O_LARGEFILE | \
    O_DIRECTORY | O_NOFOLLOW | O_NOATIME | O_CLOEXEC | O_PATH | __O_TMPFILE)

int sfs_open_fallback(int rootfd, const char *path, uint64_t flags, uint64_t mode, uint64_t resolve)
{
    struct stat rootst;

    if (path[0] == '\0')
        return -ENOENT;
    if (strlen(path) >= PATH_MAX)
        return -ENAMETOOLONG;
    if (flags & ~(uint64_t)SFS_VALID_OPEN_FLAGS)
        return -EINVAL;                     /* as openat2: unknown flag bits */
    if ((flags & O_CREAT) && (flags & O_DIRECTORY) && (flags & O_TMPFILE) != O_TMPFILE)
        return -EINVAL;                     /* as open(2) since Linux 6.4 */
    if ((flags & O_PATH) && (flags & ~(uint64_t)(O_PATH | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC)))
        return -EINVAL;                     /* as openat2: O_PATH takes no other flags */
    if (path[0] == '/')
        return -EXDEV;                      /* RESOLVE_BENEATH: absolute is an escape */
    if (fstat(rootfd, &rootst) < 0)
        return -errno;
    for (int attempt = 0; attempt < SFS_EAGAIN_RETRIES; attempt++) {
        int ret = walk_once(rootfd, path, flags, mode, resolve, &rootst);
        if (ret != -EAGAIN)
            return ret;
    }
    return -EAGAIN;
}

/*
 * Open for reading or writing without ever blocking on a special file:
 * the open adds O_NONBLOCK (so a FIFO or a device cannot block), then
 * fstat; a FIFO, socket or device gives -ENXIO unless allow_special; on
 * an allowed special file O_NONBLOCK is dropped again unless the caller
 * asked for it (it has no effect on regular files and directories).  O_PATH
 * opens are returned as they are.  fallback selects the resolver.
 */
/* Open path beneath dirfd with O_NONBLOCK added (with the resolver fallback selects) and fstat
 * the new fd into *st; a FIFO, socket or device is refused with -ENXIO unless allow_special.
 * Returns the fd or -errno (the fd closed on every error). */
static int open_nonblock_stat(int dirfd, const char *path, uint64_t flags, uint64_t mode, uint64_t resolve,
                              int fallback, int allow_special, struct stat *st)
{
    int fd = fallback ? sfs_open_fallback(dirfd, path, flags | O_NONBLOCK, mode, resolve)
                      : sfs_openat2(dirfd, path, flags | O_NONBLOCK, mode, resolve);
    if (fd < 0)
        return fd;
    if (fstat(fd, st) < 0) {
        int e = -errno;
        close(fd);
        return e;
    }
    if (!allow_special && !S_ISREG(st->st_mode) && !S_ISDIR(st->st_mode)) {
        close(fd);
        return -ENXIO;                      /* a FIFO, socket or device */
    }
    return fd;
}

int sfs_open_file(int dirfd, const char *path, uint64_t flags, uint64_t mode, uint64_t resolve,
                  int fallback, int allow_special)
{
    if (flags & O_PATH)
        return fallback ? sfs_open_fallback(dirfd, path, flags, mode, resolve)
                        : sfs_openat2(dirfd, path, flags, mode, resolve);
    struct stat st;
    int fd = open_nonblock_stat(dirfd, path, flags, mode, resolve, fallback, allow_special, &st);
    if (fd < 0)
        return fd;
    /* open(2): O_NONBLOCK "has no effect for regular files"; restore the
     * caller's blocking mode only on special files it allowed. */
    if (!(flags & O_NONBLOCK) && !S_ISDIR(st.st_mode) && !S_ISREG(st.st_mode)) {
        /* F_SETFL changes only these status flags: restore the caller's. */
        int keep = (int)(flags & (O_APPEND | O_ASYNC | O_DIRECT | O_NOATIME));
        if (fcntl(fd, F_SETFL, keep) < 0) {
            int e = -errno;
            close(fd);
            return e;
        }
    }
    return fd;
}

/* The member fast path of persist's walk: sfs_open_file for reading
 * (O_NONBLOCK, a FIFO, socket or device refused with -ENXIO) plus what the walk asks of
 * every regular file it reads, in one call.  out[] gets the fstat of the
 * opened fd: st_mode, st_ino, st_dev, st_nlink, st_size, st_mtime (s, ns),
 * st_ctime (s, ns) (the caller checks the inode and type are the listed ones);
 * with probe != 0 and a regular file, out[9] = 0 when a read lease could be
 * taken and released at once (no open file description can write the inode),
 * else 1, after F_SETSIG SIGURG so a lease break never sends SIGIO (whose
 * default action terminates).  Returns the fd or -errno. */
int sfs_open_member(int dirfd, const char *path, uint64_t flags, uint64_t resolve, int fallback,
                    int probe, int64_t *out)
{
    if (flags & O_PATH)
        return -EINVAL;                     /* a member is read: sfs_open_file's O_PATH case never applies */
    struct stat st;
    int fd = open_nonblock_stat(dirfd, path, flags, 0, resolve, fallback, 0, &st);
    if (fd < 0)
        return fd;
    out[0] = (int64_t)st.st_mode;
    out[1] = (int64_t)st.st_ino;
    out[2] = (int64_t)st.st_dev;
    out[3] = (int64_t)st.st_nlink;
    out[4] = (int64_t)st.st_size;
    out[5] = (int64_t)st.st_mtim.tv_sec;   /* seconds and nanoseconds apart: a time in ns may not fit */
    out[6] = (int64_t)st.st_mtim.tv_nsec;
    out[7] = (int64_t)st.st_ctim.tv_sec;
    out[8] = (int64_t)st.st_ctim.tv_nsec;
    out[9] = 1;
    if (probe && S_ISREG(st.st_mode) && fcntl(fd, F_SETSIG, SIGURG) == 0 &&
            fcntl(fd, F_SETLEASE, F_RDLCK) == 0) {
        fcntl(fd, F_SETLEASE, F_UNLCK);
        out[9] = 0;
    }
    return fd;
}

/* ------------------------------------------------------------------ */
/* Calls the os module cannot make with dir_fd or an O_PATH fd, and    */
/* the times and owner of a file through its fd (extract.c uses those) */
/* ------------------------------------------------------------------ */

int sfs_renameat2(int olddirfd, const char *oldpath, int newdirfd, const char *newpath, unsigned int flags)
{
    if (syscall(SYS_renameat2, olddirfd, oldpath, newdirfd, newpath, flags) < 0)
        return -errno;
    return 0;
}

/* atime = mtime = ns nanoseconds since the epoch (negative: before it). */
static void ns_to_times(int64_t ns, struct timespec ts[2])
{
    ts[0].tv_sec = (time_t)(ns / 1000000000);
    ts[0].tv_nsec = (long)(ns % 1000000000);
    if (ts[0].tv_nsec < 0) {
        ts[0].tv_sec -= 1;
        ts[0].tv_nsec += 1000000000;
    }
    ts[1] = ts[0];
}

/* Set atime and mtime of fd to ns nanoseconds since the epoch.  0 or -errno. */
int sfs_set_times_ns(int fd, int64_t ns)
{
    struct timespec ts[2];
    ns_to_times(ns, ts);
    if (futimens(fd, ts) < 0)
        return -errno;
    return 0;
}

/* The same for the inode an O_PATH fd refers to (a symlink's own times through an fd that
   was checked to be it, never by name): utimensat(fd, "", AT_EMPTY_PATH).  0 or -errno. */
int sfs_set_times_fd(int fd, int64_t ns)
{
    struct timespec ts[2];
    ns_to_times(ns, ts);
    if (utimensat(fd, "", ts, AT_EMPTY_PATH) < 0)
        return -errno;
    return 0;
}

/* fchown(fd, uid, gid) unless both are -1 (leave as made); an id of -1 leaves that one. */
int sfs_own_fd(int fd, int64_t uid, int64_t gid)
{
    if (uid < 0 && gid < 0)
        return 0;
    if (uid > (int64_t)UINT32_MAX - 1 || gid > (int64_t)UINT32_MAX - 1)
        return -EINVAL;
    if (fchown(fd, uid < 0 ? (uid_t)-1 : (uid_t)uid, gid < 0 ? (gid_t)-1 : (gid_t)gid) < 0)
        return -errno;
    return 0;
}

/* The owner of the inode fd refers to, an O_PATH fd of a symlink included (never a lookup by name). */
int sfs_fchown_fd(int fd, int64_t uid, int64_t gid)
{
    if (uid > (int64_t)UINT32_MAX - 1 || gid > (int64_t)UINT32_MAX - 1)
        return -EINVAL;
    if (fchownat(fd, "", uid < 0 ? (uid_t)-1 : (uid_t)uid, gid < 0 ? (gid_t)-1 : (gid_t)gid,
                 AT_EMPTY_PATH | AT_SYMLINK_NOFOLLOW) < 0)
        return -errno;
    return 0;
}

/* ------------------------------------------------------------------ */
/* Handle calls: one held fd (often O_PATH), or a held directory fd    */
/* plus ONE name component that Python has checked (no "/", not "." or */
/* "..", not empty).  Nothing here builds a path or follows a leaf.    */
/* ------------------------------------------------------------------ */

#ifndef SYS_fchmodat2
#define SYS_fchmodat2 452
#endif

/* chmod of the inode fd refers to, an O_PATH fd included: fchmodat2(fd, "", mode, AT_EMPTY_PATH)
   (Linux >= 6.6; no /proc).  A symlink gives -EOPNOTSUPP (Linux never changes a link's mode). */
int sfs_fchmod_empty(int fd, uint32_t mode)
{
    if (syscall(SYS_fchmodat2, fd, "", (unsigned int)(mode & 07777), AT_EMPTY_PATH) < 0)
        return -errno;
    return 0;
}

static void ns_to_timespec(int64_t ns, struct timespec *ts)
{
    ts->tv_sec = (time_t)(ns / 1000000000);
    ts->tv_nsec = (long)(ns % 1000000000);
    if (ts->tv_nsec < 0) {
        ts->tv_sec -= 1;
        ts->tv_nsec += 1000000000;
    }
}

/* atime and mtime (ns since the epoch) of the inode fd refers to, a symlink's O_PATH fd included:
   utimensat(fd, "", AT_EMPTY_PATH).  how: SFS_TIME_* bits (OMIT: leave it; NOW: the current time). */
int sfs_utimens_empty(int fd, int64_t atime_ns, int64_t mtime_ns, int how)
{
    struct timespec ts[2];
    ns_to_timespec(atime_ns, &ts[0]);
    ns_to_timespec(mtime_ns, &ts[1]);
    if (how & SFS_TIME_ATIME_OMIT)
        ts[0].tv_nsec = UTIME_OMIT;
    else if (how & SFS_TIME_ATIME_NOW)
        ts[0].tv_nsec = UTIME_NOW;
    if (how & SFS_TIME_MTIME_OMIT)
        ts[1].tv_nsec = UTIME_OMIT;
    else if (how & SFS_TIME_MTIME_NOW)
        ts[1].tv_nsec = UTIME_NOW;
    if (utimensat(fd, "", ts, AT_EMPTY_PATH) < 0)
        return -errno;
    return 0;
}

/* A new name for the inode fd refers to: linkat(fd, "", newdirfd, name, AT_EMPTY_PATH)
   (needs CAP_DAC_READ_SEARCH; a directory gives -EPERM, an unlinked inode -ENOENT). */
int sfs_link_empty(int fd, int newdirfd, const char *name)
{
    if (linkat(fd, "", newdirfd, name, AT_EMPTY_PATH) < 0)
        return -errno;
    return 0;
}

/* Remove name of dirfd only while it is still the inode (dev, ino): undoing our own create. */
static void unlink_if_same(int dirfd, const char *name, dev_t dev, ino_t ino, int dir)
{
    struct stat st;
    if (fstatat(dirfd, name, &st, AT_SYMLINK_NOFOLLOW) == 0 && st.st_dev == dev && st.st_ino == ino)
        (void)unlinkat(dirfd, name, dir ? AT_REMOVEDIR : 0);
}

static int chown_ids(int fd, int64_t uid, int64_t gid)
{
    if (uid > (int64_t)UINT32_MAX - 1 || gid > (int64_t)UINT32_MAX - 1)
        return -EINVAL;
    if (fchownat(fd, "", uid < 0 ? (uid_t)-1 : (uid_t)uid, gid < 0 ? (gid_t)-1 : (gid_t)gid,
                 AT_EMPTY_PATH | AT_SYMLINK_NOFOLLOW) < 0)
        return -errno;
    return 0;
}

/* Give what this call made exactly the mode asked for when the process umask removed some of its
   0777 bits: mode & 07777, plus the S_ISGID a directory inherits from a set-group-ID parent.  st is
   the fstat of fd from before its owner was set.  0 or -errno. */
static int exact_mode(int fd, const struct stat *st, mode_t mode)
{
    if ((st->st_mode & 0777) == (mode & 0777))
        return 0;
    mode_t want = (mode & 07777) | (S_ISDIR(st->st_mode) ? (st->st_mode & S_ISGID) : 0);
    if (syscall(SYS_fchmodat2, fd, "", (unsigned int)want, AT_EMPTY_PATH) < 0)
        return -errno;
    return 0;
}

/* openat(dirfd, name) that says whether it created the file (made): O_CREAT without O_EXCL is
   tried as O_EXCL (made: ours), then without O_CREAT (existing: left alone), while a racer keeps
   removing and re-making the name (bounded). */
static int open_made(int dirfd, const char *name, int flags, mode_t mode, int *made)
{
    *made = 0;
    if (!(flags & O_CREAT)) {
        int fd = openat(dirfd, name, flags, mode);
        return fd < 0 ? -errno : fd;
    }
    if (flags & O_EXCL) {
        int fd = openat(dirfd, name, flags, mode);
        *made = fd >= 0;
        return fd < 0 ? -errno : fd;
    }
    for (int attempt = 0; attempt < 100; attempt++) {
        int fd = openat(dirfd, name, flags | O_EXCL, mode);
        if (fd >= 0) {
            *made = 1;
            return fd;
        }
        if (errno != EEXIST)
            return -errno;
        fd = openat(dirfd, name, flags & ~(O_CREAT | O_EXCL), mode);
        if (fd >= 0)
            return fd;
        if (errno != ENOENT)
            return -errno;
    }
    return -EAGAIN;
}

/*
 * Open name of dirfd for I/O, never following it (O_NOFOLLOW, O_NOCTTY, O_CLOEXEC added) and never
 * blocking on a special file (opened O_NONBLOCK, then a FIFO, socket or device is refused with
 * -ENXIO unless allow_special).  expect_ino >= 0: the opened inode must be (expect_dev, expect_ino),
 * else -ESTALE (O_TRUNC is then applied only after that check; O_CREAT is refused, -EINVAL).
 * A file this call created (O_CREAT) is given, through its fd, the owner uid/gid when either is
 * >= 0, and exactly the mode asked (the process umask does not apply); on failure it is removed
 * again while the name is still it.  Returns the fd or -errno.
 */
int sfs_open_name(int dirfd, const char *name, uint64_t flags, uint64_t mode, int allow_special,
                  int64_t expect_dev, int64_t expect_ino, int64_t uid, int64_t gid)
{
    int expect = expect_ino >= 0;
    int trunc_late = expect && (flags & O_TRUNC);
    int f = (int)flags | O_NOFOLLOW | O_NOCTTY | O_CLOEXEC | O_NONBLOCK;
    int made, err;
    struct stat st;

    if (expect && (flags & O_CREAT))
        return -EINVAL;
    if (trunc_late)
        f &= ~O_TRUNC;
    int fd = open_made(dirfd, name, f, (mode_t)(mode & 07777), &made);
    if (fd < 0)
        return fd;
    if (fstat(fd, &st) < 0)
        goto fail_errno;
    if (expect && ((int64_t)st.st_dev != expect_dev || (int64_t)st.st_ino != expect_ino)) {
        err = -ESTALE;
        goto fail;
    }
    if ((flags & O_CREAT) && !made && S_ISDIR(st.st_mode)) {
        err = -EISDIR;                      /* as open(2) of O_CREAT on a directory */
        goto fail;
    }
    if (!allow_special && !S_ISREG(st.st_mode) && !S_ISDIR(st.st_mode)) {
        err = -ENXIO;
        goto fail;
    }
    if (made && ((err = chown_ids(fd, uid, gid)) < 0 || (err = exact_mode(fd, &st, (mode_t)mode)) < 0)) {
        unlink_if_same(dirfd, name, st.st_dev, st.st_ino, 0);
        goto fail;
    }
    if (trunc_late && S_ISREG(st.st_mode) && ftruncate(fd, 0) < 0)
        goto fail_errno;
    if (!(flags & O_NONBLOCK) && !S_ISDIR(st.st_mode) && !S_ISREG(st.st_mode)) {
        int keep = (int)(flags & (O_APPEND | O_ASYNC | O_DIRECT | O_NOATIME));
        if (fcntl(fd, F_SETFL, keep) < 0)
            goto fail_errno;
    }
    return fd;
fail_errno:
    err = -errno;
fail:
    close(fd);
    return err;
}

/*
 * Make name in dirfd (SFS_MAKE_DIR: mkdirat; SFS_MAKE_NODE: mknodat(mode, rdev); SFS_MAKE_SYMLINK:
 * symlinkat(target)), then return an O_PATH|O_NOFOLLOW fd on it, checked to be what was made: the
 * same file type, one link (two for a directory), owned by this process's euid.  A name that
 * another process swapped meanwhile gives -ESTALE and is left alone.  uid or gid >= 0: the new
 * entry is given that owner through the fd, then exactly the mode asked (the process umask does
 * not apply; a symlink has no mode); on failure it is removed again.  Returns the fd or -errno.
 */
int sfs_make_name(int dirfd, const char *name, int kind, uint32_t mode, uint64_t rdev, const char *target,
                  int64_t uid, int64_t gid)
{
    mode_t type;
    int r, err;
    struct stat st;

    if (kind == SFS_MAKE_DIR) {
        r = mkdirat(dirfd, name, (mode_t)(mode & 07777));
        type = S_IFDIR;
    } else if (kind == SFS_MAKE_NODE) {
        type = (mode & S_IFMT) ? (mode & S_IFMT) : S_IFREG;
        if (type == S_IFDIR || type == S_IFLNK)
            return -EINVAL;
        r = mknodat(dirfd, name, (mode_t)mode, (dev_t)rdev);
    } else if (kind == SFS_MAKE_SYMLINK) {
        r = symlinkat(target, dirfd, name);
        type = S_IFLNK;
    } else {
        return -EINVAL;
    }
    if (r < 0)
        return -errno;
    int fd = openat(dirfd, name, O_PATH | O_NOFOLLOW | O_CLOEXEC);
    if (fd < 0)
        return errno == ENOENT ? -ESTALE : -errno;
    if (fstat(fd, &st) < 0) {
        err = -errno;
        close(fd);
        return err;
    }
    if ((st.st_mode & S_IFMT) != type || st.st_nlink != (type == S_IFDIR ? 2u : 1u) || st.st_uid != geteuid()) {
        close(fd);
        return -ESTALE;                     /* not what this call made: left alone */
    }
    if (((uid >= 0 || gid >= 0) && (err = chown_ids(fd, uid, gid)) < 0) ||
        (type != S_IFLNK && (err = exact_mode(fd, &st, (mode_t)mode)) < 0)) {
        unlink_if_same(dirfd, name, st.st_dev, st.st_ino, type == S_IFDIR);
        close(fd);
        return err;
    }
    return fd;
}

/* getdents64(fd, buf, len): bytes of struct linux_dirent64 records read, 0 at the end, or -errno. */
int64_t sfs_getdents(int fd, char *buf, uint64_t len)
{
    long n = syscall(SYS_getdents64, fd, buf, (size_t)len);
    return n < 0 ? -errno : (int64_t)n;
}
