/*
 * sandbox-fs native: the batched copies, file by file into a temporary name (xfer) and
 * new files from a tar source (extract).  Returns -errno on failure.
 */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/types.h>
#include <unistd.h>
#include <linux/openat2.h>

#include "sfs.h"
#include "internal.h"

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
    int r;
    if (fchmod(x->tmp_fd, (mode_t)(x->mode & 0777)) < 0)
        return xfer_fail(dst_dirfd, tmp_name, x, SFS_STAGE_META, errno);
    if ((x->flags & SFS_XFER_SET_MTIME) && (r = sfs_set_times_ns(x->tmp_fd, x->mtime_ns)) < 0)
        return xfer_fail(dst_dirfd, tmp_name, x, SFS_STAGE_META, -r);
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

/* A name that openat resolves in its directory alone: no "/", not "", "." or "..". */
static int one_component(const char *name)
{
    return name[0] != '\0' && strchr(name, '/') == NULL && strcmp(name, ".") != 0 && strcmp(name, "..") != 0;
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
 * bounded by max_bytes (sfs_copy).
 * uid, gid >= 0: the temporary file is given that owner with fchown of its
 * fd right after it is created (-1: that id is left as made).
 * Returns -errno on failure, x->stage telling which step failed; -EFBIG
 * when the source holds more than max_bytes.
 */
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
    if ((r = sfs_own_fd(x->tmp_fd, uid, gid)) < 0)
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
        int w = sfs_write_all(x->tmp_fd, buf, (size_t)got);
        if (w < 0)
            return xfer_fail(dst_dirfd, tmp_name, x, SFS_STAGE_COPY, -w);
        x->size = got;
        if (got == buflen && got != (int64_t)st.st_size)
            return SFS_XFER_MORE;
    }
    return sfs_xfer_finish(dst_dirfd, tmp_name, dst_name, x);
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

/* Write entry e's data from the caller's memory src_buf (src_len bytes): -1 with err_out set on failure. */
static int xf_from_buf(const char *src_buf, int64_t src_len, int stage_fd, int fallback, const int64_t *e,
                       const char *path, int fd, int64_t *err_out)
{
    int err;
    if (e[0] > src_len || e[1] > src_len - e[0] || e[2] >= src_len)
        return xf_fail(stage_fd, fallback, path, fd, err_out, SFS_XF_STAGE_SHORT, ENODATA);
    if ((err = sfs_write_all(fd, src_buf + e[0], (size_t)e[1])) < 0)
        return xf_fail(stage_fd, fallback, path, fd, err_out, SFS_XF_STAGE_COPY, -err);
    return 0;
}

/* Make the one new file entry e describes at path; copy_way is the batch's (see sfs_copy_range).
 * src_buf non-NULL: the data is in memory (src_len bytes), src_fd is not used. */
static int xf_one(int src_fd, const char *src_buf, int64_t src_len, int stage_fd, int fallback, const int64_t *e,
                  const char *path, int64_t *err_out, int64_t uid, int64_t gid, int *copy_way)
{
    int fd, err;
    int64_t off = e[0], copied;
    /* Offsets and sizes come from an archive header: never trust them to be sane here either. */
    if (e[0] < 0 || e[1] < 0 || e[1] > INT64_MAX - e[0] || e[2] < -1 || path[0] == '\0' || path[0] == '/')
        return xf_fail(stage_fd, fallback, path, -1, err_out, SFS_XF_STAGE_CREATE, EINVAL);
    fd = xf_open(stage_fd, fallback, path, O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC,
                 (uint64_t)(e[3] & 0777));
    if (fd < 0)
        return xf_fail(stage_fd, fallback, path, -1, err_out, SFS_XF_STAGE_CREATE, -fd);
    if ((err = sfs_own_fd(fd, uid, gid)) < 0)
        return xf_fail(stage_fd, fallback, path, fd, err_out, SFS_XF_STAGE_META, -err);
    if (src_buf != NULL) {
        if (xf_from_buf(src_buf, src_len, stage_fd, fallback, e, path, fd, err_out) < 0)
            return -1;
        goto meta;
    }
    copied = sfs_copy_range(src_fd, &off, fd, e[1], copy_way);
    if (copied < 0)
        return xf_fail(stage_fd, fallback, path, fd, err_out, SFS_XF_STAGE_COPY, (int)-copied);
    if (copied < e[1])
        return xf_fail(stage_fd, fallback, path, fd, err_out, SFS_XF_STAGE_SHORT, ENODATA);
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
meta:
    if ((e[5] & SFS_XF_CHMOD) && fchmod(fd, (mode_t)(e[3] & 0777)) < 0)
        return xf_fail(stage_fd, fallback, path, fd, err_out, SFS_XF_STAGE_META, errno);
    if ((e[5] & SFS_XF_MTIME) && (err = sfs_set_times_ns(fd, e[4])) < 0)
        return xf_fail(stage_fd, fallback, path, fd, err_out, SFS_XF_STAGE_META, -err);
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
 * src_buf non-NULL: the data is the caller's memory (src_len bytes; src_off
 * indexes it, an entry past its end is SFS_XF_STAGE_SHORT, probe_off must be
 * below src_len), written with write(2); src_fd is then not used.
 * One call per batch, so the caller's thread
 * drops the GIL once for the whole batch.
 */
int sfs_extract_files(int src_fd, const char *src_buf, int64_t src_len, int stage_fd, int fallback,
                      const int64_t *nums, const char *names, int64_t names_len, int n, int64_t *err_out,
                      int64_t uid, int64_t gid)
{
    const char *p = names, *end = names + (names_len > 0 ? names_len : 0);
    int copy_way = SFS_COPY_FILE_RANGE;
    err_out[0] = err_out[1] = 0;
    for (int i = 0; i < n; i++) {
        const char *nul = memchr(p, '\0', (size_t)(end - p));
        if (nul == NULL) {
            err_out[0] = EINVAL;
            err_out[1] = SFS_XF_STAGE_CREATE;
            return i;
        }
        if (xf_one(src_fd, src_buf, src_len, stage_fd, fallback, nums + (int64_t)i * SFS_XF_FIELDS, p, err_out,
                   uid, gid, &copy_way) < 0)
            return i;
        p = nul + 1;
    }
    return n;
}
