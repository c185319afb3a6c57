/* torchfile.h: reading PyTorch torch.save files (.bin, .pt: the zip format written since torch
 * 1.6) without Python and without executing anything.
 *
 * The zip (opened with libarchive) holds <prefix>/data.pkl, a pickle describing the saved object,
 * and one entry <prefix>/data/<key> per storage. The pickle is interpreted by a small stack
 * machine that knows only the opcodes torch.save emits (protocol 2, and the protocol-4 ones) and
 * only an allowlist of names: collections.OrderedDict, torch._utils._rebuild_tensor_v2/_v3,
 * torch._utils._rebuild_parameter(_with_state), torch._tensor._rebuild_from_type_v2 (for
 * torch.Tensor), the torch.<X>Storage classes, torch.UntypedStorage and torch dtypes. Names are
 * data: nothing named in the pickle is imported or called; anything else is rejected.
 *
 * The result is the flat list of tensors found in the (possibly nested) dicts, lists and tuples
 * of the saved object, named by their keys joined with '.' (list and tuple items by their index,
 * integer keys in decimal; a tensor saved on its own is named "tensor"), in pickle order. */
#ifndef DFL_TORCHFILE_H
#define DFL_TORCHFILE_H

#include <stdbool.h>
#include <stdint.h>

#include "err.h"
#include "tensorview.h"

/* Limits applied before allocating (a file over one of them is rejected as invalid). */
#define DFL_TORCH_MAX_PICKLE (64u << 20)   /* size of data.pkl */
#define DFL_TORCH_MAX_TENSORS (1u << 20)   /* tensors (and storages) in a file */
#define DFL_TORCH_MAX_ENTRIES (1u << 20)   /* zip entries */
#define DFL_TORCH_MAX_DEPTH 64             /* nesting of dicts, lists and tuples */
#define DFL_TORCH_MAX_NAME 4096            /* bytes of a joined tensor name */

enum dfl_torch_flags {
    DFL_TORCH_NO_DATA = 1u << 0,  /* read only the pickle and the entry sizes: data stays NULL */
};

typedef struct dfl_torch_tensor {
    dfl_tensor_view v;            /* name, dtype, shape, data (contiguous) */
    const char *storage;          /* storage key (the entry <prefix>/data/<key>) */
    const char *location;         /* the device named at save time ("cpu", ...) */
    uint64_t storage_offset;      /* in elements */
    int64_t stride[DFL_MAX_DIMS]; /* in elements, as saved */
    bool gathered;                /* a non-contiguous view, copied into a contiguous buffer */
    bool parameter;               /* saved as a torch.nn.Parameter */
} dfl_torch_tensor;

typedef struct dfl_torch_file dfl_torch_file;

/* Opens and checks path: a zip with exactly one <prefix>/data.pkl, the pickle interpreted as
 * above, every referenced storage present with exactly the size its record says, every tensor's
 * offset, shape and strides inside its storage. Unless DFL_TORCH_NO_DATA, the referenced storages
 * are read into memory: contiguous tensors point into them, non-contiguous views are gathered.
 * The legacy (pre-zip) format is recognized and rejected. Errors name the file and the defect
 * (the pickle offset, the tensor or the entry). */
int dfl_torch_open(dfl_torch_file **out, const char *path, unsigned flags, dfl_err *e);
void dfl_torch_close(dfl_torch_file *f);

size_t dfl_torch_count(const dfl_torch_file *f);
const dfl_torch_tensor *dfl_torch_get(const dfl_torch_file *f, size_t i);
const dfl_torch_tensor *dfl_torch_find(const dfl_torch_file *f, const char *name);
/* The archive prefix ("archive", or the file stem torch chose), and the number of storages. */
const char *dfl_torch_prefix(const dfl_torch_file *f);
size_t dfl_torch_storage_count(const dfl_torch_file *f);

/* Does buf (the first n >= 4 bytes of a file) look like a zip archive (a torch.save file)? */
bool dfl_torch_magic(const void *buf, size_t n);

#endif
