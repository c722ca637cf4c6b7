/*
 * uring.c - the batch calls through io_uring: several blocks in flight at once.
 *
 * The system-call loop (mptier_io.c) does one block at a time, one step at a time, so a
 * process never has more than one request at the device. On a block device that leaves
 * it idle most of the time: a cold open is one to three dependent random reads, a folder
 * is made with another, and only then does the data move. Here every block of the batch
 * runs its own small state machine over one io_uring per thread, up to MPT_URING_DEPTH
 * blocks at once, and each step that can wait for the device goes through the ring:
 *
 *   load    OPENAT2 (RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS)        -> READ
 *   store   OPENAT2 of the folder [-> MKDIRAT, OPENAT per missing folder] -> STATX of the
 *           name -> OPENAT of the temporary (O_TMPFILE, or "<leaf>.<tag>.<n>.tmp" O_EXCL)
 *           -> WRITE
 *
 * The checks between steps (fstat, the checksum record, fcntl) are the loop's, made as
 * plain system calls on the descriptor the ring returned: cheap once the inode is in
 * memory. Everything that decides what a batch *did* happens in batch order, in one
 * place (mpt_finish): the CRC check and TOUCH of a load; the record, publication (rename
 * or linkat) and TOUCH of a store; the removal of a corrupt file. A block whose path
 * meets anything unusual -- a symlink, a short or long file, a non-file, a folder removed
 * under us, O_DIRECT refused -- is handed, when its turn comes, to the loop's own
 * one-block function (mpt_load_one / mpt_store_one), which does exactly what the loop
 * does. So the file system ends as the loop leaves it, with two differences that only a
 * failed batch can show, and that the contract allows:
 *
 *   - a load's blocks after the failing one were read into their slots meanwhile; those
 *     slots' contents are undefined (so is the failing block's slot, in the loop too).
 *     The call reports only the prefix as done, all I/O has ended when it returns, and
 *     the engine never reports those keys as loaded.
 *   - a store's blocks after the failing one may have made their (empty) folders; their
 *     temporary files are removed and nothing after the failing block is published.
 *
 * The ring is made on a thread's first MPT_URING batch and kept for the thread's life
 * (a forked child makes its own). Where io_uring is missing, disabled
 * (kernel.io_uring_disabled), refused (seccomp), or lacks one of the operations above,
 * MPT_URING batches take the loop; mpt_uring_status() says which and why.
 */

#ifndef _GNU_SOURCE
#define _GNU_SOURCE 1 /* O_DIRECT, O_TMPFILE, O_PATH, statx */
#endif

#include "mptier_native.h"

#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#if defined(__linux__) && __has_include(<linux/io_uring.h>)
#include <linux/io_uring.h>
#endif

/* A header new enough for every operation used here (IORING_OP_MKDIRAT is 5.15;
 * IORING_SETUP_SUBMIT_ALL, 5.18, marks a header that has it). */
#if defined(IORING_SETUP_SUBMIT_ALL) && defined(SYS_io_uring_setup)
#define MPT_HAVE_URING 1
#else
#define MPT_HAVE_URING 0
#endif

/* Blocks of one batch in flight at once, per thread. Each holds at most one request in
 * the ring and a descriptor or two, so this also bounds the ring and the open files.
 * 32 is well past where a virtual disk or an NVMe drive stops gaining from one process
 * (bench/experiments/uring_vs_loop.py), and a tier's task is at most 8 MiB anyway. */
#define MPT_URING_DEPTH 32
/* Ring size: one request per block in flight; completions have twice that room. */
#define MPT_URING_ENTRIES MPT_URING_DEPTH
/* A bounced load keeps at most 1/MPT_WAVE_SHARE of its bounce slots' reads in flight
 * (and of its blocks: mpt_wave), and sends the next such wave as soon as the last has
 * returned, before copying it to the slots: the copies of one wave run while the device
 * reads the next. With every block's read in flight at once, a task's copies all came
 * after its reads with nothing of this worker's on the device, and a virtual disk that
 * completes what it took all at once (this VM's: 0.9 of completions within 0.1 ms of the
 * one before) idled while every worker copied (docs/performance.md, section 20).
 * MPT_WHOLE_BOUNCE turns the waves off, for side-by-side measurements. */
#define MPT_WAVE_SHARE 2
/* Batches shorter than this take the loop: with one block there is nothing to overlap,
 * and a round trip through the ring costs more than the system calls it replaces. */
#define MPT_URING_MIN_BLOCKS 2
/* io_uring_enter failing while a batch waits out its requests (mpt_drain) is tried
 * again 1, 2, ... MPT_DRAIN_TRIES ms later, then every MPT_DRAIN_TRIES ms until the
 * ring answers: the kernel finding memory again. The wait has no end of its own: a
 * request still in the ring may yet write into memory the caller hands out again (a
 * bounce slot, an engine's slot), so no batch returns before its ring gave every one
 * back. A worker stuck here is one the pool's I/O timeout ends; its exit waits out
 * its ring in the kernel. */
#define MPT_DRAIN_TRIES 20

static pthread_once_t mpt_uring_once = PTHREAD_ONCE_INIT;
static char mpt_uring_why[128] = "io_uring: not probed yet";
static int mpt_uring_ok; /* the probe made a ring and found every operation */

#if MPT_HAVE_URING

/* -- one block's state --------------------------------------------------------------- */

enum mpt_state {
    MPT_FREE = 0,
    /* waiting for a request of the ring */
    MPT_L_OPEN,    /* load: OPENAT2 of the block */
    MPT_L_READ,    /* load: READ */
    MPT_S_FOLDER,  /* store: OPENAT2 of the block's folder */
    MPT_S_MKDIR,   /* store: MKDIRAT of folder component `comp` */
    MPT_S_WALK,    /* store: OPENAT of folder component `comp` */
    MPT_S_STAT,    /* store: STATX of the name */
    MPT_S_OPEN,    /* store: OPENAT of the temporary file */
    MPT_S_WRITE,   /* store: WRITE */
    /* done with the ring; mpt_finish takes it from here, in batch order */
    MPT_READY,     /* load read / store written: check, publish */
    MPT_EXISTS,    /* store: a whole block is there already */
    MPT_FAILED,    /* rc says why (decided with the loop's rules) */
    MPT_SLOW,      /* unusual: the loop's one-block function redoes it */
};

