/* mirror: the leanest multithreaded libfuse (low-level API) read-only mirror of one
 * flat directory, for bench/fuse_ceiling.py.
 *
 * Why it exists: it bounds what any FUSE daemon that answers READ requests itself
 * (no kernel passthrough) can reach on a machine. It does nothing DLFS does
 * (no chunk lookup, no checksums, no Python): lookup, getattr, open (page cache
 * kept), read = pread() + reply, on libfuse's worker threads. If this mirror reads
 * at 0.65 of the source, no daemon of that kind will read at 0.85.
 *
 * usage: mirror SOURCE_DIR MOUNTPOINT [--no-open] [--serial-dirops]
 *        (stays in the foreground; unmount to stop)
 *   --no-open        answer OPEN with ENOSYS, as DLFS does: the kernel then opens
 *                    files itself (no OPEN/RELEASE round trips); a READ opens
 *                    the file, preads and closes it (a small file: one READ)
 *   --serial-dirops  do not negotiate FUSE parallel_dirops: the kernel holds the
 *                    directory's lock across each LOOKUP (DLFS before it had it)
 */
#define FUSE_USE_VERSION 34
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <fuse_lowlevel.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#define TIMEOUT 3600.0

static int source_fd;
static char (*names)[256];  /* sorted: a lookup is a binary search */
static int file_count;
static int no_open, serial_dirops;

static int by_name(const void *a, const void *b) { return strcmp(a, b); }

static int stat_inode(fuse_ino_t ino, struct stat *st) {
    int rc = ino == FUSE_ROOT_ID ? fstat(source_fd, st)
                                 : fstatat(source_fd, names[ino - 2], st, 0);
    st->st_ino = ino;
    return rc;
}

static void mirror_lookup(fuse_req_t req, fuse_ino_t parent, const char *name) {
    char (*found)[256] = parent != FUSE_ROOT_ID || strlen(name) >= sizeof names[0] ? NULL
        : bsearch(name, names, file_count, sizeof names[0], by_name);
    struct fuse_entry_param e = {.attr_timeout = TIMEOUT, .entry_timeout = TIMEOUT};
    if (found != NULL) {
        e.ino = (fuse_ino_t)(found - names) + 2;
        if (stat_inode(e.ino, &e.attr) == 0) { fuse_reply_entry(req, &e); return; }
    }
    fuse_reply_err(req, ENOENT);
}

static void mirror_getattr(fuse_req_t req, fuse_ino_t ino, struct fuse_file_info *fi) {
    struct stat st;
    (void)fi;
    if (stat_inode(ino, &st) != 0) fuse_reply_err(req, errno);
    else fuse_reply_attr(req, &st, TIMEOUT);
}

static void mirror_open(fuse_req_t req, fuse_ino_t ino, struct fuse_file_info *fi) {
    if (no_open && ino != FUSE_ROOT_ID) { fuse_reply_err(req, ENOSYS); return; }
    int fd = ino == FUSE_ROOT_ID ? -1 : openat(source_fd, names[ino - 2], O_RDONLY);
    if (fd < 0) { fuse_reply_err(req, ino == FUSE_ROOT_ID ? EISDIR : errno); return; }
    fi->fh = fd;
    fi->keep_cache = 1;
    fuse_reply_open(req, fi);
}

static void mirror_release(fuse_req_t req, fuse_ino_t ino, struct fuse_file_info *fi) {
    (void)ino;
    close(fi->fh);
    fuse_reply_err(req, 0);
}

static void mirror_read(fuse_req_t req, fuse_ino_t ino, size_t size, off_t off,
                        struct fuse_file_info *fi) {
    char *buf = malloc(size);
    ssize_t n;
    if (buf == NULL) { fuse_reply_err(req, ENOMEM); return; }
    int fd = no_open ? openat(source_fd, names[ino - 2], O_RDONLY) : (int)fi->fh;
    if (fd < 0) { free(buf); fuse_reply_err(req, errno); return; }
    n = pread(fd, buf, size, off);
    if (n < 0) fuse_reply_err(req, errno);
    else fuse_reply_buf(req, buf, n);
    if (no_open) close(fd);
    free(buf);
}

static void mirror_init(void *userdata, struct fuse_conn_info *conn) {
    (void)userdata;
    if (serial_dirops) conn->want &= ~FUSE_CAP_PARALLEL_DIROPS;
}

static const struct fuse_lowlevel_ops mirror_ops = {
    .init = mirror_init, .lookup = mirror_lookup, .getattr = mirror_getattr, .open = mirror_open,
    .release = mirror_release, .read = mirror_read,
};

int main(int argc, char **argv) {
    for (int i = 3; i < argc; i++) {
        if (strcmp(argv[i], "--no-open") == 0) no_open = 1;
        else if (strcmp(argv[i], "--serial-dirops") == 0) serial_dirops = 1;
        else argc = 0;
    }
    if (argc < 3) {
        fprintf(stderr, "usage: %s SOURCE_DIR MOUNTPOINT [--no-open] [--serial-dirops]\n",
                argv[0]);
        return 2;
    }
    source_fd = open(argv[1], O_RDONLY | O_DIRECTORY);
    DIR *dir = source_fd < 0 ? NULL : fdopendir(dup(source_fd));
    if (dir == NULL) { perror(argv[1]); return 1; }
    int room = 0;
    for (struct dirent *de; (de = readdir(dir)) != NULL;) {
        if (de->d_name[0] == '.' || strlen(de->d_name) >= sizeof names[0]) continue;
        if (file_count == room) {
            room = room ? 2 * room : 1024;
            names = realloc(names, room * sizeof names[0]);
            if (names == NULL) { perror("realloc"); return 1; }
        }
        strcpy(names[file_count++], de->d_name);
    }
    closedir(dir);
    qsort(names, file_count, sizeof names[0], by_name);

    char *fuse_argv[] = {argv[0], "-o", "ro,fsname=mirror,subtype=mirror"};
    struct fuse_args args = FUSE_ARGS_INIT(3, fuse_argv);
    struct fuse_session *se = fuse_session_new(&args, &mirror_ops, sizeof mirror_ops, NULL);
    if (se == NULL || fuse_session_mount(se, argv[2]) != 0) return 1;
    struct fuse_loop_config loop = {.clone_fd = 0, .max_idle_threads = 10};
    int rc = fuse_session_loop_mt(se, &loop);
    fuse_session_unmount(se);
    fuse_session_destroy(se);
    return rc == 0 ? 0 : 1;
}
