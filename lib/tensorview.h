/* tensorview.h: a read-only view of one named tensor in memory (a mapping or a buffer), the
 * common currency between the file readers (safetensors, torch.save files, .dfl streams) and
 * the code that lists, scans, compares and converts tensors (lib/scan.h, dfl-ckpt). */
#ifndef DFL_TENSORVIEW_H
#define DFL_TENSORVIEW_H

#include <stdbool.h>
#include <stdint.h>

#include "dtype.h"

#define DFL_MAX_DIMS 8

typedef struct dfl_tensor_view {
    const char *name;              /* owned by whoever made the view */
    dfl_dtype dtype;
    int ndim;
    int64_t shape[DFL_MAX_DIMS];
    uint64_t numel;                /* product of shape (1 for a 0-dim tensor) */
    uint64_t nbytes;               /* numel x element size */
    const void *data;              /* contiguous row-major elements; NULL when not loaded */
} dfl_tensor_view;

/* "[2, 3, 4]" (or "[]" for a 0-dim tensor) into buf; returns buf. */
const char *dfl_shape_str(int ndim, const int64_t *shape, char *buf, size_t n);

#endif
