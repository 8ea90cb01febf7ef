/* mirror: the leanest multithreaded libfuse (low-level API) read-only mirror of one
 * flat directory, for bench/fuse_ceiling.py.
 *
 * Why it exists: it bounds what any FUSE daemon that answers READ requests itself
 * (no kernel passthrough) can reach on a machine. It does nothing DLFS does
 * (no chunk lookup, no checksums, no Python): lookup, getattr, open (page cache
 * kept), read = pread() + reply, on libfuse's worker threads. If this mirror reads
 * at 0.65 of the source, no daemon of that kind will read at 0.85.
 *
 * usage: mirror SOURCE_DIR MOUNTPOINT   (stays in the foreground; unmount to stop)
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

#define MAX_FILES 256
#define TIMEOUT 3600.0

static int source_fd;
static char names[MAX_FILES][256];
static int file_count;

static int stat_inode(fuse_ino_t ino, struct stat *st) {
    int rc = ino == FUSE_ROOT_ID ? fstat(source_fd, st)
                                 : fstatat(source_fd, names[ino - 2], st, 0);
    st->st_ino = ino;
    return rc;
}

static void mirror_lookup(fuse_req_t req, fuse_ino_t parent, const char *name) {
    for (int i = 0; parent == FUSE_ROOT_ID && i < file_count; i++) {
        if (strcmp(names[i], name) == 0) {
            struct fuse_entry_param e = {.ino = i + 2, .attr_timeout = TIMEOUT,
                                         .entry_timeout = TIMEOUT};
            if (stat_inode(e.ino, &e.attr) != 0) break;
            fuse_reply_entry(req, &e);
            return;
        }
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
    (void)ino;
    if (buf == NULL) { fuse_reply_err(req, ENOMEM); return; }
    n = pread(fi->fh, buf, size, off);
    if (n < 0) fuse_reply_err(req, errno);
    else fuse_reply_buf(req, buf, n);
    free(buf);
}

static const struct fuse_lowlevel_ops mirror_ops = {
    .lookup = mirror_lookup, .getattr = mirror_getattr, .open = mirror_open,
    .release = mirror_release, .read = mirror_read,
};

int main(int argc, char **argv) {
    if (argc != 3) { fprintf(stderr, "usage: %s SOURCE_DIR MOUNTPOINT\n", argv[0]); return 2; }
    source_fd = open(argv[1], O_RDONLY | O_DIRECTORY);
    DIR *dir = source_fd < 0 ? NULL : fdopendir(dup(source_fd));
    if (dir == NULL) { perror(argv[1]); return 1; }
    for (struct dirent *de; (de = readdir(dir)) != NULL && file_count < MAX_FILES;)
        if (de->d_name[0] != '.' && strlen(de->d_name) < sizeof names[0])
            strcpy(names[file_count++], de->d_name);
    closedir(dir);

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
