/* One directory's entries with their lstat, in one call: scan.c. */
#pragma once
#include <stdint.h>

/*
 * A record of sfs_scan_dir's output: SFS_SCAN_HEADER_BYTES of header, native byte order,
 *   uint64 ino, uint64 dev, int64 size, int64 mtime_ns, int64 ctime_ns, uint64 nlink,
 *   uint32 mode, uint32 namelen,
 * then namelen bytes of the name (any bytes but '/' and NUL, no terminator), zero-padded
 * to a multiple of 8 bytes.
 */
#define SFS_SCAN_HEADER_BYTES 56

int64_t sfs_scan_dir(int dfd, char *buf, uint64_t len, uint64_t *need);
