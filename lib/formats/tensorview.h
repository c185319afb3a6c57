/* tensorview.h: a read-only view of one named tensor in memory (a mapping or a buffer), the
 * common currency between the file readers (safetensors, torch.save files, .dfl streams) and
 * the code that lists, scans, compares and converts tensors (lib/formats/scan.h, dfl-ckpt). */
#ifndef DFL_TENSORVIEW_H
#define DFL_TENSORVIEW_H

#include <stdbool.h>
#include <stdint.h>

#include "dtype.h"
#include "err.h"

#define DFL_MAX_DIMS 8

typedef struct dfl_tensor_view {
    const char *name;              /* owned by whoever made the view */
    dfl_dtype dtype;
    int ndim;
    int64_t shape[DFL_MAX_DIMS];
    uint64_t numel;                /* product of shape (1 for a 0-dim tensor) */
    uint64_t nbytes;               /* numel x element size */
    const void *data;              /* contiguous row-major elements; NULL when not loaded */
    int fd;                        /* when the same bytes lie in a file: an open descriptor of it */
    uint64_t file_offset;          /* and their offset there; fd is -1 otherwise */
} dfl_tensor_view;

/* "[2, 3, 4]" (or "[]" for a 0-dim tensor) into buf; returns buf. */
const char *dfl_shape_str(int ndim, const int64_t *shape, char *buf, size_t n);

/* What a path holds, told by content (magic bytes, directory members), not by its name. */
typedef enum dfl_input_kind {
    DFL_INPUT_UNKNOWN = 0,
    DFL_INPUT_SAFETENSORS,   /* one safetensors file */
    DFL_INPUT_MODEL_DIR,     /* Hugging Face model directory: model.safetensors or an index */
    DFL_INPUT_CKPT_DIR,      /* dfl checkpoint directory: model.safetensors and config.json with
                              * trainer_state.json and/or optimizer.safetensors */
    DFL_INPUT_TORCH,         /* torch.save file (zip); also a directory with pytorch_model.bin */
    DFL_INPUT_STREAM,        /* .dfl stream or dump ("\x89DFL"); "-" is stdin */
} dfl_input_kind;

const char *dfl_input_kind_name(dfl_input_kind k);   /* "safetensors", "torch", ... */
/* DFL_EDATA for something that is none of these (an empty file, a directory without a model),
 * DFL_EIO when it cannot be read. */
int dfl_input_detect(const char *path, dfl_input_kind *kind, dfl_err *e);

/* The tensors of one file (or of one sharded model), as views. */
typedef struct dfl_tensor_set {
    char *label;                   /* names the source in reports: the path, or dir/member */
    dfl_input_kind kind;           /* SAFETENSORS, MODEL_DIR or TORCH */
    size_t n;
    dfl_tensor_view *t;            /* safetensors: sorted by name; torch: in pickle order */
    void *reader;                  /* the dfl_st_model or dfl_torch_file holding the data */
} dfl_tensor_set;

enum { DFL_TS_NO_DATA = 1u << 0 };  /* torch files: read the structure only (data NULL) */

/* Opens a path that is not a stream as tensor sets: one per safetensors file of a checkpoint
 * directory (model.safetensors, then optimizer.safetensors when present), one otherwise. The
 * JSON files of a checkpoint directory (config.json, trainer_state.json) are parsed as a check. */
int dfl_tensor_sets_open(const char *path, unsigned flags, dfl_tensor_set **sets, size_t *n, dfl_err *e);
void dfl_tensor_sets_close(dfl_tensor_set *sets, size_t n);

#endif
