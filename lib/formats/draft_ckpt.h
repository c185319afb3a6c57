/* draft_ckpt.h: drafter checkpoints. RUN/step-NNNNNNN/ holds
 *   model.safetensors      the 3 + 11 * layers drafter tensors, public DFlash names, bf16 or f32
 *   config.json            the public DFlash config (dfl_draft_config_to_json)
 *   optimizer.safetensors  f32 master weights ("master.<name>") and AdamW moments
 *                          ("exp_avg.<name>", "exp_avg_sq.<name>"): resume is exact
 *   trainer_state.json     the trainer's state (step, data position, RNG, schedule), opaque here
 * written in RUN/.step-NNNNNNN.tmp/ (each file fsync-ed), checked for non-finite values, renamed
 * into place, and only then pointed to by the symlink RUN/latest (replaced atomically). */
#ifndef DFL_DRAFT_CKPT_H
#define DFL_DRAFT_CKPT_H

#include <jansson.h>

#include "draft.h"

/* Writes step `step` of m with state. A non-finite weight or moment, or a weight that is not
 * finite in model_dtype (an f32 value beyond the range of bf16): DFL_ENAN, nothing is left
 * behind. If RUN/step-NNNNNNN exists already (left by a run that went further than the one
 * saving now) it is replaced, atomically where the file system allows. *out_dir (if non-NULL)
 * receives the checkpoint directory (malloc'ed). */
int dfl_draft_ckpt_save(dfl_draft *m, const char *run, int64_t step, const json_t *state,
                        dfl_dtype model_dtype, char **out_dir, dfl_err *e);
/* Takes the lock of the run directory run (RUN/dfl-draft.lock, flock(2), exclusive, without
 * waiting; the pipelines' RUN/lock is another) and writes this process's PID into it; *fd holds
 * the lock until it is closed (close-on-exec: no child keeps it). Held by another process:
 * DFL_EUSAGE naming run and that process's PID. A file system without locks: a warning, *fd = -1
 * and DFL_OK. */
int dfl_draft_run_lock(const char *run, int *fd, dfl_err *e);
/* Removes what interrupted saves left in run (RUN/.step-NNNNNNN.tmp and .old directories), with
 * a warning naming each; for the start of a run, before anything is saved. */
int dfl_draft_ckpt_clean(const char *run, dfl_err *e);
/* Removes all but the newest keep step-* directories of run (never the one latest names), each
 * renamed to RUN/.step-NNNNNNN.old before its files are removed. */
int dfl_draft_ckpt_prune(const char *run, int keep, dfl_err *e);
/* Resolves a --resume argument: a checkpoint directory, or a run directory (its latest). Refuses
 * a temporary (incomplete) one. *dir is malloc'ed. */
int dfl_draft_ckpt_resolve(const char *path, char **dir, dfl_err *e);
/* Reads dir/config.json into *c (fields it has; fill *c with defaults first). */
int dfl_draft_ckpt_config(const char *dir, dfl_draft_config *c, dfl_err *e);
/* Restores master weights and moments of m from dir (its config must match m's: DFL_EMISMATCH),
 * refusing a checkpoint with any non-finite value (DFL_ENAN); *state receives
 * trainer_state.json (new reference). */
int dfl_draft_ckpt_load(dfl_draft *m, const char *dir, json_t **state, dfl_err *e);
/* True when all n values are finite; *first receives the index of the first that is not. */
bool dfl_draft_all_finite(const float *x, int64_t n, int64_t *first);

#endif
