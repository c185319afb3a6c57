/* safetensors.h: reading (mapped, fully checked) and writing (deterministic, atomic) safetensors
 * files, and opening Hugging Face model directories (single file or sharded through
 * model.safetensors.index.json). */
#ifndef DFL_SAFETENSORS_H
#define DFL_SAFETENSORS_H

#include <jansson.h>
#include <stdint.h>

#include "dtype.h"
#include "err.h"
#include "util.h"

#define DFL_MAX_DIMS 8
#define DFL_ST_MAX_HEADER (100u << 20)   /* header size cap: 100 MB */

typedef struct dfl_st_tensor {
    const char *name;          /* owned by the file */
    dfl_dtype dtype;
    int ndim;
    int64_t shape[DFL_MAX_DIMS];
    uint64_t numel;
    uint64_t offset;           /* byte offset of the data from the start of the file */
    uint64_t nbytes;
    const void *data;          /* points into the mapping; aligned to the element size in files
                                * from dfl_st_write, possibly unaligned in others (use memcpy or
                                * dfl_convert, or check the address, before casting) */
    const char *file;          /* path of the file holding it */
} dfl_st_tensor;

typedef struct dfl_st_file {
    char *path;
    dfl_map map;
    uint64_t header_len;       /* N of the 8-byte prefix */
    uint64_t data_start;       /* 8 + N */
    size_t n;                  /* tensors, in offset order */
    dfl_st_tensor *t;
    json_t *metadata;          /* the "__metadata__" object (string values), or NULL */
    dfl_st_tensor **by_name;   /* the same tensors sorted by name (for dfl_st_find) */
} dfl_st_file;

/* Maps and checks path: 8-byte little-endian header length within the cap and the file, a JSON
 * object header (no duplicate names; trailing space padding allowed), "__metadata__" (optional)
 * an object of strings, every entry exactly {dtype, shape, data_offsets} with a known dtype
 * (safetensors spelling), a shape of at most DFL_MAX_DIMS non-negative integers, integer
 * data_offsets [begin, end] with begin <= end and numel x dtype size == end - begin (overflow
 * checked), ranges contiguous from 0 with no holes or overlaps (zero-size tensors allowed), and
 * the data ending exactly at the end of the file. Errors name the file and the tensor: DFL_EIO
 * when it cannot be opened, DFL_ETRUNC when it is shorter than its header or data says,
 * DFL_EDATA for anything else. */
int dfl_st_open(dfl_st_file **out, const char *path, dfl_err *e);
void dfl_st_close(dfl_st_file *f);
/* By name (binary search); NULL if absent. */
const dfl_st_tensor *dfl_st_find(const dfl_st_file *f, const char *name);
/* The __metadata__ value of key, or NULL. */
const char *dfl_st_meta(const dfl_st_file *f, const char *key);

/* A Hugging Face model directory (or a single .safetensors path): all tensors of all shards,
 * sorted by name. A directory with model.safetensors uses it (as transformers does, even when an
 * index is beside it); otherwise model.safetensors.index.json: its "weight_map" (tensor name ->
 * shard file name) must name plain files inside the directory (no '/' or '..'), every tensor it
 * lists must be in the shard it names, and every tensor of every shard must be listed there for
 * that shard; names are unique across shards. dir is the directory (for a single file, the one
 * holding it). */
typedef struct dfl_st_model {
    char *dir;
    size_t nfiles;
    dfl_st_file **files;
    size_t n;
    const dfl_st_tensor **t;   /* sorted by name */
} dfl_st_model;

int dfl_st_model_open(dfl_st_model **out, const char *path, dfl_err *e);
void dfl_st_model_close(dfl_st_model *m);
const dfl_st_tensor *dfl_st_model_find(const dfl_st_model *m, const char *name);
/* Finds name and checks its dtype is a float type and its shape is exactly shape[0..ndim);
 * errors name the tensor and its file: DFL_EDATA when it is missing or not a float type,
 * DFL_EMISMATCH (with expected and actual shape) when the shape differs. */
int dfl_st_model_get(const dfl_st_model *m, const char *name, int ndim, const int64_t *shape,
                     const dfl_st_tensor **out, dfl_err *e);

/* Deterministic writer: the same tensors and metadata give the same bytes, whatever the order
 * they were added in. Data is laid out sorted by (element size descending, name), so that every
 * tensor is aligned to its element size. The header is compact JSON: "__metadata__" first (only
 * when there is metadata; its keys sorted), then the tensors sorted by name (strcmp), each as
 * {"data_offsets":[b,e],"dtype":"F32","shape":[..]} (keys sorted); it is padded with spaces so
 * that the data starts at a multiple of 64 bytes. Written to a temporary file beside path,
 * fsync-ed and renamed; on any error nothing is left behind. An existing FIFO or device is written
 * in place and a symbolic link written through, never replaced (dfl_output_open). Tensor data is
 * borrowed until dfl_st_write returns. Errors in the arguments are DFL_EUSAGE. */
typedef struct dfl_st_writer dfl_st_writer;
dfl_st_writer *dfl_st_writer_new(void);
void dfl_st_writer_free(dfl_st_writer *w);
/* Copies name and shape; data is borrowed (may be NULL for a zero-size tensor). Fails on an
 * empty, duplicate or non-UTF-8 name, "__metadata__", a negative dimension or size overflow. */
int dfl_st_writer_add(dfl_st_writer *w, const char *name, dfl_dtype dtype, int ndim,
                      const int64_t *shape, const void *data, dfl_err *e);
/* A __metadata__ entry (UTF-8 key and value, key not already set). */
int dfl_st_writer_meta(dfl_st_writer *w, const char *key, const char *value, dfl_err *e);
int dfl_st_write(dfl_st_writer *w, const char *path, dfl_err *e);

#endif
