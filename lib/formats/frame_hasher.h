/* frame_hasher.h: a helper thread of the frame reader that hashes a frame's body while the
 * reading thread read(2)s the rest of it, so that the copy out of the pipe and the checksum run
 * side by side instead of one after the other (frame.c, read_body).
 *
 * One job at a time: dfl_hasher_start names a region of memory and a streaming XXH3 state; the
 * reader then says how much of the region is in place (dfl_hasher_avail, after each read), and
 * the thread feeds those bytes to the state, front to back, as they come. dfl_hasher_finish
 * waits until the whole region is hashed (the state then holds what one thread hashing it in
 * order would hold); dfl_hasher_cancel stops a job early (a failed or cut read). When either
 * returns, the thread no longer touches the region or the state, so the caller may read the
 * digest, free the memory, or start another job. Used by one reading thread. */
#ifndef DFL_FRAME_HASHER_H
#define DFL_FRAME_HASHER_H

#include <pthread.h>
#include <stdint.h>

#include "xxh.h"

typedef struct dfl_hasher dfl_hasher;

/* Starts fn(arg) on a thread named `name` (at most 15 characters) with every signal blocked in
 * it, so that the program's handlers still run on, and interrupt, its own threads: the reader's
 * helper threads (this one, and the bounce thread of frame_bounce.h). pthread_create's result. */
int dfl_reader_thread_start(pthread_t *t, void *(*fn)(void *), void *arg, const char *name);

/* Starts the thread, named "dfl-hash", with every signal blocked in it (so that the program's
 * handlers still run on, and interrupt, its own threads). NULL when it cannot (the reader then
 * hashes itself). */
dfl_hasher *dfl_hasher_new(void);
/* Stops the thread (cancelling a job in progress) and frees h; NULL is ignored. */
void dfl_hasher_free(dfl_hasher *h);
/* A job: base[0..len) into st, in order, as dfl_hasher_avail makes it available. Waits for the
 * previous job to end first, as dfl_hasher_finish does. */
void dfl_hasher_start(dfl_hasher *h, XXH3_state_t *st, const uint8_t *base, uint64_t len);
/* The first n bytes of base are in place (n past len counts as len; n never goes back). */
void dfl_hasher_avail(dfl_hasher *h, uint64_t n);
/* Waits until all len bytes are hashed (all must have been made available). */
void dfl_hasher_finish(dfl_hasher *h);
/* Ends the job at once; nothing more of base is read once this returns. */
void dfl_hasher_cancel(dfl_hasher *h);

#endif
