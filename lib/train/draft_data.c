/* draft_data.c: anchors and blocks of a packed batch (see draft_data.h). */
#include "draft_data.h"

#include <stdlib.h>

static int cmp_i32(const void *a, const void *b)
{
    int32_t x = *(const int32_t *)a, y = *(const int32_t *)b;
    return (x > y) - (x < y);
}

int64_t dfl_draft_blocks(const uint32_t *seq_lens, int32_t S, const uint8_t *loss_mask,
                         int max_anchors, dfl_rng *rng, int32_t *block_seq, int32_t *block_anchor,
                         int32_t *scratch)
{
    int64_t nb = 0, start = 0;
    for (int32_t s = 0; s < S; s++) {
        const int64_t L = seq_lens[s];
        const uint8_t *m = loss_mask + start;
        int64_t n = 0;
        for (int64_t a = 0; a + 1 < L; a++)
            if (m[a] && m[a + 1])
                scratch[n++] = (int32_t)a;
        if (n > max_anchors) {
            for (int64_t i = 0; i < max_anchors; i++) {
                int64_t j = i + (int64_t)dfl_rng_below(rng, (uint64_t)(n - i));
                int32_t t = scratch[i];
                scratch[i] = scratch[j];
                scratch[j] = t;
            }
            n = max_anchors;
            qsort(scratch, (size_t)n, sizeof *scratch, cmp_i32);
        }
        for (int64_t i = 0; i < n; i++) {
            block_seq[nb] = s;
            block_anchor[nb++] = scratch[i];
        }
        start += L;
    }
    return nb;
}

int64_t dfl_draft_max_blocks(int64_t T, int64_t S, int max_anchors)
{
    int64_t a = T - S, b = S * (int64_t)max_anchors;
    int64_t r = a < b ? a : b;
    return r > 0 ? r : 0;
}
