/*
 * direct.c - checksummed O_DIRECT I/O that checksums while the device transfers.
 *
 * A direct transfer leaves the CPU idle while the device moves the data, and the
 * checksum needs the CPU: done one after the other, the checksum adds its time to every
 * block. Submitted through Linux AIO (io_submit; asynchronous for O_DIRECT on local
 * file systems), the two overlap:
 *
 *   write  submit the whole block, CRC it meanwhile (the device reads the same memory),
 *          then wait
 *   read   submit the block in chunks, MPT_AIO_DEPTH at a time; CRC each chunk, in
 *          order, as soon as it has arrived, while the later ones are in flight
 *
 * Nothing returns while a transfer into the caller's buffer is still in flight: on any
 * error every submitted chunk is waited for first. Where AIO is missing (ENOSYS,
 * seccomp) or refused, the callers fall back to plain synchronous I/O (MPT_NO_AIO).
 * Each thread keeps one AIO context for its life (released at thread exit).
 */

#ifndef _GNU_SOURCE
#define _GNU_SOURCE 1
#endif

#include "mptier_native.h"

#include <errno.h>
#include <linux/aio_abi.h>
#include <pthread.h>
#include <string.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

/* Read chunks in flight at once, and their size: enough to keep a device busy while
 * one chunk is checksummed (a 2 MiB block is four chunks, all submitted at once). */
#define MPT_AIO_DEPTH 8
#define MPT_AIO_CHUNK (512 * 1024)

static pthread_key_t mpt_aio_key;
static pthread_once_t mpt_aio_once = PTHREAD_ONCE_INIT;
static __thread aio_context_t mpt_aio_ctx;
static __thread int mpt_aio_state; /* 0 untried, 1 ready, -1 unavailable */

static void mpt_aio_release(void *unused)
{
    (void)unused;
    if (mpt_aio_state == 1)
        syscall(SYS_io_destroy, mpt_aio_ctx);
    mpt_aio_state = 0;
}

static void mpt_aio_key_init(void)
{
    (void)pthread_key_create(&mpt_aio_key, mpt_aio_release);
}

/* This thread's AIO context, or 0 when AIO cannot be used. */
static aio_context_t mpt_aio(void)
{
    if (mpt_aio_state == 0) {
        pthread_once(&mpt_aio_once, mpt_aio_key_init);
        mpt_aio_ctx = 0;
        if (syscall(SYS_io_setup, MPT_AIO_DEPTH, &mpt_aio_ctx) == 0) {
            mpt_aio_state = 1;
            (void)pthread_setspecific(mpt_aio_key, (void *)1); /* runs the release */
        } else {
            mpt_aio_state = -1;
        }
    }
    return mpt_aio_state == 1 ? mpt_aio_ctx : 0;
}

static int mpt_aio_submit(aio_context_t ctx, struct iocb *cb)
{
    struct iocb *list[1] = {cb};
    long rc;
    do
        rc = syscall(SYS_io_submit, ctx, 1L, list);
    while (rc < 0 && errno == EINTR);
    return rc == 1 ? 0 : rc < 0 ? -errno : -EAGAIN;
}

/* Wait for one completion; its iocb's aio_data says which. */
static int mpt_aio_wait(aio_context_t ctx, struct io_event *ev)
{
    long rc;
    do
        rc = syscall(SYS_io_getevents, ctx, 1L, 1L, ev, NULL);
    while (rc < 0 && errno == EINTR);
    return rc == 1 ? 0 : rc < 0 ? -errno : -EIO;
}

static void mpt_iocb(struct iocb *cb, int opcode, int fd, char *p, size_t len, size_t off,
                     uint64_t tag)
{
    memset(cb, 0, sizeof *cb);
    cb->aio_lio_opcode = (uint16_t)opcode;
    cb->aio_fildes = (uint32_t)fd;
    cb->aio_buf = (uint64_t)(uintptr_t)p;
    cb->aio_nbytes = len;
    cb->aio_offset = (int64_t)off;
    cb->aio_data = tag;
}

