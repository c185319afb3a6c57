/* draft_rng.h: the drafter's pseudo-random generator: xoshiro256** (Blackman and Vigna) seeded
 * through splitmix64. Small, fast, well defined (dfl-draft(1) documents it), and its whole state
 * is four 64-bit words, saved in trainer_state.json so that a resumed run draws the same numbers. */
#ifndef DFL_DRAFT_RNG_H
#define DFL_DRAFT_RNG_H

#include <stdint.h>

typedef struct dfl_rng {
    uint64_t s[4];
} dfl_rng;

/* splitmix64: x += 0x9E3779B97F4A7C15, then the output mix; used for seeding and hashing. */
uint64_t dfl_splitmix64(uint64_t *x);
/* s[i] = successive splitmix64 outputs from x = seed. */
void dfl_rng_seed(dfl_rng *r, uint64_t seed);
/* xoshiro256**: result = rotl(s1 * 5, 7) * 9, then the state update. */
uint64_t dfl_rng_next(dfl_rng *r);
/* Uniform integer in [0, n), n >= 1, unbiased (rejection of the top partial range). */
uint64_t dfl_rng_below(dfl_rng *r, uint64_t n);
/* Uniform double in [0, 1) with 53 random bits. */
double dfl_rng_double(dfl_rng *r);
/* Standard normal (Box-Muller, two uniforms per value, the cosine branch). */
double dfl_rng_normal(dfl_rng *r);
/* Both normals of one Box-Muller pair (cos into *a, sin into *b unless b is NULL); the generator
 * advances as for one dfl_rng_normal, whose value is *a. */
void dfl_rng_normal2(dfl_rng *r, double *a, double *b);
/* A 64-bit value derived from (a, b) without touching any generator (per-step seeds). */
uint64_t dfl_hash2(uint64_t a, uint64_t b);

#endif
