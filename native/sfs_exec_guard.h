/*
 * Protected and unreadable entries of sfs-exec (--guard): included by
 * sfs_exec.c after sfs_exec_root.h (it uses fail(), fd_path(),
 * reopen_here(), beneath(), clone_tree() and new_mount()).
 *
 *   --guard K:BASE:FD:REL   K is p (pin: bind the directory onto itself, so
 *                      it cannot be renamed or removed: EBUSY), r (a
 *                      recursive read-only bind of the entry onto itself:
 *                      directory, file or the symlink itself) or d (deny:
 *                      an empty, read-only, mode 0000 tmpfs over a
 *                      directory, a bind of an empty read-only mode 0000
 *                      file over anything else).  BASE is the fd of the
 *                      writable tree the entry lies in (a --rw-tree), or
 *                      "w": the workspace at --workspace-path in a private
 *                      root.  FD is an O_PATH fd on the entry itself,
 *                      opened by the parent through the Root; REL its path
 *                      beneath the tree.  Repeatable; applied in the order
 *                      given (the parent sends pins first, outer first).
 *
 * After the trees are in place (read-only layer: after every bind and
 * reach; private root: after the workspace clone), each entry is looked
 * up again in the command's namespace beneath its tree's mount with
 * openat2(RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS | RESOLVE_NO_MAGICLINKS,
 * O_PATH | O_NOFOLLOW): no symlink is followed on any component, a
 * trailing symlink gives the link itself; then it must be FD's inode
 * (st_dev, st_ino) or the helper fails with ESTALE ("guard" stage).  The
 * mount goes onto that fd (move_mount, never a path).
 */

#define SFS_MAX_GUARDS 256
#define SFS_RESOLVE_NO_SYMLINKS 0x04
#define SFS_DENY_OPTS "size=4k,nr_inodes=4,mode=0000"

struct sfs_guard {
    char kind;                  /* 'p', 'r' or 'd' */
    int base;                   /* the tree's fd, or -1: the private root's workspace */
    int fd;                     /* the entry, opened by the parent */
    const char *rel;
    char *base_path;            /* fd_path(base), read before any namespace change */
};

static struct sfs_guard sfs_guards[SFS_MAX_GUARDS];
static int sfs_nguards;

/* Parse "K:BASE:FD:REL" (fail "usage" EINVAL on anything else). */
static void add_guard(const char *v)
{
    if (sfs_nguards == SFS_MAX_GUARDS)
        fail("usage", E2BIG);
    struct sfs_guard *g = &sfs_guards[sfs_nguards];
    if ((v[0] != 'p' && v[0] != 'r' && v[0] != 'd') || v[1] != ':')
        fail("usage", EINVAL);
    g->kind = v[0];
    const char *p = v + 2;
    char *end;
    if (p[0] == 'w' && p[1] == ':') {
        g->base = -1;
        p += 2;
    } else {
        long b = strtol(p, &end, 10);
        if (end == p || *end != ':' || b < 0 || b > 1 << 20)
            fail("usage", EINVAL);
        g->base = (int)b;
        p = end + 1;
    }
    long f = strtol(p, &end, 10);
    if (end == p || *end != ':' || f < 0 || f > 1 << 20)
        fail("usage", EINVAL);
    g->fd = (int)f;
    g->rel = end + 1;
    if (g->rel[0] == '\0' || g->rel[0] == '/')
        fail("usage", EINVAL);
    g->base_path = NULL;
    sfs_nguards++;
}

/* Before any namespace change: the trees' paths as this process sees them. */
static void guards_note_paths(void)
{
    for (int k = 0; k < sfs_nguards; k++)
        if (sfs_guards[k].base >= 0)
            sfs_guards[k].base_path = fd_path(sfs_guards[k].base, "guard");
}

/* The entry of g beneath treefd, checked to be g->fd's inode. */
static int guard_target(const struct sfs_guard *g, int treefd)
{
    struct sfs_open_how how = { O_PATH | O_NOFOLLOW | O_CLOEXEC, 0,
                                SFS_RESOLVE_BENEATH | SFS_RESOLVE_NO_SYMLINKS | SFS_RESOLVE_NO_MAGICLINKS };
    int t = (int)syscall(SYS_openat2, treefd, g->rel, &how, sizeof how);
    struct stat a, b;
    if (t < 0)
        fail("guard", errno);
    if (fstat(g->fd, &a) < 0 || fstat(t, &b) < 0)
        fail("guard", errno);
    if (a.st_dev != b.st_dev || a.st_ino != b.st_ino)
        fail("guard", ESTALE);
    return t;
}