struct mpt_job {
    uint8_t state, direct, tmpfile, named, remove, crc_done, slow_direct;
    uint8_t made; /* store: the last MKDIRAT made its folder (new: no name to check) */
    int present; /* load: the block has a checksum record (want) */
    int fd;       /* the block's file (load), the temporary file (store) */
    int dirfd;    /* store: the block's folder (or the root) */
    int cur;      /* store: the folder walk's current folder (or the root) */
    int rc;
    unsigned tries;
    size_t done;  /* bytes moved so far */
    size_t comp;  /* store: offset of the walk's current component in the folder path */
    uint32_t want, crc;
    const char *rel;   /* the path as given */
    const char *dir;   /* store: its folder ("" for the root), NUL-terminated */
    const char *leaf;  /* store: its file name */
    char *p;           /* the block's memory: where it is read or written */
    char *dst;         /* the caller's slot: a bounced load's, written once p holds the
                        * block; a bounced store's, copied to p as the block starts */
    struct mpt_open_how how;
    struct statx stx;
    char name[NAME_MAX + 1]; /* the temporary's name, or a folder component */
};

/* -- the ring, by raw system calls (no liburing) ------------------------------------ */

struct mpt_ring {
    int fd;
    pid_t pid; /* the process that made it: a forked child must make its own */
    unsigned *sq_head, *sq_tail, *sq_mask, *sq_array;
    unsigned *cq_head, *cq_tail, *cq_mask;
    struct io_uring_sqe *sqes;
    struct io_uring_cqe *cqes;
    unsigned tail;  /* our submission tail, published to *sq_tail before each enter */
    int defer;      /* IORING_SETUP_DEFER_TASKRUN: completions appear only in enter */
    void *sq_map, *cq_map;
    size_t sq_len, cq_len, sqes_len;
    struct mpt_job *jobs; /* MPT_URING_DEPTH of them, slot = block index % depth */
};

static int mpt_uring_setup(unsigned entries, struct io_uring_params *p, unsigned flags)
{
    memset(p, 0, sizeof *p);
    p->flags = flags;
    return (int)syscall(SYS_io_uring_setup, entries, p);
}

static void mpt_ring_unmap(struct mpt_ring *r)
{
    if (r->sqes != NULL && r->sqes != MAP_FAILED)
        munmap(r->sqes, r->sqes_len);
    if (r->cq_map != NULL && r->cq_map != MAP_FAILED && r->cq_map != r->sq_map)
        munmap(r->cq_map, r->cq_len);
    if (r->sq_map != NULL && r->sq_map != MAP_FAILED)
        munmap(r->sq_map, r->sq_len);
    r->sqes = NULL;
    r->sq_map = r->cq_map = NULL;
}

static void mpt_ring_free(struct mpt_ring *r)
{
    mpt_ring_unmap(r);
    if (r->fd >= 0)
        close(r->fd);
    r->fd = -1;
    free(r->jobs);
    r->jobs = NULL;
}

/* Make a ring: 0 or -errno (with why set to a description). */
static int mpt_ring_init(struct mpt_ring *r, char *why, size_t why_len)
{
    struct io_uring_params p;
    int fd;

    memset(r, 0, sizeof *r);
    r->fd = -1;
    /* Only this thread submits, and it reaps in io_uring_enter: the kernel may then run
     * completion work at that moment instead of interrupting the thread (6.1+). */
    fd = mpt_uring_setup(MPT_URING_ENTRIES, &p,
                         IORING_SETUP_SINGLE_ISSUER | IORING_SETUP_DEFER_TASKRUN);
    r->defer = fd >= 0;
    if (fd < 0 && errno == EINVAL)
        fd = mpt_uring_setup(MPT_URING_ENTRIES, &p, 0);
    if (fd < 0) {
        int err = errno;
        snprintf(why, why_len, "io_uring_setup: %s", strerror(err));
        return -err;
    }
    r->fd = fd;
    r->pid = getpid();
    r->sq_len = p.sq_off.array + p.sq_entries * sizeof(unsigned);
    r->cq_len = p.cq_off.cqes + p.cq_entries * sizeof(struct io_uring_cqe);
    if (p.features & IORING_FEAT_SINGLE_MMAP) {
        if (r->cq_len > r->sq_len)
            r->sq_len = r->cq_len;
        r->cq_len = r->sq_len;
    }
    r->sq_map = mmap(NULL, r->sq_len, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, fd,
                     IORING_OFF_SQ_RING);
    r->cq_map = (p.features & IORING_FEAT_SINGLE_MMAP) ? r->sq_map
                : mmap(NULL, r->cq_len, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE,
                       fd, IORING_OFF_CQ_RING);
    r->sqes_len = p.sq_entries * sizeof(struct io_uring_sqe);
    r->sqes = mmap(NULL, r->sqes_len, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, fd,
                   IORING_OFF_SQES);
    if (r->sq_map == MAP_FAILED || r->cq_map == MAP_FAILED || r->sqes == MAP_FAILED) {
        int err = errno;
        snprintf(why, why_len, "io_uring mmap: %s", strerror(err));
        mpt_ring_free(r);
        return -err;
    }
    r->sq_head = (unsigned *)((char *)r->sq_map + p.sq_off.head);
    r->sq_tail = (unsigned *)((char *)r->sq_map + p.sq_off.tail);
    r->sq_mask = (unsigned *)((char *)r->sq_map + p.sq_off.ring_mask);
    r->sq_array = (unsigned *)((char *)r->sq_map + p.sq_off.array);
    r->cq_head = (unsigned *)((char *)r->cq_map + p.cq_off.head);
    r->cq_tail = (unsigned *)((char *)r->cq_map + p.cq_off.tail);
    r->cq_mask = (unsigned *)((char *)r->cq_map + p.cq_off.ring_mask);
    r->cqes = (struct io_uring_cqe *)((char *)r->cq_map + p.cq_off.cqes);
    r->tail = *r->sq_tail;
    return 0;
}

/* The next submission entry, zeroed. The caller never has more than MPT_URING_ENTRIES
 * requests queued or in flight, so there is always room. */
static struct io_uring_sqe *mpt_sqe(struct mpt_ring *r, uint64_t user_data)
{
    unsigned idx = r->tail & *r->sq_mask;
    struct io_uring_sqe *s = &r->sqes[idx];
    memset(s, 0, sizeof *s);
    s->user_data = user_data;
    r->sq_array[idx] = idx;
    r->tail++;
    return s;
}

/* Submit what is queued; with wait, also wait until at least one completion is there.
 * 0 or -errno (the ring is then unusable: the caller finishes the batch without it). */
