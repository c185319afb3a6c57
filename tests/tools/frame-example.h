/* frame-example.h: the stream of the EXAMPLE in dfl-frame(5), one batch of sequences of 3 and 2
 * tokens, written with the library's writer; shared by tests/tools/mkframes.c (which commits it
 * as tests/fixtures/frame/example.dfl) and tests/unit/test-frame.c (which checks that the writer
 * still writes those bytes). Include after frame.h. */
#ifndef DFL_FRAME_EXAMPLE_H
#define DFL_FRAME_EXAMPLE_H

#include <stdio.h>
#include <string.h>

static inline int write_frame_example(const char *path, dfl_err *e)
{
    dfl_stream_info ex;
    memset(&ex, 0, sizeof ex);
    ex.kind = DFL_KIND_TOKENS;
    snprintf(ex.producer, sizeof ex.producer, "example");
    ex.vocab_size = 100;
    dfl_batch b;
    int rc = dfl_batch_alloc(&b, 5, 2, 0, 0, DFL_DT_INVALID, e);
    if (rc)
        return rc;
    ((uint32_t *)b.seq_lens)[0] = 3;
    ((uint32_t *)b.seq_lens)[1] = 2;
    static const uint8_t mask[5] = {0, 1, 1, 0, 1};
    for (int i = 0; i < 5; i++) {
        ((int32_t *)b.input_ids)[i] = 5 + i;
        ((uint8_t *)b.loss_mask)[i] = mask[i];
    }
    dfl_writer *w;
    if (!(rc = dfl_writer_open(&w, path, &ex, NULL, e)) && !(rc = dfl_writer_batch(w, &b, e)))
        rc = dfl_writer_close(w, e);
    dfl_batch_free(&b);
    return rc;
}

#endif
