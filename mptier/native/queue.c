/*
 * queue.c - a worker's take of one task record from its queues, in one call.
 *
 * The serving loop (mptier.workers.serving) reads a whole record from the first of its
 * queues (non-blocking pipes: lookups, its own priority's, the other) that holds one,
 * then asks whether any queue still holds a record, to ring the doorbell for another
 * worker. In Python that was a readv per queue tried (an exception for each empty one)
 * and a FIONREAD ioctl per queue asked: ~30 us of a task's CPU in the worker, its
 * caches cold from the task before (bench/experiments/task_cpu.py). Its twin is
 * mptier.native._pure_task.take_record.
 */

#ifndef _GNU_SOURCE
#define _GNU_SOURCE 1
#endif

#include "mptier_native.h"

#include <errno.h>
#include <string.h>
#include <sys/ioctl.h>
#include <unistd.h>

/* Read one record of record_len bytes into record from the first of the n queues
 * (descriptors fds[0..n), non-blocking) that has one; a read of fewer bytes (it cannot
 * happen with whole-record writes) zeroes the record's header and goes on to the next
 * queue, as does an empty queue. Returns the index of the queue read, -EAGAIN when none
 * had a record, or -errno of a read that failed otherwise; *more is set to 1 when, after
 * a record was taken, a queue still holds one (FIONREAD), else 0 (-errno of an ioctl
 * that failed). */
int mpt_take_record(const int *fds, size_t n, unsigned char *record, size_t record_len,
                    int *more)
{
    *more = 0;
    for (size_t i = 0; i < n; i++) {
        ssize_t got;

        do
            got = read(fds[i], record, record_len);
        while (got < 0 && errno == EINTR);
        if (got < 0) {
            if (errno == EAGAIN || errno == EWOULDBLOCK)
                continue;
            return -errno;
        }
        if ((size_t)got != record_len) {
            memset(record, 0, MPT_TASK_HEADER_BYTES);
            continue;
        }
        for (size_t j = 0; j < n; j++) {
            int waiting = 0;

            if (ioctl(fds[j], FIONREAD, &waiting) != 0)
                return -errno;
            if ((size_t)waiting >= record_len) {
                *more = 1;
                break;
            }
        }
        return (int)i;
    }
    return -EAGAIN;
}