static int mpt_enter(struct mpt_ring *r, int wait)
{
    for (;;) {
        unsigned queued = r->tail - __atomic_load_n(r->sq_head, __ATOMIC_ACQUIRE);
        unsigned flags = 0;
        long rc;
        if (queued == 0 && !wait && !r->defer)
            return 0;
        __atomic_store_n(r->sq_tail, r->tail, __ATOMIC_RELEASE);
        if (wait || r->defer)
            flags |= IORING_ENTER_GETEVENTS;
        rc = syscall(SYS_io_uring_enter, r->fd, queued, wait ? 1u : 0u, flags, NULL, 0);
        if (rc < 0) {
            if (errno == EINTR)
                continue;
            if (errno == EAGAIN || errno == EBUSY) {
                /* no memory for requests, or completions to reap first: wait for one */
                if (__atomic_load_n(r->cq_tail, __ATOMIC_ACQUIRE) != *r->cq_head)
                    return 0;
                rc = syscall(SYS_io_uring_enter, r->fd, 0, 1u, IORING_ENTER_GETEVENTS,
                             NULL, 0);
                if (rc < 0 && errno != EINTR)
                    return -errno;
                continue;
            }
            return -errno;
        }
        if (rc > 0 && (unsigned)rc < queued && !wait)
            continue; /* a request failed to prepare: it has its completion; go on */
        return 0;
    }
}

/* -- per-thread ring -------------------------------------------------------------------- */

static pthread_key_t mpt_ring_key;
static __thread struct mpt_ring *mpt_thread_ring;
static __thread int mpt_thread_ring_state; /* 0 untried, 1 ready, -1 unavailable */

static void mpt_ring_release(void *ring)
{
    struct mpt_ring *r = ring;
    if (r != NULL && r->pid == getpid()) {
        mpt_ring_free(r);
        free(r);
    }
}

/* pthread_atfork, in the child: close the forking thread's inherited ring now, while its
 * number is still the ring's. Closed later (mpt_ring, at the child's first batch) it may
 * be a descriptor the child has opened since under the same number (a daemon closes what
 * it inherited and opens its own files). */
static void mpt_ring_forked(void)
{
    if (mpt_thread_ring != NULL && mpt_thread_ring->fd >= 0) {
        close(mpt_thread_ring->fd);
        mpt_thread_ring->fd = -1; /* mpt_ring() frees the rest; it closes nothing more */
    }
}

/* Registered when the library is loaded, before any thread can fork with a ring. */
__attribute__((constructor)) static void mpt_ring_at_load(void)
{
    (void)pthread_atfork(NULL, NULL, mpt_ring_forked);
}

static const uint8_t mpt_uring_ops[] = {IORING_OP_OPENAT2, IORING_OP_OPENAT,
                                        IORING_OP_STATX, IORING_OP_MKDIRAT,
                                        IORING_OP_READ, IORING_OP_WRITE};
static const char *const mpt_uring_op_names[] = {"OPENAT2", "OPENAT", "STATX",
                                                 "MKDIRAT", "READ", "WRITE"};

static void mpt_uring_probe(void)
{
    struct mpt_ring r;
    size_t size = sizeof(struct io_uring_probe) + 256 * sizeof(struct io_uring_probe_op);
    struct io_uring_probe *probe;
    FILE *f;
    int disabled = 0;

    (void)pthread_key_create(&mpt_ring_key, mpt_ring_release);
    f = fopen("/proc/sys/kernel/io_uring_disabled", "re");
    if (f != NULL) {
        if (fscanf(f, "%d", &disabled) != 1)
            disabled = 0;
        fclose(f);
    }
    if (disabled == 2) {
        snprintf(mpt_uring_why, sizeof mpt_uring_why,
                 "io_uring is disabled (kernel.io_uring_disabled = 2)");
        return;
    }
    if (mpt_ring_init(&r, mpt_uring_why, sizeof mpt_uring_why) != 0)
        return;
    probe = calloc(1, size);
    if (probe == NULL ||
        syscall(SYS_io_uring_register, r.fd, IORING_REGISTER_PROBE, probe, 256) < 0) {
        snprintf(mpt_uring_why, sizeof mpt_uring_why, "io_uring probe: %s",
                 strerror(probe == NULL ? ENOMEM : errno));
    } else {
        size_t k;
        for (k = 0; k < sizeof mpt_uring_ops; k++) {
            uint8_t op = mpt_uring_ops[k];
            if (op > probe->last_op || op >= probe->ops_len ||
                !(probe->ops[op].flags & IO_URING_OP_SUPPORTED)) {
                snprintf(mpt_uring_why, sizeof mpt_uring_why,
                         "io_uring lacks IORING_OP_%s", mpt_uring_op_names[k]);
                break;
            }
        }
        if (k == sizeof mpt_uring_ops) {
            mpt_uring_ok = 1;
            snprintf(mpt_uring_why, sizeof mpt_uring_why, "io_uring");
        }
    }
    free(probe);
    mpt_ring_free(&r);
}

/* This thread's ring, or NULL: use the loop. */
static struct mpt_ring *mpt_ring(void)
{
    struct mpt_ring *r = mpt_thread_ring;
    char why[128];

    pthread_once(&mpt_uring_once, mpt_uring_probe);
    if (!mpt_uring_ok)
        return NULL;
    if (r != NULL && r->pid != getpid()) {
        /* inherited through fork: the parent's ring; drop our copy, make our own */
        mpt_ring_free(r);
        free(r);
        (void)pthread_setspecific(mpt_ring_key, NULL);
        mpt_thread_ring = r = NULL;
        mpt_thread_ring_state = 0;
    }
    if (mpt_thread_ring_state == 0) {
        r = calloc(1, sizeof *r);
        mpt_thread_ring_state = -1;
        if (r == NULL)
            return NULL;
        if (mpt_ring_init(r, why, sizeof why) != 0) {
            free(r);
            return NULL;
        }
        r->jobs = calloc(MPT_URING_DEPTH, sizeof *r->jobs);
        if (r->jobs == NULL) {
            mpt_ring_free(r);
            free(r);
            return NULL;
        }
        mpt_thread_ring = r;
        mpt_thread_ring_state = 1;
        (void)pthread_setspecific(mpt_ring_key, r); /* freed at thread exit */
    }
    return mpt_thread_ring_state == 1 ? mpt_thread_ring : NULL;
}

/* -- one block's state machine ------------------------------------------------------ */

struct mpt_ubatch {
    struct mpt_ring *r;
    struct mpt_batch *b;
    int store;
    size_t len;
    unsigned inflight;
};

static struct mpt_job *mpt_job_of(struct mpt_ubatch *u, size_t i)
{
    return &u->r->jobs[i % MPT_URING_DEPTH];
}

static void mpt_close_fd(int *fd)
{
    if (*fd >= 0)
        close(*fd);
    *fd = -1;
}

/* Give back what the block holds: its descriptors and its temporary file (a failed or
 * abandoned store never leaves one behind). */
