/*
 * sandbox-fs native: the one fd-to-fd copy loop (sfs_copy_range, used by the
 * bounded copy below and by the batches in extract.c) and sfs_copy.  Returns
 * a byte count or -errno.
 */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif
#include <errno.h>
#include <stdint.h>
#include <sys/sendfile.h>
#include <sys/types.h>
#include <unistd.h>

#include "sfs.h"
#include "internal.h"

#define SFS_COPY_BUF 65536          /* bytes one read/write step moves */
#define SFS_COPY_CHUNK (1 << 30)    /* bytes asked of the kernel per copy_file_range or sendfile */

/* The errors by which the kernel or a filesystem refuses a way of copying these two fds
 * (not a failure of the copy itself): the next way is tried. */
static int way_refused(int err)
{
    return err == EXDEV || err == EINVAL || err == ENOSYS || err == EOPNOTSUPP || err == EBADF || err == EPERM;
}

/*
 * Copy up to len bytes from in_fd to out_fd, written at out_fd's file position.  The source
 * is read at *in_off, which advances by the bytes copied (in_fd's own position is left
 * alone), or with in_off NULL at in_fd's file position.  *way (enum sfs_copy_way) is where
 * to start: copy_file_range, then sendfile, then read/write, stepping down when the kernel
 * refuses one; a caller copying many files keeps it across them.  Returns the byte count,
 * less than len only when the source ended, or -errno.
 */
int64_t sfs_copy_range(int in_fd, int64_t *in_off, int out_fd, int64_t len, int *way)
{
    char buf[SFS_COPY_BUF];
    int64_t done = 0;

    while (done < len) {
        size_t want = (size_t)(len - done < SFS_COPY_CHUNK ? len - done : SFS_COPY_CHUNK);
        ssize_t n;
        if (*way == SFS_COPY_FILE_RANGE) {
            loff_t off = in_off != NULL ? (loff_t)*in_off : 0;
            n = copy_file_range(in_fd, in_off != NULL ? &off : NULL, out_fd, NULL, want, 0);
        } else if (*way == SFS_COPY_SENDFILE) {
            off_t off = in_off != NULL ? (off_t)*in_off : 0;
            n = sendfile(out_fd, in_fd, in_off != NULL ? &off : NULL, want);
        } else {
            if (want > sizeof buf)
                want = sizeof buf;
            n = in_off != NULL ? pread(in_fd, buf, want, (off_t)*in_off) : read(in_fd, buf, want);
            if (n > 0) {
                int w = sfs_write_all(out_fd, buf, (size_t)n);
                if (w < 0)
                    return w;
            }
        }
        if (n < 0) {
            if (errno == EINTR)
                continue;
            if (*way != SFS_COPY_READ_WRITE && way_refused(errno)) {
                *way += 1;
                continue;
            }
            return -errno;
        }
        if (n == 0)
            break;                  /* the source ended */
        done += n;
        if (in_off != NULL)
            *in_off += n;
    }
    return done;
}

/*
 * Copy at most max_bytes from in_fd to out_fd (both at their current
 * offsets).  Returns the byte count, or -EFBIG when the source holds more
 * than max_bytes (nothing past max_bytes is written), or -errno.
 */
int64_t sfs_copy(int in_fd, int out_fd, int64_t max_bytes)
{
    int way = SFS_COPY_FILE_RANGE;
    int64_t done = sfs_copy_range(in_fd, NULL, out_fd, max_bytes, &way);
    if (done < 0 || done < max_bytes)
        return done;
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

/* Write all len bytes of buf to fd.  0 or -errno. */
int sfs_write_all(int fd, const char *buf, size_t len)
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
