/* LD_PRELOAD fault shim for the fault suite (tests/test_faults*.py): fails or kills at the Nth call.
 *
 * Loaded into one long-lived worker process (tests/faults/worker.py) with LD_PRELOAD.  Until a
 * test arms it, every wrapped function passes straight through to the next definition
 * (dlsym(RTLD_NEXT)).  Armed with sfs_fault_arm(mask, nth, action, err), it counts the calls
 * whose class is in ``mask`` (any thread, atomically) and at the ``nth`` one either fails that
 * call with -1/errno=err (action 1; the call is not made, later calls pass through) or sends
 * SIGKILL to the process (action 2), before the call is made.  Action 0 only counts, so a test
 * can learn how many calls an operation makes and choose kill points among them.
 *
 * Classes (bits of ``mask``): 1 read (read, pread64, readv), 2 write (write, pwrite64, writev,
 * copy_file_range, sendfile), 4 fsync (fsync, fdatasync), 8 rename (rename, renameat, renameat2,
 * syscall(SYS_renameat2)), 16 open (open, open64, openat, openat64, syscall(SYS_openat2)),
 * 32 namespace changes (linkat, unlinkat, mkdirat, symlinkat).
 *
 * The C module reaches openat2 and renameat2 through syscall(2), so syscall itself is wrapped
 * for those two numbers; every other number passes through with its six argument words.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <sys/sendfile.h>
#include <sys/syscall.h>
#include <sys/types.h>
#include <sys/uio.h>
#include <unistd.h>

enum { C_READ = 1, C_WRITE = 2, C_FSYNC = 4, C_RENAME = 8, C_OPEN = 16, C_NAMES = 32 };
enum { A_COUNT = 0, A_FAIL = 1, A_KILL = 2 };

static int armed_mask;
static long fire_at;
static int fire_action;
static int fire_errno;
static long counted;

void sfs_fault_arm(int mask, long nth, int action, int err)
{
    __atomic_store_n(&counted, 0, __ATOMIC_SEQ_CST);
    fire_at = nth;
    fire_action = action;
    fire_errno = err;
    __atomic_store_n(&armed_mask, mask, __ATOMIC_SEQ_CST);
}

long sfs_fault_disarm(void)
{
    __atomic_store_n(&armed_mask, 0, __ATOMIC_SEQ_CST);
    return __atomic_load_n(&counted, __ATOMIC_SEQ_CST);
}

long sfs_fault_count(void)
{
    return __atomic_load_n(&counted, __ATOMIC_SEQ_CST);
}

/* 0: make the call; 1: fail it (errno is set). */
static int hit(int cls)
{
    if (!(__atomic_load_n(&armed_mask, __ATOMIC_SEQ_CST) & cls))
        return 0;
    long n = __atomic_add_fetch(&counted, 1, __ATOMIC_SEQ_CST);
    if (n != fire_at || fire_action == A_COUNT)
        return 0;
    if (fire_action == A_KILL) {
        kill(getpid(), SIGKILL);
        for (;;)
            pause();
    }
    errno = fire_errno;
    return 1;
}