static void mpt_release(struct mpt_ubatch *u, struct mpt_job *j)
{
    mpt_close_fd(&j->fd);
    if (j->named) {
        mpt_unlink_temp(u->b, j->dirfd, j->name);
        j->named = 0;
    }
    if (j->cur != u->b->root)
        mpt_close_fd(&j->cur);
    j->cur = -1;
    if (j->dirfd != u->b->root)
        mpt_close_fd(&j->dirfd);
    j->dirfd = -1;
}

static void mpt_fail(struct mpt_job *j, int rc)
{
    j->state = MPT_FAILED;
    j->rc = rc;
}

static void mpt_slow(struct mpt_ubatch *u, struct mpt_job *j, int direct)
{
    mpt_release(u, j);
    j->state = MPT_SLOW;
    j->slow_direct = (uint8_t)direct;
}

static void mpt_queue(struct mpt_ubatch *u, struct mpt_job *j, size_t i, int state,
                      uint8_t opcode, int fd, const void *addr, unsigned len, uint64_t off)
{
    struct io_uring_sqe *s = mpt_sqe(u->r, i);
    s->opcode = opcode;
    s->fd = fd;
    s->addr = (uint64_t)(uintptr_t)addr;
    s->len = len;
    s->off = off;
    j->state = (uint8_t)state;
    u->inflight++;
}

static void mpt_queue_read(struct mpt_ubatch *u, struct mpt_job *j, size_t i)
{
    mpt_queue(u, j, i, MPT_L_READ, IORING_OP_READ, j->fd, j->p + j->done,
              (unsigned)(u->len - j->done), j->done);
}

static void mpt_queue_write(struct mpt_ubatch *u, struct mpt_job *j, size_t i)
{
    mpt_queue(u, j, i, MPT_S_WRITE, IORING_OP_WRITE, j->fd, j->p + j->done,
              (unsigned)(u->len - j->done), j->done);
}

/* An OPENAT2's how, with the loop's resolve flags (resolve.c): the open can neither
 * leave the root nor follow a link. It must live until the ring has taken the request. */
static void mpt_how_beneath(struct mpt_open_how *how, int oflags)
{
    how->flags = (uint64_t)(oflags | O_NOFOLLOW | O_CLOEXEC);
    how->mode = 0;
    how->resolve = MPT_RESOLVE_BENEATH | MPT_RESOLVE_NO_SYMLINKS;
}

/* An OPENAT2 of path beneath dirfd with the loop's resolve rules (mpt_how_beneath),
 * queued under user_data: a batch's opens and a lookup's. how must outlive the request. */
static void mpt_sqe_openat2(struct mpt_ring *r, uint64_t user_data, int dirfd,
                            const char *path, struct mpt_open_how *how, int oflags)
{
    struct io_uring_sqe *s = mpt_sqe(r, user_data);
    mpt_how_beneath(how, oflags);
    s->opcode = IORING_OP_OPENAT2;
    s->fd = dirfd;
    s->addr = (uint64_t)(uintptr_t)path;
    s->len = sizeof *how;
    s->addr2 = (uint64_t)(uintptr_t)how;
}

static void mpt_queue_openat2(struct mpt_ubatch *u, struct mpt_job *j, size_t i, int state,
                              const char *path, int oflags)
{
    mpt_sqe_openat2(u->r, i, u->b->root, path, &j->how, oflags);
    j->state = (uint8_t)state;
    u->inflight++;
}

static void mpt_queue_openat(struct mpt_ubatch *u, struct mpt_job *j, size_t i, int state,
                             int dirfd, const char *name, int oflags, unsigned mode)
{
    struct io_uring_sqe *s;
    mpt_queue(u, j, i, state, IORING_OP_OPENAT, dirfd, name, mode, 0);
    s = &u->r->sqes[(u->r->tail - 1) & *u->r->sq_mask];
    s->open_flags = (uint32_t)(oflags | O_CLOEXEC);
}

/* The folder walk's current component (store): copied into j->name; 0, or -errno. */
static int mpt_component(struct mpt_job *j)
{
    const char *c = j->dir + j->comp, *slash = strchr(c, '/');
    size_t clen = slash == NULL ? strlen(c) : (size_t)(slash - c);
    if (clen == 0 || clen > NAME_MAX || (clen == 2 && c[0] == '.' && c[1] == '.'))
        return -EINVAL; /* the walk decides (EXDEV, ENAMETOOLONG) */
    memcpy(j->name, c, clen);
    j->name[clen] = '\0';
    return 0;
}

static void mpt_queue_mkdir(struct mpt_ubatch *u, struct mpt_job *j, size_t i)
{
    if (mpt_component(j) != 0) {
        mpt_slow(u, j, j->direct);
        return;
    }
    mpt_queue(u, j, i, MPT_S_MKDIR, IORING_OP_MKDIRAT, j->cur, j->name, 0777, 0);
}

static void mpt_queue_stat(struct mpt_ubatch *u, struct mpt_job *j, size_t i)
{
    struct io_uring_sqe *s;
    j->tries = 0; /* the walk's count is done with; the temporary names' starts */
    mpt_queue(u, j, i, MPT_S_STAT, IORING_OP_STATX, j->dirfd, j->leaf,
              STATX_TYPE | STATX_SIZE, 0);
    s = &u->r->sqes[(u->r->tail - 1) & *u->r->sq_mask];
    s->statx_flags = AT_SYMLINK_NOFOLLOW | AT_STATX_SYNC_AS_STAT;
    s->addr2 = (uint64_t)(uintptr_t)&j->stx;
}

/* Open the temporary file: O_TMPFILE where asked (and not refused here), else named. */
static void mpt_queue_temp(struct mpt_ubatch *u, struct mpt_job *j, size_t i)
{
    int direct = j->direct ? O_DIRECT : 0, rc;
    if (j->tmpfile) {
        mpt_queue_openat(u, j, i, MPT_S_OPEN, j->dirfd, ".", O_TMPFILE | O_WRONLY | direct,
                         0644);
        return;
    }
    rc = mpt_temp_name(j->name, sizeof j->name, j->leaf, u->b->tag);
    if (rc != 0) {
        mpt_fail(j, rc);
        return;
    }
    j->named = 1; /* from here on a file by this name may exist: release removes it */
    mpt_queue_openat(u, j, i, MPT_S_OPEN, j->dirfd, j->name,
                     O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | direct, 0644);
}

