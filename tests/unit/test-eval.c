/* test-eval.c: dfl-eval's walk (lib/train/eval.c) against a decoder simulated token by token:
 * the target's greedy text is given, the drafter's proposal at (anchor, slot) is drawn at random
 * (equal to the text's token with some probability), and the simulation appends the accepted
 * proposals and the target's token after them, as a serving engine that verifies greedily does.
 * Also response spans, the counts of a hand-worked case and the JSON fields. */
#include <stdint.h>

#include "draft_rng.h"
#include "eval.h"
#include "t.h"

/* The yield of one step computed by simulation: the tokens the engine outputs after the anchor
 * (out), which must be the text's own (greedy verification changes nothing in the output). */
static int simulate_step(const int32_t *text, int64_t a, int64_t end, const int32_t *prop, int bs,
                         int32_t *out)
{
    int n = 0;
    /* verification: the target's token after each accepted proposal is the text's */
    for (int j = 1; j < bs; j++) {
        if (a + j >= end)
            break;                     /* generation stops at the end of the response */
        if (prop[j] != text[a + j]) {
            out[n++] = text[a + j];    /* the target's own token replaces the first miss */
            return n;
        }
        out[n++] = prop[j];            /* accepted */
    }
    if (a + n + 1 < end) {
        out[n] = text[a + n + 1];      /* the bonus token after a whole accepted block */
        n++;
    }
    return n;
}

static void test_walk_against_simulation(void)
{
    dfl_rng r;
    dfl_rng_seed(&r, 42);
    for (int trial = 0; trial < 300; trial++) {
        const int bs = 2 + (int)dfl_rng_below(&r, 15);
        const int64_t len = 2 + (int64_t)dfl_rng_below(&r, 120);
        const double p_hit = (double)dfl_rng_below(&r, 101) / 100.0;
        int32_t text[128], prop[DFL_DRAFT_MAX_BS];
        uint8_t corr[DFL_DRAFT_MAX_BS];
        for (int64_t i = 0; i < len; i++)
            text[i] = (int32_t)dfl_rng_below(&r, 5);
        dfl_eval_stats st;
        dfl_eval_stats_init(&st, bs);
        int64_t a = 0, steps = 0, tokens = 0;
        while (a < len - 1) {
            for (int j = 1; j < bs; j++) {
                bool hit = a + j < len && dfl_rng_below(&r, 1000) < (uint64_t)(p_hit * 1000);
                prop[j] = hit ? text[a + j] : (a + j < len ? text[a + j] + 1 : 7);
                corr[j] = a + j < len && prop[j] == text[a + j];
            }
            int32_t out[DFL_DRAFT_MAX_BS + 1];
            int want = simulate_step(text, a, len, prop, bs, out);
            for (int i = 0; i < want; i++)
                T_EQ_INT(out[i], text[a + 1 + i], "decoded token");
            int got = dfl_eval_step(&st, corr, len - 1 - a);
            T_EQ_INT(got, want, "step yield");
            if (got != want)
                return;
            a += got;
            steps++;
            tokens += got;
        }
        T_EQ_INT(a, len - 1, "the walk ends on the last token");
        T_EQ_INT(st.steps, steps, "steps");
        T_EQ_INT(st.tokens, len - 1, "every token after the first is decoded once");
        int64_t h = 0, hs = 0;
        for (int n = 1; n <= bs; n++) {
            h += st.hist[n];
            hs += n * st.hist[n];
        }
        T_EQ_INT(h, steps, "histogram total");
        T_EQ_INT(hs, tokens, "histogram sum");
        for (int j = 1; j < bs; j++)
            T_CHECK(st.slot_acc[j] <= st.slot_ok[j] && st.slot_ok[j] <= st.slot_n[j],
                    "slot %d counts %lld <= %lld <= %lld", j, (long long)st.slot_acc[j],
                    (long long)st.slot_ok[j], (long long)st.slot_n[j]);
    }
}

static void test_hand_worked(void)
{
    /* the drafter proposes 0: text (response) 5 0 0 5 0 0 0 0 0 0 0 0 5 0 5 */
    const int32_t text[] = {5, 0, 0, 5, 0, 0, 0, 0, 0, 0, 0, 0, 5, 0, 5};
    const int64_t len = 15;
    dfl_eval_stats st;
    dfl_eval_stats_init(&st, 8);
    int64_t a = 0;
    int yields[8], k = 0;
    while (a < len - 1 && k < 8) {
        uint8_t c[8] = {0};
        for (int j = 1; j < 8; j++)
            c[j] = a + j < len && text[a + j] == 0;
        yields[k] = dfl_eval_step(&st, c, len - 1 - a);
        a += yields[k++];
    }
    T_EQ_INT(k, 4, "steps");
    T_EQ_INT(yields[0], 3, "anchor 0");
    T_EQ_INT(yields[1], 8, "anchor 3");
    T_EQ_INT(yields[2], 1, "anchor 11");
    T_EQ_INT(yields[3], 2, "anchor 12");
    json_t *j = dfl_eval_stats_json(&st);
    T_NEAR(json_real_value(json_object_get(j, "tau")), 3.5, 0, "tau");
    /* no span was counted here (dfl_eval_step only): forwards = steps */
    T_EQ_INT(json_integer_value(json_object_get(j, "target_forwards")), 4, "forwards");
    T_NEAR(json_real_value(json_array_get(json_object_get(j, "slot_acceptance"), 2)), 1.0 / 3, 1e-12,
           "slot 3 acceptance");
    json_decref(j);
    dfl_eval_stats empty;
    dfl_eval_stats_init(&empty, 4);
    j = dfl_eval_stats_json(&empty);
    T_CHECK(json_is_null(json_object_get(j, "tau")), "no step: tau is null");
    json_decref(j);
}

static void test_spans(void)
{
    const uint8_t m[] = {0, 0, 1, 1, 1, 0, 1, 0, 0, 1, 1};
    int64_t s0, s1;
    T_CHECK(dfl_eval_next_span(m, 11, 0, &s0, &s1) && s0 == 2 && s1 == 5, "first span %lld %lld",
            (long long)s0, (long long)s1);
    T_CHECK(dfl_eval_next_span(m, 11, 5, &s0, &s1) && s0 == 6 && s1 == 7, "single-token span");
    T_CHECK(dfl_eval_next_span(m, 11, 7, &s0, &s1) && s0 == 9 && s1 == 11, "span at the end");
    T_CHECK(!dfl_eval_next_span(m, 11, 11, &s0, &s1), "no more");
    T_CHECK(!dfl_eval_next_span(m, 2, 0, &s0, &s1), "none in a prompt");
}

int main(int argc, char **argv)
{
    t_init(argv[0]);
    T_RUN(test_walk_against_simulation);
    T_RUN(test_hand_worked);
    T_RUN(test_spans);
    return t_done();
}
