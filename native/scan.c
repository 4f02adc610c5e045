/*
 * sandbox-fs native: sfs_scan_dir, one directory's listing with every entry's lstat in one
 * call (the snapshot walk's listing; policy on what is listed stays in Python).
 *
 * The directory is read from its start with getdents64 on the fd the caller holds (its
 * file position is put back to the start afterwards, as os.listdir(fd) leaves it), and each name is stat-ed with fstatat(dfd, name,
 * AT_SYMLINK_NOFOLLOW): relative to that fd, never following a symlink, never by a path.
 * "." and ".." are left out, and so is a name gone between the listing and its fstatat
 * (ENOENT: removed meanwhile).  Records are in the order the filesystem lists them.
 */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif
#include <errno.h>
#include <fcntl.h>
#include <stdint.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/types.h>
#include <unistd.h>

#include "sfs.h"

#define SFS_SCAN_DENTS_BYTES 32768    /* getdents64 buffer: hundreds of names per call */

struct sfs_dirent64 {                 /* struct linux_dirent64 */
    uint64_t d_ino;
    int64_t d_off;
    unsigned short d_reclen;
    unsigned char d_type;
    char d_name[];
};

struct sfs_scan_header {
    uint64_t ino;
    uint64_t dev;
    int64_t size;
    int64_t mtime_ns;
    int64_t ctime_ns;
    uint64_t nlink;
    uint32_t mode;
    uint32_t namelen;
};

_Static_assert(sizeof(struct sfs_scan_header) == SFS_SCAN_HEADER_BYTES, "record header layout");

/* The bytes of name's record: the header and the name, zero-padded to a multiple of 8. */
static uint64_t record_bytes(size_t namelen)
{
    return SFS_SCAN_HEADER_BYTES + (((uint64_t)namelen + 7u) & ~(uint64_t)7u);
}

/* Write one record for name (its lstat st) at out, which has record_bytes(namelen) bytes. */
static void put_record(char *out, const char *name, size_t namelen, const struct stat *st)
{
    uint64_t padded = record_bytes(namelen) - SFS_SCAN_HEADER_BYTES;
    struct sfs_scan_header h = {
        .ino = (uint64_t)st->st_ino,
        .dev = (uint64_t)st->st_dev,
        .size = (int64_t)st->st_size,
        .mtime_ns = (int64_t)st->st_mtim.tv_sec * 1000000000 + st->st_mtim.tv_nsec,
        .ctime_ns = (int64_t)st->st_ctim.tv_sec * 1000000000 + st->st_ctim.tv_nsec,
        .nlink = (uint64_t)st->st_nlink,
        .mode = (uint32_t)st->st_mode,
        .namelen = (uint32_t)namelen,
    };
    memcpy(out, &h, sizeof h);
    memcpy(out + SFS_SCAN_HEADER_BYTES, name, namelen);
    memset(out + SFS_SCAN_HEADER_BYTES + namelen, 0, padded - namelen);
}

static int is_dot_or_dotdot(const char *name)
{
    return name[0] == '.' && (name[1] == '\0' || (name[1] == '.' && name[2] == '\0'));
}

/*
 * Every entry of the directory open (O_RDONLY|O_DIRECTORY) on dfd, with its lstat, as
 * records (scan.h) in buf.  *need is set on every return: the bytes the records took
 * (success), or would take (the buffer was too small), or 0 (an error).
 *
 * Returns the bytes written (== *need); -ENOBUFS when buf (len bytes) is too small for all
 * of them, with *need > len: the rest of the listing is still read (not stat-ed) to count
 * it, so a second call with a buffer of *need bytes (plus room for names added meanwhile)
 * holds it; or -errno of lseek, getdents64 or an fstatat that failed otherwise than ENOENT,
 * with *need == 0.  So *need alone tells "buffer too small" from an errno, whatever the
 * errno (the kernel's own EOVERFLOW included).
 */
int64_t sfs_scan_dir(int dfd, char *buf, uint64_t len, uint64_t *need)
{
    char dents[SFS_SCAN_DENTS_BYTES] __attribute__((aligned(8)));
    uint64_t used = 0;
    int full = 0;                     /* a record did not fit: only counting from here on */

    *need = 0;
    if (lseek(dfd, 0, SEEK_SET) < 0)
        return -errno;
    for (;;) {
        long n = syscall(SYS_getdents64, dfd, dents, sizeof dents);
        if (n < 0) {
            if (errno == EINTR)
                continue;
            return -errno;
        }
        if (n == 0)
            break;
        for (long off = 0; off < n;) {
            struct sfs_dirent64 *d = (struct sfs_dirent64 *)(dents + off);
            off += d->d_reclen;
            const char *name = d->d_name;
            if (is_dot_or_dotdot(name))
                continue;
            size_t namelen = strlen(name);
            uint64_t rec = record_bytes(namelen);
            if (!full && rec > len - used)
                full = 1;
            if (full) {
                used += rec;
                continue;
            }
            struct stat st;
            if (fstatat(dfd, name, &st, AT_SYMLINK_NOFOLLOW) < 0) {
                if (errno == ENOENT)
                    continue;           /* removed since the listing: left out */
                return -errno;
            }
            put_record(buf + used, name, namelen, &st);
            used += rec;
        }
    }
    if (lseek(dfd, 0, SEEK_SET) < 0)
        return -errno;
    *need = used;
    return full ? -ENOBUFS : (int64_t)used;
}
