/*
 * fdio.c - whole writes on a descriptor: the floor every C file that writes stands on.
 *
 * write(2) and pwrite(2) may move fewer bytes than asked (a signal, a network file
 * system, a short direct write); mpt_write_at goes on until every byte is written or
 * the system says why not.
 */

#ifndef _GNU_SOURCE
#define _GNU_SOURCE 1
#endif

#include "mptier_native.h"

#include <errno.h>
#include <unistd.h>

int mpt_write_at(int fd, const char *p, size_t len, off_t offset)
{
    while (len > 0) {
        ssize_t w = offset == MPT_AT_POSITION ? write(fd, p, len)
                                              : pwrite(fd, p, len, offset);
        if (w < 0) {
            if (errno == EINTR)
                continue;
            return -errno;
        }
        if (w == 0)
            return -EIO;
        p += w;
        len -= (size_t)w;
        if (offset != MPT_AT_POSITION)
            offset += w;
    }
    return 0;
}
