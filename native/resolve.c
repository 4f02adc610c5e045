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
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/sendfile.h>
#include <sys/stat.h>
#include <time.h>
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
int sfs_open_file(int dirfd, const char *path, uint64_t flags, uint64_t mode, uint64_t resolve,
                  int fallback, int allow_special)
{
    int is_path = (flags & O_PATH) != 0;
    uint64_t f = is_path ? flags : (flags | O_NONBLOCK);
    int fd = fallback ? sfs_open_fallback(dirfd, path, f, mode, resolve)
                      : sfs_openat2(dirfd, path, f, mode, resolve);
    if (fd < 0 || is_path)
        return fd;
    struct stat st;
    if (fstat(fd, &st) < 0) {
        int e = -errno;
        close(fd);
        return e;
    }
    if (!allow_special && !S_ISREG(st.st_mode) && !S_ISDIR(st.st_mode)) {
        close(fd);
        return -ENXIO;                      /* a FIFO, socket or device */
    }
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
/* One file: source name -> temporary name -> rename over destination  */
/*                                                                    */
/* Both names are single components relative to directory fds that    */
/* the caller opened beneath its roots; nothing here resolves a path.  */
/* The source is opened O_NOFOLLOW|O_NONBLOCK (a symlink is refused, a */
/* FIFO never blocks) and must be a regular file with the expected     */
/* identity before a byte is read; the temporary name is created       */
/* O_EXCL|O_NOFOLLOW (never an existing file, never through a link);   */
/* the rename replaces a symlink at the destination, never follows it. */
/* On failure every fd is closed and the temporary name removed.       */
/* ------------------------------------------------------------------ */

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

/* Set atime and mtime of fd to ns nanoseconds since the epoch.  0 or -1 with errno. */
static int set_times_ns(int fd, int64_t ns)
{
    struct timespec ts[2];
    ns_to_times(ns, ts);
    return futimens(fd, ts);
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
static int own_fd(int fd, int64_t uid, int64_t gid)
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

static void xfer_close(struct sfs_xfer *x)
{
    if (x->src_fd >= 0)
        close(x->src_fd);
    if (x->tmp_fd >= 0)
        close(x->tmp_fd);
    x->src_fd = x->tmp_fd = -1;
}

static int xfer_fail(int dst_dirfd, const char *tmp_name, struct sfs_xfer *x, int stage, int err)
{
    int had_tmp = x->tmp_fd >= 0;
    xfer_close(x);
    if (had_tmp)
        unlinkat(dst_dirfd, tmp_name, 0);
    x->stage = stage;
    return -err;
}

void sfs_xfer_abort(int dst_dirfd, const char *tmp_name, struct sfs_xfer *x)
{
    xfer_fail(dst_dirfd, tmp_name, x, x->stage, 0);
}

int sfs_xfer_finish(int dst_dirfd, const char *tmp_name, const char *dst_name, struct sfs_xfer *x)
{
    if (fchmod(x->tmp_fd, (mode_t)(x->mode & 0777)) < 0)
        return xfer_fail(dst_dirfd, tmp_name, x, SFS_STAGE_META, errno);
    if ((x->flags & SFS_XFER_SET_MTIME) && set_times_ns(x->tmp_fd, x->mtime_ns) < 0)
        return xfer_fail(dst_dirfd, tmp_name, x, SFS_STAGE_META, errno);
    if ((x->flags & SFS_XFER_FSYNC) && fsync(x->tmp_fd) < 0)
        return xfer_fail(dst_dirfd, tmp_name, x, SFS_STAGE_META, errno);
    int tfd = x->tmp_fd;
    x->tmp_fd = -1;
    if (close(tfd) < 0 && errno != EINTR) {
        int e = errno;
        xfer_close(x);
        unlinkat(dst_dirfd, tmp_name, 0);
        x->stage = SFS_STAGE_META;
        return -e;
    }
    xfer_close(x);
    if (renameat(dst_dirfd, tmp_name, dst_dirfd, dst_name) < 0) {
        int e = errno;
        unlinkat(dst_dirfd, tmp_name, 0);
        x->stage = SFS_STAGE_RENAME;
        return -e;
    }
    return 0;
}

static int write_all(int fd, const char *buf, size_t len)
{
    while (len > 0) {
        ssize_t m = write(fd, buf, len);
        if (m < 0) {
            if (errno == EINTR)
                continue;
            return -errno;
        }
        buf += m;
        len -= (size_t)m;
    }
    return 0;
}

/*
 * Copy source name -> temporary name, then (unless SFS_XFER_MORE) set the
 * mode and times and rename the temporary name over dst_name.
 *
 * With buf: the data is read into buf[0..buflen) and written from there,
 * so the caller can hash exactly the bytes written.  Returns 0 when the
 * whole file fit (x->size bytes in buf, the file is in place), or
 * SFS_XFER_MORE when buf filled up: buflen bytes are written, x->src_fd and
 * x->tmp_fd are left open for the caller to continue, then it calls
 * sfs_xfer_finish (or sfs_xfer_abort).  Without buf (NULL): fd-to-fd copy
 * bounded by max_bytes (copy_file_range, read/write fallback).
 * uid, gid >= 0: the temporary file is given that owner with fchown of its
 * fd right after it is created (-1: that id is left as made).
 * Returns -errno on failure, x->stage telling which step failed; -EFBIG
 * when the source holds more than max_bytes.
 */
/* A name that openat resolves in its directory alone: no "/", not "", "." or "..". */
static int one_component(const char *name)
{
    return name[0] != '\0' && strchr(name, '/') == NULL && strcmp(name, ".") != 0 && strcmp(name, "..") != 0;
}

int sfs_xfer_file(int src_dirfd, const char *src_name, int dst_dirfd, const char *tmp_name,
                  const char *dst_name, struct sfs_xfer *x, char *buf, int64_t buflen, int64_t uid, int64_t gid)
{
    int r;
    struct stat st;
    x->size = 0;
    x->stage = SFS_STAGE_NONE;
    x->src_fd = x->tmp_fd = -1;

    if (!one_component(src_name)) {
        x->stage = SFS_STAGE_SRC_OPEN;
        return -EINVAL;
    }
    if (!one_component(tmp_name) || !one_component(dst_name)) {
        x->stage = SFS_STAGE_RENAME;
        return -EINVAL;
    }

    do {
        x->src_fd = openat(src_dirfd, src_name, O_RDONLY | O_NOFOLLOW | O_NONBLOCK | O_NOCTTY | O_CLOEXEC);
    } while (x->src_fd < 0 && errno == EINTR);
    if (x->src_fd < 0)
        return xfer_fail(dst_dirfd, tmp_name, x, SFS_STAGE_SRC_OPEN, errno);
    if (fstat(x->src_fd, &st) < 0)
        return xfer_fail(dst_dirfd, tmp_name, x, SFS_STAGE_SRC_OPEN, errno);
    if (!S_ISREG(st.st_mode))
        return xfer_fail(dst_dirfd, tmp_name, x, SFS_STAGE_SRC_CHANGED, EINVAL);
    if ((x->flags & SFS_XFER_CHECK_IDENT) && ((uint64_t)st.st_dev != x->dev || (uint64_t)st.st_ino != x->ino))
        return xfer_fail(dst_dirfd, tmp_name, x, SFS_STAGE_SRC_CHANGED, ESTALE);
    if ((int64_t)st.st_size > x->max_bytes)
        return xfer_fail(dst_dirfd, tmp_name, x, SFS_STAGE_COPY, EFBIG);
    do {
        x->tmp_fd = openat(dst_dirfd, tmp_name, O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0600);
    } while (x->tmp_fd < 0 && errno == EINTR);
    if (x->tmp_fd < 0)
        return xfer_fail(dst_dirfd, tmp_name, x, SFS_STAGE_TMP_CREATE, errno);
    if ((r = own_fd(x->tmp_fd, uid, gid)) < 0)
        return xfer_fail(dst_dirfd, tmp_name, x, SFS_STAGE_META, -r);

    if (buf == NULL) {
        int64_t n = sfs_copy(x->src_fd, x->tmp_fd, x->max_bytes);
        if (n < 0)
            return xfer_fail(dst_dirfd, tmp_name, x, SFS_STAGE_COPY, (int)-n);
        x->size = n;
    } else {
        int64_t got = 0;
        while (got < buflen) {
            ssize_t n = read(x->src_fd, buf + got, (size_t)(buflen - got));
            if (n < 0) {
                if (errno == EINTR)
                    continue;
                return xfer_fail(dst_dirfd, tmp_name, x, SFS_STAGE_COPY, errno);
            }
            if (n == 0)
                break;
            got += n;
            /* The size fstat reported is read: stop there (no extra EOF read). */
            if (got == (int64_t)st.st_size)
                break;
        }
        if (got > x->max_bytes)
            return xfer_fail(dst_dirfd, tmp_name, x, SFS_STAGE_COPY, EFBIG);
        int w = write_all(x->tmp_fd, buf, (size_t)got);
        if (w < 0)
            return xfer_fail(dst_dirfd, tmp_name, x, SFS_STAGE_COPY, -w);
        x->size = got;
        if (got == buflen && got != (int64_t)st.st_size)
            return SFS_XFER_MORE;
    }
    return sfs_xfer_finish(dst_dirfd, tmp_name, dst_name, x);
}

/* ------------------------------------------------------------------ */
/* Archive extraction: a batch of new files from an uncompressed tar   */
/*                                                                    */
/* Each entry names a NEW file by its path relative to the caller's   */
/* staging directory fd; the path is resolved beneath that fd at the  */
/* moment the file is created (openat2 RESOLVE_BENEATH|                */
/* RESOLVE_NO_SYMLINKS|RESOLVE_NO_MAGICLINKS, or the fallback walker   */
/* with the same flags), never through a directory fd kept from an    */
/* earlier moment: a directory moved out of the staging tree since     */
/* then is simply not found.  The data are the source bytes            */
/* [src_off, src_off + size) of src_fd, copied with an explicit offset */
/* (the source's file position is the caller's).  Nothing here decides */
/* what is allowed.                                                    */
/* ------------------------------------------------------------------ */

#define SFS_XF_RESOLVE (RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS | RESOLVE_NO_MAGICLINKS)

static int xf_open(int stage_fd, int fallback, const char *path, uint64_t flags, uint64_t mode)
{
    int fd;
    do {
        fd = fallback ? sfs_open_fallback(stage_fd, path, flags, mode, SFS_XF_RESOLVE)
                      : sfs_openat2(stage_fd, path, flags, mode, SFS_XF_RESOLVE);
    } while (fd == -EINTR);
    return fd;
}

/* Remove the file this call made at path (resolved beneath stage_fd again, never following a link). */
static void xf_unlink(int stage_fd, int fallback, const char *path)
{
    const char *slash = strrchr(path, '/');
    char parent[PATH_MAX];
    int pfd;
    if (slash == NULL) {
        unlinkat(stage_fd, path, 0);
        return;
    }
    if ((size_t)(slash - path) >= sizeof parent || slash == path)
        return;
    memcpy(parent, path, (size_t)(slash - path));
    parent[slash - path] = '\0';
    pfd = xf_open(stage_fd, fallback, parent, O_PATH | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC, 0);
    if (pfd < 0)
        return;
    unlinkat(pfd, slash + 1, 0);
    close(pfd);
}

static int xf_fail(int stage_fd, int fallback, const char *path, int fd, int64_t *err_out, int stage, int err)
{
    if (fd >= 0) {
        close(fd);
        xf_unlink(stage_fd, fallback, path);
    }
    err_out[0] = err;
    err_out[1] = stage;
    return -1;
}

static int xf_copy(int src_fd, int fd, int64_t off, int64_t size, int *stage)
{
    char buf[SFS_COPY_BUF];
    int use_rw = 0;
    *stage = SFS_XF_STAGE_COPY;
    while (size > 0) {
        size_t want = (size_t)(size < (1 << 30) ? size : (1 << 30));
        ssize_t n;
        if (!use_rw) {
            off_t o = (off_t)off;
            n = sendfile(fd, src_fd, &o, want);
            if (n < 0) {
                if (errno == EINTR)
                    continue;
                if (errno == EINVAL || errno == ENOSYS || errno == EOPNOTSUPP) {
                    use_rw = 1;
                    continue;
                }
                return errno;
            }
        } else {
            if (want > sizeof buf)
                want = sizeof buf;
            n = pread(src_fd, buf, want, (off_t)off);
            if (n < 0) {
                if (errno == EINTR)
                    continue;
                return errno;
            }
            if (n > 0) {
                int w = write_all(fd, buf, (size_t)n);
                if (w < 0)
                    return -w;
            }
        }
        if (n == 0) {
            *stage = SFS_XF_STAGE_SHORT;
            return ENODATA;
        }
        off += n;
        size -= n;
    }
    return 0;
}

static int xf_one(int src_fd, int stage_fd, int fallback, const int64_t *e, const char *path, int64_t *err_out,
                  int64_t uid, int64_t gid)
{
    int fd, err, stage;
    /* Offsets and sizes come from an archive header: never trust them to be sane here either. */
    if (e[0] < 0 || e[1] < 0 || e[1] > INT64_MAX - e[0] || e[2] < -1 || path[0] == '\0' || path[0] == '/')
        return xf_fail(stage_fd, fallback, path, -1, err_out, SFS_XF_STAGE_CREATE, EINVAL);
    fd = xf_open(stage_fd, fallback, path, O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC,
                 (uint64_t)(e[3] & 0777));
    if (fd < 0)
        return xf_fail(stage_fd, fallback, path, -1, err_out, SFS_XF_STAGE_CREATE, -fd);
    if ((err = own_fd(fd, uid, gid)) < 0)
        return xf_fail(stage_fd, fallback, path, fd, err_out, SFS_XF_STAGE_META, -err);
    err = xf_copy(src_fd, fd, e[0], e[1], &stage);
    if (err)
        return xf_fail(stage_fd, fallback, path, fd, err_out, stage, err);
    if (e[2] >= 0) {  /* the last byte of the block padding must exist, as tar readers check */
        char c;
        ssize_t n;
        do {
            n = pread(src_fd, &c, 1, (off_t)e[2]);
        } while (n < 0 && errno == EINTR);
        if (n <= 0)
            return xf_fail(stage_fd, fallback, path, fd, err_out, n < 0 ? SFS_XF_STAGE_COPY : SFS_XF_STAGE_SHORT,
                           n < 0 ? errno : ENODATA);
    }
    if ((e[5] & SFS_XF_CHMOD) && fchmod(fd, (mode_t)(e[3] & 0777)) < 0)
        return xf_fail(stage_fd, fallback, path, fd, err_out, SFS_XF_STAGE_META, errno);
    if ((e[5] & SFS_XF_MTIME) && set_times_ns(fd, e[4]) < 0)
        return xf_fail(stage_fd, fallback, path, fd, err_out, SFS_XF_STAGE_META, errno);
    if (close(fd) < 0 && errno != EINTR) {
        int e2 = errno;
        xf_unlink(stage_fd, fallback, path);
        return xf_fail(stage_fd, fallback, path, -1, err_out, SFS_XF_STAGE_META, e2);
    }
    return 0;
}

/*
 * Create and fill the n new files described by nums (SFS_XF_FIELDS int64s
 * each) and paths (n NUL-terminated paths relative to stage_fd, names_len
 * bytes in all), in order; fallback selects the resolver (0: openat2, 1:
 * sfs_open_fallback).  Returns n when all are done; else the index i of
 * the first failure, with err_out[0] = errno and err_out[1] =
 * SFS_XF_STAGE_*: entries before i are complete, entry i's file is removed
 * (EINVAL at SFS_XF_STAGE_CREATE: a negative offset or size, an offset +
 * size past INT64_MAX, an empty or absolute path; nothing was created),
 * later entries are untouched.  uid, gid >= 0: each new file is given that
 * owner with fchown of its fd right after it is created (-1: left as made).
 * One call per batch, so the caller's thread
 * drops the GIL once for the whole batch.
 */
int sfs_extract_files(int src_fd, int stage_fd, int fallback, const int64_t *nums, const char *names,
                      int64_t names_len, int n, int64_t *err_out, int64_t uid, int64_t gid)
{
    const char *p = names, *end = names + (names_len > 0 ? names_len : 0);
    err_out[0] = err_out[1] = 0;
    for (int i = 0; i < n; i++) {
        const char *nul = memchr(p, '\0', (size_t)(end - p));
        if (nul == NULL) {
            err_out[0] = EINVAL;
            err_out[1] = SFS_XF_STAGE_CREATE;
            return i;
        }
        if (xf_one(src_fd, stage_fd, fallback, nums + (int64_t)i * SFS_XF_FIELDS, p, err_out, uid, gid) < 0)
            return i;
        p = nul + 1;
    }
    return n;
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

/*
 * Many files from one source directory into one destination directory in one call, each
 * exactly as sfs_xfer_file copies one (same checks, temporary name, rename).  With buf, the
 * files' data are packed one after another: file i's bytes are at buf + off_i, off_i the sum
 * of xs[0..i).size, so the caller hashes them after the call.  names holds 3 * n
 * NUL-terminated strings within names_len bytes: the source name, temporary name and
 * destination name of each file.  Stops at the first file whose sfs_xfer_file does not
 * return 0 and stores that return in *ret_out: SFS_XFER_MORE (it filled the rest of buf,
 * its fds are left open in xs[i]), or -errno with xs[i].stage telling the step (-EINVAL at
 * SFS_STAGE_SRC_OPEN when names runs out).  uid, gid: the owner of each new file, as
 * for sfs_xfer_file.  Returns the number of files finished.
 */
int sfs_xfer_files(int src_dirfd, int dst_dirfd, int n, const char *names, int64_t names_len,
                   struct sfs_xfer *xs, char *buf, int64_t buflen, int *ret_out, int64_t uid, int64_t gid)
{
    const char *p = names;
    const char *end = names + names_len;
    int64_t off = 0;

    *ret_out = 0;
    for (int i = 0; i < n; i++) {
        const char *part[3];
        for (int k = 0; k < 3; k++) {
            const char *z = p < end ? memchr(p, '\0', (size_t)(end - p)) : NULL;
            if (z == NULL) {
                xs[i].size = 0;
                xs[i].src_fd = xs[i].tmp_fd = -1;
                xs[i].stage = SFS_STAGE_SRC_OPEN;
                *ret_out = -EINVAL;
                return i;
            }
            part[k] = p;
            p = z + 1;
        }
        int r = sfs_xfer_file(src_dirfd, part[0], dst_dirfd, part[1], part[2], &xs[i],
                              buf != NULL ? buf + off : NULL, buf != NULL ? buflen - off : 0, uid, gid);
        if (r != 0) {
            *ret_out = r;
            return i;
        }
        if (buf != NULL)
            off += xs[i].size;
    }
    return n;
}
