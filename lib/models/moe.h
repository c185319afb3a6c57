/* moe.h: the mixture-of-experts MLP of a target layer (qwen3_moe, qwen3_5_moe), written against
 * the backend ops: router GEMM (f32 logits), routing and grouping by expert (moe_route), the
 * gate|up GEMM grouped over experts with the gather of x's rows and SwiGLU fused in (moe_matmul
 * with rows and swiglu), the grouped down GEMM, and the weighted combine into the
 * output; with a shared expert (qwen3_5_moe) also its dense SwiGLU MLP and its gate logit (an f32
 * GEMM of N = 1), added by the same combine as sigmoid(gate) times its output. */
#ifndef DFL_MOE_H
#define DFL_MOE_H

#include <stdbool.h>
#include <stdint.h>

#include "backend.h"
#include "hfmodel.h"

/* A sparse layer's weights on the backend. */
typedef struct dfl_moe_weights {
    void *router;  /* [E, H] w: mlp.gate */
    void *wgu;     /* [E, 2 Im, H] w: expert e's gate_proj | up_proj rows */
    void *wdown;   /* [E, H, Im] w: expert e's down_proj */
    /* the shared expert (NULL without one) */
    void *sgu;     /* [2 Is, H] w: mlp.shared_expert.gate_proj | up_proj */
    void *sdown;   /* [H, Is] w: mlp.shared_expert.down_proj */
    void *sgate;   /* [1, H] w: mlp.shared_expert_gate */
} dfl_moe_weights;

/* Buffers for batches of up to max_tokens tokens, carved from one backend block of
 * dfl_moe_ws_bytes bytes. */
typedef struct dfl_moe_ws {
    int64_t max_tokens, cap;
    float *logits;      /* [T, E] f32 */
    int32_t *idx;       /* [T, k] */
    float *weight;      /* [T, k] */
    int32_t *counts;    /* [E] */
    int32_t *offsets;   /* [E + 1] */
    int32_t *rows;      /* [cap] */
    int32_t *slot;      /* [T, k] */
    void *act;          /* [cap, Im] act */
    void *y;            /* [cap, H] act */
    /* the shared expert (models with one; else empty) */
    float *sg;          /* [T] f32: gate logits */
    void *sgu;          /* [T, 2 Is] act */
    void *sact;         /* [T, Is] act */
    void *sy;           /* [T, H] act: its output before the gate */
} dfl_moe_ws;

/* Bytes of the block for max_tokens (0 for a model without experts, or on overflow). */
uint64_t dfl_moe_ws_bytes(const dfl_hf_config *c, const dfl_be *be, int64_t max_tokens);
/* Points the buffers of m into block (dfl_moe_ws_bytes bytes, 256-aligned). */
void dfl_moe_ws_carve(const dfl_hf_config *c, const dfl_be *be, int64_t max_tokens, void *block,
                      dfl_moe_ws *m);

/* out [T, H] act (= when !accumulate, += when accumulate) the MoE MLP of x [T, H] act.
 * router_out, if non-NULL, receives the router logits [T, E] (f32, backend memory). */
int dfl_moe_forward(dfl_be *be, const dfl_hf_config *c, const dfl_moe_ws *m,
                    const dfl_moe_weights *w, const void *x, int64_t T, void *out,
                    bool accumulate, float *router_out);

#endif