/* The loop's checks on an opened block (mpt_load_one), then its read. */
static void mpt_opened_for_load(struct mpt_ubatch *u, struct mpt_job *j, size_t i, int fd)
{
    struct stat st;
    int rc = 0;

    if (fd < 0) {
        if (fd == -ELOOP || fd == -EAGAIN)
            mpt_slow(u, j, j->direct); /* the walk finds and removes the link */
        else if (fd == -EINVAL && j->direct)
            mpt_slow(u, j, 0); /* O_DIRECT refused: the block goes buffered */
        else
            mpt_fail(j, fd == -ENXIO || fd == -ENODEV ? -EMEDIUMTYPE : fd);
        return;
    }
    j->fd = fd;
    if (fstat(fd, &st) != 0)
        rc = -errno;
    else if (!S_ISREG(st.st_mode))
        rc = -EMEDIUMTYPE;
    else if ((uint64_t)st.st_size > u->len)
        rc = -EFBIG;
    else if ((uint64_t)st.st_size < u->len)
        rc = -ENODATA, j->remove = 1;
    else if (fcntl(fd, F_SETFL, j->direct ? O_DIRECT : 0) != 0)
        rc = -errno;
    else if ((u->b->flags & MPT_CHECKSUM) &&
             (rc = mpt_record_of(fd, &j->want, &j->present)) != 0)
        j->remove = rc == -EBADMSG;
    if (rc != 0) {
        mpt_fail(j, rc);
        return;
    }
    j->present = (u->b->flags & MPT_CHECKSUM) ? j->present : 0;
    mpt_queue_read(u, j, i);
}

/* Start block i: the first step of its machine. */
static void mpt_start(struct mpt_ubatch *u, size_t i, const char *rel, const char *dir,
                      const char *leaf, char *p)
{
    struct mpt_job *j = mpt_job_of(u, i);
    memset(j, 0, offsetof(struct mpt_job, how));
    j->fd = j->dirfd = j->cur = -1;
    j->rel = rel;
    j->dir = dir;
    j->leaf = leaf;
    j->dst = p;
    if (u->b->bounce != NULL) { /* I/O from or into a private slot */
        p = u->b->bounce + (i % u->b->bounce_blocks) * u->len;
        /* written from there: its pages are the bounce buffer's, not ours; the record's
         * CRC taken as the copy goes, over exactly the bytes written */
        if (u->store && (u->b->flags & MPT_CHECKSUM)) {
            j->crc = mpt_crc32c_copy(0, p, j->dst, u->len);
            j->crc_done = 1;
        } else if (u->store) {
            memcpy(p, j->dst, u->len);
        }
    } /* a bounced load's read lands there, and mpt_finish copies it over */
    j->p = p;
    j->direct = (uint8_t)mpt_direct_ok(u->b->flags, p, u->len);
    j->tmpfile = (u->b->flags & MPT_TMPFILE) != 0;
    if (!u->store) {
        mpt_queue_openat2(u, j, i, MPT_L_OPEN, rel,
                          O_RDONLY | O_NONBLOCK | O_NOCTTY | (j->direct ? O_DIRECT : 0));
    } else if (dir[0] == '\0') {
        j->dirfd = u->b->root;
        mpt_queue_stat(u, j, i);
    } else {
        mpt_queue_openat2(u, j, i, MPT_S_FOLDER, dir, O_PATH | O_DIRECTORY);
    }
}

/* A request of block i completed with res: the next step. */
static void mpt_advance(struct mpt_ubatch *u, size_t i, int res)
{
    struct mpt_job *j = mpt_job_of(u, i);

    switch (j->state) {
    case MPT_L_OPEN:
        mpt_opened_for_load(u, j, i, res);
        return;
    case MPT_L_READ:
    case MPT_S_WRITE:
        if (res < 0) {
            if (res == -EINVAL && j->direct)
                mpt_slow(u, j, 0); /* O_DIRECT refused: the block goes buffered */
            else if (u->store)
                mpt_release(u, j), mpt_fail(j, res == -EAGAIN ? -EIO : res);
            else
                mpt_fail(j, res);
        } else if (res == 0) {
            if (u->store)
                mpt_release(u, j), mpt_fail(j, -EIO);
            else
                mpt_fail(j, -ENODATA), j->remove = 1; /* shrank while we read */
        } else if ((j->done += (size_t)res) < u->len) {
            if (u->store)
                mpt_queue_write(u, j, i);
            else
                mpt_queue_read(u, j, i);
        } else {
            j->state = MPT_READY;
        }
        return;
    case MPT_S_FOLDER:
        if (res >= 0) {
            j->dirfd = res;
            mpt_queue_stat(u, j, i);
        } else if (res == -ENOENT) {
            /* a folder to make: each component made (EEXIST is fine), then opened
             * without following a link, relative to the last -- as the walk does */
            j->cur = u->b->root;
            j->comp = 0;
            mpt_queue_mkdir(u, j, i);
        } else {
            mpt_slow(u, j, j->direct); /* a symlink on the way, a file in the way... */
        }
        return;
    case MPT_S_MKDIR:
        j->made = res == 0;
        if (res == 0 || res == -EEXIST)
            mpt_queue_openat(u, j, i, MPT_S_WALK, j->cur, j->name,
                             O_PATH | O_DIRECTORY | O_NOFOLLOW, 0);
        else
            mpt_slow(u, j, j->direct);
        return;
    case MPT_S_WALK:
        if (res < 0) {
            if (res == -ENOENT && ++j->tries <= MPT_MKDIR_TRIES)
                mpt_queue_mkdir(u, j, i); /* removed again meanwhile: make it again */
            else
                mpt_slow(u, j, j->direct);
            return;
        }
        if (j->cur != u->b->root)
            close(j->cur);
        j->cur = res;
        j->comp += strlen(j->name);
        if (j->dir[j->comp] == '/') {
            j->comp++;
            mpt_queue_mkdir(u, j, i);
            return;
        }
        j->dirfd = j->cur;
        j->cur = -1;
        if (j->made)
            mpt_queue_temp(u, j, i); /* its folder is new: nothing to find (the loop's rule) */
        else
            mpt_queue_stat(u, j, i);
        return;
    case MPT_S_STAT:
        if (res == -ENOENT) {
            mpt_queue_temp(u, j, i);
        } else if (res == 0 && S_ISREG(j->stx.stx_mode) && j->stx.stx_size == u->len) {
            j->state = MPT_EXISTS; /* names are content hashes: it holds this block */
        } else {
            mpt_slow(u, j, j->direct); /* symlink, short, long, not a file: the loop's */
        }
        return;
    case MPT_S_OPEN:
        if (res >= 0) {
            j->fd = res;
            mpt_queue_write(u, j, i);
        } else if (j->tmpfile && (res == -EOPNOTSUPP || res == -EISDIR || res == -EINVAL)) {
            j->tmpfile = 0; /* no O_TMPFILE here (or not with O_DIRECT): a named file */
            mpt_queue_temp(u, j, i);
        } else if (res == -EEXIST && j->named && ++j->tries < MPT_NAME_TRIES) {
            j->named = 0; /* someone else's name: take the next counter */
            mpt_queue_temp(u, j, i);
        } else if (res == -EINVAL && j->direct) {
            mpt_slow(u, j, 0); /* release removes a file the kernel made before refusing */
        } else {
            j->named = 0; /* nothing was made under the name */
            mpt_slow(u, j, j->direct);
        }
        return;
    default:
        mpt_slow(u, j, j->direct); /* cannot happen: be safe, not fast */
    }
}

