/* draft_data.h: what the drafter trainer does to its input batches on the host: random anchors
 * and blocks (doc/dflash-step.md section 2, with SpecForge's random subset), and the upper bound on blocks
 * used to size the workspace. */
#ifndef DFL_DRAFT_DATA_H
#define DFL_DRAFT_DATA_H

#include <stdint.h>

#include "draft_rng.h"

/* Blocks of a packed batch. For each sequence s (rows start..start+len-1), the valid anchors are
 * the positions a with 0 <= a <= len-2, loss_mask[a] = 1 and loss_mask[a+1] = 1. When there are
 * more than max_anchors of them, max_anchors are drawn uniformly without replacement (partial
 * Fisher-Yates over the ascending list: for i < max_anchors, swap i with i + below(n - i)), then
 * sorted ascending; otherwise all are used and rng is not touched. Writes the blocks (sequence,
 * anchor), ordered by sequence then anchor, and returns their number. scratch holds max_len
 * int32. block_seq / block_anchor need dfl_draft_max_blocks() entries. */
int64_t dfl_draft_blocks(const uint32_t *seq_lens, int32_t S, const uint8_t *loss_mask,
                         int max_anchors, dfl_rng *rng, int32_t *block_seq, int32_t *block_anchor,
                         int32_t *scratch);
/* Upper bound on the blocks of a batch of T tokens in S sequences: min(T - S, S * max_anchors). */
int64_t dfl_draft_max_blocks(int64_t T, int64_t S, int max_anchors);

#endif