int mpt_direct_write_crc(int fd, const char *src, size_t len, uint32_t *crc)
{
    aio_context_t ctx = mpt_aio();
    struct iocb cb;
    struct io_event ev;
    int rc;

    if (ctx == 0)
        return MPT_NO_AIO;
    mpt_iocb(&cb, IOCB_CMD_PWRITE, fd, (char *)src, len, 0, 0);
    rc = mpt_aio_submit(ctx, &cb);
    if (rc != 0)
        return rc == -EINVAL || rc == -ENOSYS || rc == -EAGAIN ? MPT_NO_AIO : rc;
    *crc = mpt_crc32c(0, src, len, MPT_CRC32C_BEST); /* while the device reads it */
    rc = mpt_aio_wait(ctx, &ev);
    if (rc != 0)
        return rc;
    if (ev.res < 0)
        return (int)ev.res;
    if ((size_t)ev.res < len) /* a short direct write: finish it the plain way */
        return mpt_write_at(fd, src + ev.res, len - (size_t)ev.res, (off_t)ev.res);
    return 0;
}

int mpt_direct_read_crc(int fd, char *dst, size_t len, uint32_t *crc)
{
    aio_context_t ctx = mpt_aio();
    struct iocb cbs[MPT_AIO_DEPTH];
    struct io_event ev;
    size_t n = (len + MPT_AIO_CHUNK - 1) / MPT_AIO_CHUNK, next = 0, checked = 0, inflight = 0;
    uint64_t arrived = 0; /* bit i % 64: chunk i has arrived */
    int rc = 0;

    if (ctx == 0)
        return MPT_NO_AIO;
    *crc = 0;
    while (checked < n) {
        while (rc == 0 && next < n && inflight < MPT_AIO_DEPTH) {
            size_t off = next * MPT_AIO_CHUNK;
            size_t part = len - off < MPT_AIO_CHUNK ? len - off : MPT_AIO_CHUNK;
            struct iocb *cb = &cbs[next % MPT_AIO_DEPTH];
            mpt_iocb(cb, IOCB_CMD_PREAD, fd, dst + off, part, off, next);
            rc = mpt_aio_submit(ctx, cb);
            if (rc != 0) {
                if (next == 0 && (rc == -EINVAL || rc == -ENOSYS || rc == -EAGAIN))
                    return MPT_NO_AIO; /* nothing in flight yet */
                break;
            }
            next++;
            inflight++;
        }
        if (rc != 0)
            break;
        while (!(arrived >> (checked % 64) & 1)) {
            size_t i, want;
            rc = mpt_aio_wait(ctx, &ev);
            if (rc != 0)
                break;
            inflight--;
            i = (size_t)ev.data;
            want = len - i * MPT_AIO_CHUNK < MPT_AIO_CHUNK ? len - i * MPT_AIO_CHUNK
                                                           : MPT_AIO_CHUNK;
            if (ev.res < 0 || (size_t)ev.res < want) {
                rc = ev.res < 0 ? (int)ev.res : -ENODATA; /* shrank under us */
                break;
            }
            arrived |= (uint64_t)1 << (i % 64);
        }
        if (rc != 0)
            break;
        {
            size_t off = checked * MPT_AIO_CHUNK;
            size_t part = len - off < MPT_AIO_CHUNK ? len - off : MPT_AIO_CHUNK;
            *crc = mpt_crc32c(*crc, dst + off, part, MPT_CRC32C_BEST);
            arrived &= ~((uint64_t)1 << (checked % 64));
            checked++;
        }
    }
    while (inflight > 0) { /* never leave a transfer into dst running */
        if (mpt_aio_wait(ctx, &ev) != 0)
            break;
        inflight--;
    }
    return rc;
}
