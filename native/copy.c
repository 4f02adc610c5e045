/*
 * sandbox-fs native: bounded fd-to-fd copy.  Returns -errno on failure.
 */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif
#include <errno.h>
#include <stdint.h>
#include <unistd.h>

#include "sfs.h"
#include "internal.h"

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