/* Block i's outcome, in batch order: 0 (done) or -errno. */
static int mpt_finish(struct mpt_ubatch *u, size_t i)
{
    struct mpt_job *j = mpt_job_of(u, i);
    struct mpt_batch *b = u->b;
    int rc = 0;

    switch (j->state) {
    case MPT_SLOW:
        mpt_release(u, j);
        b->found_one = 0;
        rc = u->store ? mpt_store_one(b, j->rel, j->p, u->len, j->slow_direct)
                      : mpt_load_one(b, j->rel, j->p, u->len, j->slow_direct);
        if (rc == -EINVAL && j->slow_direct)
            rc = u->store ? mpt_store_one(b, j->rel, j->p, u->len, 0)
                          : mpt_load_one(b, j->rel, j->p, u->len, 0);
        if (rc == 0 && !u->store && j->dst != j->p)
            mpt_copy_to_slot(j->dst, j->p, u->len); /* bounced: the read has returned */
        if (rc == 0 && u->store && b->found != NULL)
            b->found[i] = (uint8_t)b->found_one;
        break;
    case MPT_FAILED:
        rc = j->rc;
        if (j->remove && j->fd >= 0)
            mpt_remove_if_same_fd(b->root, j->rel, b->flags, j->fd);
        break;
    case MPT_EXISTS:
        if (b->flags & MPT_TOUCH)
            mpt_touch_at(j->dirfd, j->leaf);
        if (b->found != NULL)
            b->found[i] = 1;
        break;
    case MPT_READY:
        if (!u->store) {
            if (j->present && !j->crc_done)
                j->crc = mpt_crc32c(0, j->p, u->len, MPT_CRC32C_BEST);
            if (j->present && j->crc != j->want) {
                rc = -EBADMSG;
                mpt_remove_if_same_fd(b->root, j->rel, b->flags, j->fd);
            } else {
                if (j->dst != j->p) /* bounced: the read has returned; later ones fly on */
                    mpt_copy_to_slot(j->dst, j->p, u->len);
                if (b->flags & MPT_TOUCH)
                    mpt_touch(j->fd);
            }
            break;
        }
        if (b->flags & MPT_CHECKSUM) {
            if (!j->crc_done)
                j->crc = mpt_crc32c(0, j->p, u->len, MPT_CRC32C_BEST);
            rc = mpt_set_record(j->fd, j->crc);
        }
        if (rc == 0 && j->named) {
            rc = close(j->fd) == 0 ? 0 : -errno; /* a network fs may report a write here */
            j->fd = -1;
            if (rc == 0) {
                if (renameat(j->dirfd, j->name, j->dirfd, j->leaf) == 0)
                    j->named = 0; /* published: nothing left to remove */
                else
                    rc = errno == EEXIST ? 0 : -errno; /* EEXIST: another writer won */
            }
        } else if (rc == 0) {
            rc = mpt_link_tmpfile(j->fd, j->dirfd, j->leaf);
            if (rc == -EEXIST)
                rc = 0; /* another writer published it */
            if (close(j->fd) != 0 && rc == 0)
                rc = -errno;
            j->fd = -1;
        }
        if (rc == -ENOENT) { /* the folder was removed under us: the loop makes it again */
            j->slow_direct = j->direct;
            j->state = MPT_SLOW;
            return mpt_finish(u, i);
        }
        break;
    default:
        return -EIO; /* not terminal: a bug, never reached */
    }
    mpt_release(u, j);
    j->state = MPT_FREE;
    return rc;
}

static int mpt_terminal(const struct mpt_job *j)
{
    return j->state >= MPT_READY;
}

/* Whether block `started` of n may start: its slot is free (depth) and, for a bounced
 * load in waves, fewer than `wave` blocks of [finished, started) are still in the ring. */
static int mpt_may_start(struct mpt_ubatch *u, size_t finished, size_t started, size_t n,
                         size_t depth, size_t wave)
{
    size_t flying = 0;
    if (started >= n || started >= finished + depth)
        return 0;
    for (size_t i = finished; wave != 0 && i < started; i++)
        flying += !mpt_terminal(mpt_job_of(u, i));
    return wave == 0 || flying < wave;
}

/* Reap every completion there is; the number reaped. */
static unsigned mpt_reap(struct mpt_ubatch *u)
{
    struct mpt_ring *r = u->r;
    unsigned head = *r->cq_head, tail = __atomic_load_n(r->cq_tail, __ATOMIC_ACQUIRE), k = 0;

    for (; head != tail; head++, k++) {
        struct io_uring_cqe *c = &r->cqes[head & *r->cq_mask];
        u->inflight--;
        mpt_advance(u, (size_t)c->user_data, c->res);
    }
    __atomic_store_n(r->cq_head, head, __ATOMIC_RELEASE);
    return k;
}

/* Stores with checksums: CRC the blocks whose writes are in flight, while the device
 * reads them (mpt_finish sets the record from it before publishing). */
static void mpt_crc_in_flight(struct mpt_ubatch *u, size_t from, size_t to)
{
    for (size_t i = from; i < to; i++) {
        struct mpt_job *j = mpt_job_of(u, i);
        if ((j->state == MPT_S_WRITE || j->state == MPT_READY) && !j->crc_done) {
            j->crc = mpt_crc32c(0, j->p, u->len, MPT_CRC32C_BEST);
            j->crc_done = 1;
            return; /* one per wake-up: completions are waiting to be handled too */
        }
    }
}

/* Loads with checksums: CRC a later block whose read has arrived while the next block
 * in batch order is still being read (mpt_finish compares it with the record, in order).
 * Without it every CRC ran after its block's turn came, the last ones of a task with
 * nothing left in flight. */
static void mpt_crc_arrived(struct mpt_ubatch *u, size_t from, size_t to)
{
    for (size_t i = from; i < to; i++) {
        struct mpt_job *j = mpt_job_of(u, i);
        if (j->state == MPT_READY && j->present && !j->crc_done) {
            j->crc = mpt_crc32c(0, j->p, u->len, MPT_CRC32C_BEST);
            j->crc_done = 1;
            return; /* one per wake-up, as for stores */
        }
    }
}

/* Wait until every request of the batch has completed (and been reaped), the end of a
 * failed batch: no read may land in a slot, no file appear, and no completion be left for
 * the next batch to take for its own blocks (a mkdir's 0 read as a descriptor, a write's
 * length as a read's). io_uring_enter failing here (no memory in the kernel) is tried
 * again until it answers (MPT_DRAIN_TRIES), and the thread leaves its ring for the loop
 * from then on. */