#define NEXT(name) \
    static __typeof__(&name) next_##name; \
    if (next_##name == NULL) \
        next_##name = (__typeof__(&name))dlsym(RTLD_NEXT, #name)

ssize_t read(int fd, void *buf, size_t n)
{
    NEXT(read);
    return hit(C_READ) ? -1 : next_read(fd, buf, n);
}

ssize_t pread64(int fd, void *buf, size_t n, off_t off)
{
    NEXT(pread64);
    return hit(C_READ) ? -1 : next_pread64(fd, buf, n, off);
}

ssize_t readv(int fd, const struct iovec *iov, int cnt)
{
    NEXT(readv);
    return hit(C_READ) ? -1 : next_readv(fd, iov, cnt);
}

ssize_t write(int fd, const void *buf, size_t n)
{
    NEXT(write);
    return hit(C_WRITE) ? -1 : next_write(fd, buf, n);
}

ssize_t pwrite64(int fd, const void *buf, size_t n, off_t off)
{
    NEXT(pwrite64);
    return hit(C_WRITE) ? -1 : next_pwrite64(fd, buf, n, off);
}

ssize_t writev(int fd, const struct iovec *iov, int cnt)
{
    NEXT(writev);
    return hit(C_WRITE) ? -1 : next_writev(fd, iov, cnt);
}

ssize_t copy_file_range(int in, off_t *in_off, int out, off_t *out_off, size_t n, unsigned int flags)
{
    NEXT(copy_file_range);
    return hit(C_WRITE) ? -1 : next_copy_file_range(in, in_off, out, out_off, n, flags);
}

ssize_t sendfile(int out, int in, off_t *off, size_t n)
{
    NEXT(sendfile);
    return hit(C_WRITE) ? -1 : next_sendfile(out, in, off, n);
}

int fsync(int fd)
{
    NEXT(fsync);
    return hit(C_FSYNC) ? -1 : next_fsync(fd);
}

int fdatasync(int fd)
{
    NEXT(fdatasync);
    return hit(C_FSYNC) ? -1 : next_fdatasync(fd);
}

int rename(const char *a, const char *b)
{
    NEXT(rename);
    return hit(C_RENAME) ? -1 : next_rename(a, b);
}

int renameat(int ad, const char *a, int bd, const char *b)
{
    NEXT(renameat);
    return hit(C_RENAME) ? -1 : next_renameat(ad, a, bd, b);
}

int renameat2(int ad, const char *a, int bd, const char *b, unsigned int flags)
{
    NEXT(renameat2);
    return hit(C_RENAME) ? -1 : next_renameat2(ad, a, bd, b, flags);
}

/* The mode argument is read only when the flags say it is there (O_CREAT, O_TMPFILE). */
#define MODE_ARG(flags, mode) \
    mode_t mode = 0; \
    if ((flags) & (O_CREAT | __O_TMPFILE)) { \
        va_list ap; \
        va_start(ap, flags); \
        mode = (mode_t)va_arg(ap, int); \
        va_end(ap); \
    }

int open(const char *path, int flags, ...)
{
    NEXT(open);
    MODE_ARG(flags, mode);
    return hit(C_OPEN) ? -1 : next_open(path, flags, mode);
}

int open64(const char *path, int flags, ...)
{
    NEXT(open64);
    MODE_ARG(flags, mode);
    return hit(C_OPEN) ? -1 : next_open64(path, flags, mode);
}

int openat(int dirfd, const char *path, int flags, ...)
{
    NEXT(openat);
    MODE_ARG(flags, mode);
    return hit(C_OPEN) ? -1 : next_openat(dirfd, path, flags, mode);
}

int openat64(int dirfd, const char *path, int flags, ...)
{
    NEXT(openat64);
    MODE_ARG(flags, mode);
    return hit(C_OPEN) ? -1 : next_openat64(dirfd, path, flags, mode);
}

int linkat(int ad, const char *a, int bd, const char *b, int flags)
{
    NEXT(linkat);
    return hit(C_NAMES) ? -1 : next_linkat(ad, a, bd, b, flags);
}

int unlinkat(int dirfd, const char *path, int flags)
{
    NEXT(unlinkat);
    return hit(C_NAMES) ? -1 : next_unlinkat(dirfd, path, flags);
}

int mkdirat(int dirfd, const char *path, mode_t mode)
{
    NEXT(mkdirat);
    return hit(C_NAMES) ? -1 : next_mkdirat(dirfd, path, mode);
}

int symlinkat(const char *target, int dirfd, const char *path)
{
    NEXT(symlinkat);
    return hit(C_NAMES) ? -1 : next_symlinkat(target, dirfd, path);
}

long syscall(long number, ...)
{
    NEXT(syscall);
    va_list ap;
    long a[6];
    va_start(ap, number);
    for (int i = 0; i < 6; i++)
        a[i] = va_arg(ap, long);
    va_end(ap);
    if ((number == SYS_openat2 && hit(C_OPEN)) || (number == SYS_renameat2 && hit(C_RENAME)))
        return -1;
    return next_syscall(number, a[0], a[1], a[2], a[3], a[4], a[5]);
}