/* A clone of an empty, read-only, mode 0000 file of a tmpfs of our own (made once). */
static int deny_file_clone(void)
{
    static int empty = -1;
    if (empty < 0) {
        int m = new_mount("tmpfs", SFS_DENY_OPTS, SFS_MOUNT_ATTR_NOSUID | SFS_MOUNT_ATTR_NODEV | SFS_MOUNT_ATTR_NOEXEC);
        int f = openat(m, "empty", O_CREAT | O_EXCL | O_WRONLY | O_NOFOLLOW | O_CLOEXEC, 0);
        if (f < 0 || fchmod(f, 0) < 0)
            fail("guard", errno);
        close(f);
        struct sfs_mount_attr ro = { SFS_MOUNT_ATTR_RDONLY, 0, 0, 0 };
        if (syscall(SYS_mount_setattr, m, "", AT_EMPTY_PATH, &ro, sizeof ro) < 0)
            fail("guard", errno);
        empty = openat(m, "empty", O_PATH | O_NOFOLLOW | O_CLOEXEC);
        if (empty < 0)
            fail("guard", errno);
        /* m stays open: its anonymous namespace (which open_tree needs) ends with it. */
    }
    return clone_tree(empty, 0, 0);
}

/* Put one guard's mount onto t (closes t). */
static void guard_one(const struct sfs_guard *g, int t)
{
    const uint64_t ro = SFS_MOUNT_ATTR_RDONLY | SFS_MOUNT_ATTR_NOSUID | SFS_MOUNT_ATTR_NODEV;
    struct stat st;
    int c;
    if (fstat(t, &st) < 0)
        fail("guard", errno);
    if (g->kind == 'p') {
        if (!S_ISDIR(st.st_mode))
            fail("guard", ENOTDIR);
        c = clone_tree(t, SFS_MOUNT_ATTR_NOSUID | SFS_MOUNT_ATTR_NODEV, 1);
    } else if (g->kind == 'r')
        c = clone_tree(t, ro, 1);
    else if (S_ISDIR(st.st_mode)) {
        c = new_mount("tmpfs", SFS_DENY_OPTS, 0);
        struct sfs_mount_attr ma = { ro | SFS_MOUNT_ATTR_NOEXEC, 0, 0, 0 };
        if (syscall(SYS_mount_setattr, c, "", AT_EMPTY_PATH, &ma, sizeof ma) < 0)
            fail("guard", errno);
    } else
        c = deny_file_clone();
    if (syscall(SYS_move_mount, c, "", t, "", SFS_MOVE_MOUNT_F_EMPTY_PATH | SFS_MOVE_MOUNT_T_EMPTY_PATH) < 0)
        fail("guard", errno);
    close(c);
    close(t);
}

/*
 * Apply every guard, in order.  rootfd < 0: the read-only mount layer (the
 * trees are at their paths in this namespace); else the private root being
 * built beneath rootfd, with the workspace at ws_path.
 */
static void apply_guards(int rootfd, const char *ws_path)
{
    for (int k = 0; k < sfs_nguards; k++) {
        const struct sfs_guard *g = &sfs_guards[k];
        int tree;
        if (g->base < 0) {
            if (rootfd < 0 || !ws_path)
                fail("guard", EINVAL);
            tree = beneath(rootfd, ws_path);
        } else if (rootfd >= 0) {
            tree = beneath(rootfd, g->base_path);
            struct stat a, b;
            if (fstat(g->base, &a) < 0 || fstat(tree, &b) < 0)
                fail("guard", errno);
            if (a.st_dev != b.st_dev || a.st_ino != b.st_ino)
                fail("guard", ESTALE);
        } else
            tree = reopen_here(g->base, g->base_path, "guard");
        guard_one(g, guard_target(g, tree));
        close(tree);
    }
}