/* io_uring_enter failed while requests are in the ring: this thread takes the loop from
 * now on (the ring stays allocated: it may be in use), and waits tries ms before asking
 * the ring again, one more each time up to MPT_DRAIN_TRIES. */
static void mpt_ring_failed_pause(unsigned *tries)
{
    struct timespec pause = {0, 0};
    if (*tries < MPT_DRAIN_TRIES)
        (*tries)++;
    mpt_thread_ring_state = -1;
    pause.tv_nsec = (long)*tries * 1000000L;
    nanosleep(&pause, NULL);
}

static void mpt_drain(struct mpt_ubatch *u)
{
    unsigned tries = 0;
    while (u->inflight > 0) {
        if (mpt_enter(u->r, 1) == 0) {
            mpt_reap(u);
            continue;
        }
        mpt_ring_failed_pause(&tries);
    }
}

/* How many of a bounced load's blocks are in flight at once (0: no limit but depth):
 * half its bounce slots, and at most half the batch, so that even a task the bounce
 * buffer holds whole has a second wave to send while the first is copied. */
static size_t mpt_wave(int store, const struct mpt_batch *b, size_t n, size_t depth)
{
    size_t wave = depth / MPT_WAVE_SHARE, half = (n + 1) / MPT_WAVE_SHARE;
    if (store || b->bounce == NULL || (b->flags & MPT_WHOLE_BOUNCE))
        return 0;
    if (half < wave)
        wave = half;
    return wave > 0 ? wave : 1;
}

/* Two loads into overlapping memory would race in the ring; the loop orders them. */
static int mpt_overlapping(const uint64_t *offsets, size_t n, size_t len)
{
    uint64_t *sorted;
    int overlap = 0;
    if (n > 64) {
        sorted = malloc(n * sizeof *sorted);
        if (sorted == NULL)
            return 1;
        memcpy(sorted, offsets, n * sizeof *sorted);
        for (size_t i = 1; i < n; i++) { /* insertion sort: batches are short */
            uint64_t v = sorted[i];
            size_t k = i;
            for (; k > 0 && sorted[k - 1] > v; k--)
                sorted[k] = sorted[k - 1];
            sorted[k] = v;
        }
        for (size_t i = 1; i < n && !overlap; i++)
            overlap = sorted[i] - sorted[i - 1] < len;
        free(sorted);
        return overlap;
    }
    for (size_t i = 0; i < n && !overlap; i++)
        for (size_t k = i + 1; k < n && !overlap; k++)
            overlap = (offsets[i] > offsets[k] ? offsets[i] - offsets[k]
                                               : offsets[k] - offsets[i]) < len;
    return overlap;
}

int mpt_uring_batch(int store, struct mpt_batch *b, const char *paths_blob, size_t n,
                    char *base, const uint64_t *offsets, size_t block_bytes, size_t *n_done,
                    size_t *fail_index)
{
    struct mpt_ubatch u = {NULL, b, store, block_bytes, 0};
    /* a bounced batch keeps at most one block in flight per bounce slot */
    size_t depth = b->bounce != NULL && b->bounce_blocks < MPT_URING_DEPTH
                   ? b->bounce_blocks : MPT_URING_DEPTH;
    /* A bounced load reads in waves: the next goes to the device as the last returns,
     * before its copies (MPT_WAVE_SHARE) */
    size_t wave = mpt_wave(store, b, n, depth);
    const char *path = paths_blob;
    char *split = NULL, *split_at = NULL; /* store: "<dir>\0<leaf>\0" per path */
    size_t started = 0, finished = 0, blob_len = 0, mapped = 0;
    int rc = 0, broken = 0;

    /* Paths resolve with OPENAT2 in the ring: every kernel with the operations used here
     * has openat2, so MPT_NO_OPENAT2 (the walk, for tests) means the loop. */
    if (n < MPT_URING_MIN_BLOCKS || block_bytes > UINT32_MAX / 2 ||
        !mpt_use_openat2(b->flags) ||
        (!store && b->bounce == NULL && mpt_overlapping(offsets, n, block_bytes)))
        return MPT_NO_URING;
    u.r = mpt_ring();
    if (u.r == NULL)
        return MPT_NO_URING;
    if (store) {
        for (size_t i = 0; i < n; i++)
            blob_len += strlen(paths_blob + blob_len) + 1;
        split = malloc(blob_len + n); /* room for "" before a bare name's leaf */
        if (split == NULL)
            return MPT_NO_URING;
        split_at = split;
    }
    *n_done = 0;
    *fail_index = n;
    while (finished < n) {
        /* start blocks, in order, while there is room */
        while (!broken && mpt_may_start(&u, finished, started, n, depth, wave)) {
            const char *dir = "", *leaf = path;
            size_t plen = strlen(path);
            if (store) {
                const char *slash = strrchr(path, '/');
                memcpy(split_at, path, plen + 1);
                if (slash != NULL) {
                    split_at[slash - path] = '\0';
                    dir = split_at;
                    leaf = split_at + (slash - path) + 1;
                    split_at += plen + 1;
                } else {
                    split_at[0] = '\0';
                    memcpy(split_at + 1, path, plen + 1);
                    dir = split_at;
                    leaf = split_at + 1;
                    split_at += plen + 2;
                }
            }
            mpt_start(&u, started, path, dir, leaf, base + offsets[started]);
            path += plen + 1;
            started++;
        }
        /* hand the new requests over; wait only when the next block is not done */
        if (!broken && !store && b->bounce != NULL && mapped < started) {
            /* bounced: the new reads go to the device first, then, while they fly, the
             * slots they will be copied to are mapped (mpt_map_slot) -- the work a
             * direct read's pinning does at submission, instead of one fault per page
             * in the copy with nothing in flight behind the last block */
            if (mpt_enter(u.r, 0) != 0)
                broken = 1;
            else
                mpt_reap(&u);
            for (; !broken && mapped < started; mapped++)
                mpt_map_slot(mpt_job_of(&u, mapped)->dst, u.len);
        }
        if (!broken) {
            struct mpt_job *next = mpt_job_of(&u, finished);
            int wait = !mpt_terminal(next) && u.inflight > 0;
            if ((b->flags & MPT_CHECKSUM) && store && wait) {
                if (mpt_enter(u.r, 0) != 0)
                    broken = 1;
                mpt_crc_in_flight(&u, finished, started);
            } else if ((b->flags & MPT_CHECKSUM) && wait) {
                /* take what has arrived, CRC one of the later blocks instead of idling */
                if (mpt_enter(u.r, 0) != 0)
                    broken = 1;
                else
                    mpt_reap(&u);
                mpt_crc_arrived(&u, finished + 1, started);
                wait = !mpt_terminal(next) && u.inflight > 0;
            }
            if (!broken && mpt_enter(u.r, wait) != 0)
                broken = 1;
            if (!broken)
                mpt_reap(&u);
            if (!broken && wave != 0 && mpt_may_start(&u, finished, started, n, depth, wave))
                continue; /* a wave returned: the next one to the device, then copy */
        }
        if (broken) {
            /* io_uring_enter failed (short of a kernel bug: no memory). Wait out what is
             * in flight, give everything back, fail the batch at the next block, and
             * let this thread use the loop from now on. */
            mpt_drain(&u);
            for (size_t i = finished; i < started; i++) {
                mpt_release(&u, mpt_job_of(&u, i));
                mpt_job_of(&u, i)->state = MPT_FREE;
            }
            mpt_thread_ring_state = -1; /* the ring stays allocated: it may be in use */
            rc = -EIO;
            *fail_index = finished;
            break;
        }
        while (finished < started && mpt_terminal(mpt_job_of(&u, finished))) {
            rc = mpt_finish(&u, finished);
            if (rc != 0)
                break;
            finished++;
            *n_done = finished;
        }
        if (rc != 0) {
            *fail_index = finished;
            break;
        }
    }
    if (rc != 0 && !broken) {
        /* let every request end before anything is given back: no read may land in a
         * slot, and no file appear, after the caller hears of the batch */
        mpt_drain(&u);
        for (size_t i = finished + 1; i < started; i++) {
            struct mpt_job *j = mpt_job_of(&u, i);
            mpt_release(&u, j);
            j->state = MPT_FREE;
        }
    }
    free(split);
    return rc;
}

