/* The batched copies, file by file into a temporary name and new files from a tar source: extract.c. */
#pragma once
#include <stdint.h>

/* One file copied into a temporary name and renamed into place (sfs_xfer_file). */
#define SFS_XFER_CHECK_IDENT 1   /* the source's (dev, ino) must equal x->dev, x->ino */
#define SFS_XFER_FSYNC 2         /* fsync the temporary file before the rename */
#define SFS_XFER_SET_MTIME 4     /* set atime and mtime to x->mtime_ns */
#define SFS_XFER_MORE 1          /* return value: buf is full, fds left open (see sfs_xfer_file) */
enum sfs_xfer_stage {
    SFS_STAGE_NONE = 0,
    SFS_STAGE_SRC_OPEN = 1,      /* opening the source name */
    SFS_STAGE_SRC_CHANGED = 2,   /* not a regular file, or not the expected identity */
    SFS_STAGE_TMP_CREATE = 3,    /* creating the temporary name */
    SFS_STAGE_COPY = 4,          /* reading or writing data (EFBIG: over max_bytes) */
    SFS_STAGE_META = 5,          /* fchown, fchmod, futimens, fsync, close */
    SFS_STAGE_RENAME = 6         /* renaming the temporary name over the destination */
};
struct sfs_xfer {
    uint64_t dev, ino;           /* in: expected source identity */
    int64_t max_bytes;           /* in: refuse sources over this many bytes */
    int64_t mtime_ns;            /* in: with SFS_XFER_SET_MTIME */
    uint32_t mode;               /* in: permission bits, set with fchmod */
    int flags;                   /* in: SFS_XFER_* */
    int64_t size;                /* out: bytes written */
    int stage;                   /* out: enum sfs_xfer_stage of a failure */
    int src_fd, tmp_fd;          /* out: open only after SFS_XFER_MORE */
};
int sfs_xfer_file(int src_dirfd, const char *src_name, int dst_dirfd, const char *tmp_name,
                  const char *dst_name, struct sfs_xfer *x, char *buf, int64_t buflen, int64_t uid, int64_t gid);
int sfs_xfer_finish(int dst_dirfd, const char *tmp_name, const char *dst_name, struct sfs_xfer *x);
void sfs_xfer_abort(int dst_dirfd, const char *tmp_name, struct sfs_xfer *x);
/* Many files of one directory pair in one call, data packed in buf. */
int sfs_xfer_files(int src_dirfd, int dst_dirfd, int n, const char *names, int64_t names_len,
                   struct sfs_xfer *xs, char *buf, int64_t buflen, int *ret_out, int64_t uid, int64_t gid);

/* A batch of new files from an uncompressed tar source, each created by its path beneath
 * stage_fd at the moment it is made (sfs_extract_files).  Per entry SFS_XF_FIELDS int64s:
 * src_off, size, probe_off (-1: none), mode, mtime_ns, SFS_XF_* flags.  The data comes from
 * src_fd at src_off, or from the caller's memory src_buf (src_len bytes) when it is non-NULL. */
#define SFS_XF_FIELDS 6
#define SFS_XF_CHMOD 1           /* fchmod to mode after the copy (the umask took bits away) */
#define SFS_XF_MTIME 2           /* set atime and mtime to mtime_ns */
#define SFS_XF_STAGE_CREATE 1    /* err_out[1]: creating the name (EINVAL: a bad entry) */
#define SFS_XF_STAGE_COPY 2      /* reading or writing data */
#define SFS_XF_STAGE_SHORT 3     /* the source ended before the member's data (or its padding) */
#define SFS_XF_STAGE_META 4      /* fchown, fchmod, futimens, close */
int sfs_extract_files(int src_fd, const char *src_buf, int64_t src_len, int stage_fd, int fallback,
                      const int64_t *nums, const char *names, int64_t names_len, int n, int64_t *err_out,
                      int64_t uid, int64_t gid);
