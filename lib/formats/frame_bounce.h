/* frame_bounce.h: the frame reader's bounce path for large frames on a descriptor (frame.c,
 * read_body_bounce; dfl_reader_opts.bounce). The kernel's copy out of a pipe (read(2)) is slower
 * when its destination is cold: each destination line is first read for ownership from memory.
 * So the piece is read(2) into a small buffer that stays in the cache (a bounce buffer), hashed
 * there, and moved to its place in the frame with non-temporal (streaming) stores, which write
 * whole lines without reading them first.
 *
 * dfl_copy_stream is that copy. A dfl_bouncer is a helper thread with a ring of bounce buffers:
 * the reading thread takes a free buffer (dfl_bouncer_take), read(2)s a piece into it and queues
 * it (dfl_bouncer_put); the thread hashes each queued piece into a streaming XXH3 state and
 * copies it out, in the order queued, while the reading thread reads the next one.
 * dfl_bouncer_finish waits until every queued piece is done (the state then holds what hashing
 * the pieces in order in one thread would hold, and the copies are visible);
 * dfl_bouncer_cancel drops the queued pieces and waits for the one in progress. When either
 * returns, the thread touches no destination and no state until the next dfl_bouncer_put. Used
 * by one reading thread. */
#ifndef DFL_FRAME_BOUNCE_H
#define DFL_FRAME_BOUNCE_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "xxh.h"

/* dst[0..n) = src[0..n), any alignment, the areas apart. Where the CPU has AVX2, the whole
 * 64-byte lines of dst are written with streaming stores (the lines are not read first and do
 * not stay in the cache), the partial lines at both ends with plain stores, followed by an
 * sfence; elsewhere it is memcpy. */
void dfl_copy_stream(void *dst, const void *src, size_t n);
/* Whether dfl_copy_stream streams on this CPU (AVX2), and, for the tests, to turn that off (false:
 * memcpy from now on; true: streaming again where the CPU has it). */
bool dfl_copy_stream_nt(void);
void dfl_copy_stream_set(bool on);

typedef struct dfl_bouncer dfl_bouncer;

/* Starts the thread, named "dfl-bounce", with every signal blocked in it, and a ring of `slots`
 * (at least 2) buffers of `size` bytes each (page-aligned). NULL when it cannot. */
dfl_bouncer *dfl_bouncer_new(size_t size, unsigned slots);
/* Stops the thread (dropping the queued pieces) and frees b; NULL is ignored. */
void dfl_bouncer_free(dfl_bouncer *b);
/* A free buffer of the ring (of the size given at dfl_bouncer_new), waiting while all of them are
 * queued. The reading thread owns it until it passes it to dfl_bouncer_put; take, then put, one
 * buffer at a time. */
uint8_t *dfl_bouncer_take(dfl_bouncer *b);
/* Queues the buffer last taken: its first hash_n bytes go into st (XXH3_64bits_update), then its
 * first n bytes to dst (dfl_copy_stream). st and dst must stay until finish or cancel. */
void dfl_bouncer_put(dfl_bouncer *b, XXH3_state_t *st, size_t hash_n, uint8_t *dst, size_t n);
/* Waits until every queued piece is hashed and copied. */
void dfl_bouncer_finish(dfl_bouncer *b);
/* Drops the queued pieces that have not started, and waits for the one in progress. */
void dfl_bouncer_cancel(dfl_bouncer *b);

#endif