/* -- lookups ---------------------------------------------------------------------------- */

/* A lookup's keys in the ring at once: each an OPENAT2 (O_PATH) of the block, with the
 * loop's resolve flags, answered by the loop's rules (mpt_lookup_opened) as its
 * descriptor comes back. A cold key costs a read or two of metadata (its folders, its
 * inode): one after another in the loop, with nothing else of the worker's on the device
 * meanwhile (docs/performance.md, section 21). An open the kernel cannot do without
 * waiting goes to io_uring's helper threads, so the reads go to the device together.
 * Only a descriptor, ENOENT and ENOTDIR are answered from the ring; any other failure is
 * the loop's to redo, one key at a time: ELOOP (its walk finds and removes the link),
 * EAGAIN (a race the kernel would not judge), EINTR (the loop retries it), EMFILE and
 * ENFILE (the ring holds up to MPT_URING_DEPTH descriptors at once; near the process's
 * limit the loop's one would still fit, and a present key must not answer absent). */
struct mpt_lookup_slot {
    size_t key;            /* which of the batch's keys */
    const char *rel;
    struct mpt_open_how how;
};

/* Answer the keys whose opens have come back, and give their slots back. */
static void mpt_lookup_reap(struct mpt_ring *r, struct mpt_lookup_slot *slots,
                            unsigned *free_slots, unsigned *n_free, int root,
                            size_t block_bytes, int flags, uint8_t *out)
{
    unsigned head = *r->cq_head, tail = __atomic_load_n(r->cq_tail, __ATOMIC_ACQUIRE);
    for (; head != tail; head++) {
        struct io_uring_cqe *c = &r->cqes[head & *r->cq_mask];
        struct mpt_lookup_slot *s = &slots[c->user_data];
        out[s->key] = c->res >= 0 || c->res == -ENOENT || c->res == -ENOTDIR
                      ? mpt_lookup_opened(root, s->rel, c->res, block_bytes, flags)
                      : mpt_lookup_one(root, s->rel, block_bytes, flags);
        free_slots[(*n_free)++] = (unsigned)c->user_data;
    }
    __atomic_store_n(r->cq_head, head, __ATOMIC_RELEASE);
}

int mpt_uring_lookup(int root, const char *paths_blob, size_t n, size_t block_bytes,
                     int flags, uint8_t *out)
{
    struct mpt_lookup_slot slots[MPT_URING_DEPTH];
    unsigned free_slots[MPT_URING_DEPTH], n_free = MPT_URING_DEPTH, tries = 0;
    const char *path = paths_blob;
    struct mpt_ring *r;
    size_t started = 0;
    int broken = 0;

    if (n < MPT_URING_MIN_BLOCKS || !mpt_use_openat2(flags))
        return MPT_NO_URING;
    r = mpt_ring();
    if (r == NULL)
        return MPT_NO_URING;
    for (unsigned k = 0; k < MPT_URING_DEPTH; k++)
        free_slots[k] = MPT_URING_DEPTH - 1 - k;
    while (started < n || n_free < MPT_URING_DEPTH) {
        for (; !broken && started < n && n_free > 0; started++) {
            unsigned k = free_slots[--n_free];
            slots[k].key = started;
            slots[k].rel = path;
            mpt_sqe_openat2(r, k, root, path, &slots[k].how, O_PATH);
            path += strlen(path) + 1;
        }
        if (n_free == MPT_URING_DEPTH)
            break; /* broken, and nothing left in the ring */
        if (mpt_enter(r, 1) == 0) {
            mpt_lookup_reap(r, slots, free_slots, &n_free, root, block_bytes, flags, out);
            continue;
        }
        /* io_uring_enter failed (no memory in the kernel): wait out what is in the ring,
         * as mpt_drain does, then the loop answers the rest */
        broken = 1;
        mpt_ring_failed_pause(&tries);
    }
    for (; started < n; started++) {
        out[started] = mpt_lookup_one(root, path, block_bytes, flags);
        path += strlen(path) + 1;
    }
    return 0;
}

const char *mpt_uring_status(void)
{
    pthread_once(&mpt_uring_once, mpt_uring_probe);
    return mpt_uring_why;
}

#else /* no io_uring in this build */

int mpt_uring_batch(int store, struct mpt_batch *b, const char *paths_blob, size_t n,
                    char *base, const uint64_t *offsets, size_t block_bytes, size_t *n_done,
                    size_t *fail_index)
{
    (void)store, (void)b, (void)paths_blob, (void)n, (void)base, (void)offsets;
    (void)block_bytes, (void)n_done, (void)fail_index;
    return MPT_NO_URING;
}

int mpt_uring_lookup(int root, const char *paths_blob, size_t n, size_t block_bytes,
                     int flags, uint8_t *out)
{
    (void)root, (void)paths_blob, (void)n, (void)block_bytes, (void)flags, (void)out;
    return MPT_NO_URING;
}

const char *mpt_uring_status(void)
{
    return "io_uring: not in this build (no <linux/io_uring.h> with the needed operations)";
}

#endif
