/* batch_check.h: the checks of a batch's arrays that the frame reader (frame.c) and the frame
 * writer (frame_write.c) both make, each saying in its own words what is wrong. Header-only:
 * each is one pass over the array (a branch-free pass first, the search for the culprit only
 * when that pass found one). */
#ifndef DFL_BATCH_CHECK_H
#define DFL_BATCH_CHECK_H

#include <stdint.h>

/* The sum and the largest of the S lengths; the index of the first 0, or -1 for none. */
static inline int64_t dfl_seq_lens_scan(const uint32_t *lens, uint32_t S, uint64_t *sum, uint32_t *max)
{
    uint64_t s_ = 0;
    uint32_t mx = 0, zero = 0;
    for (uint32_t i = 0; i < S; i++) {
        uint32_t s = lens[i];
        s_ += s;
        mx = s > mx ? s : mx;
        zero |= s == 0;
    }
    *sum = s_;
    *max = mx;
    if (zero)
        for (uint32_t i = 0; i < S; i++)
            if (lens[i] == 0)
                return i;
    return -1;
}

/* The index of the first of the T ids outside [0, lim) (one unsigned compare catches negatives
 * too), or -1 for none. */
static inline int64_t dfl_ids_first_bad(const int32_t *input_ids, uint64_t T, uint32_t lim)
{
    const uint32_t *ids = (const uint32_t *)input_ids;
    uint32_t bad = 0;
    for (uint64_t i = 0; i < T; i++)
        bad |= ids[i] >= lim;
    if (bad)
        for (uint64_t i = 0; i < T; i++)
            if (ids[i] >= lim)
                return (int64_t)i;
    return -1;
}

/* The index of the first of the T mask values other than 0 and 1, or -1 for none. */
static inline int64_t dfl_mask_first_bad(const uint8_t *mask, uint64_t T)
{
    uint8_t bad = 0;
    for (uint64_t i = 0; i < T; i++)
        bad |= mask[i] & 0xfe;
    if (bad)
        for (uint64_t i = 0; i < T; i++)
            if (mask[i] > 1)
                return (int64_t)i;
    return -1;
}

#endif
