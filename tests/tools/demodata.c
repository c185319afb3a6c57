/* demodata: writes the synthetic chat dataset of the demo (examples/demo) and of the pipeline
 * tests, in JSON Lines as dfl-bucket(1) reads it: {"id":N,"input_ids":[...],"labels":[...]}.
 *
 * The "language" is made to be learnable by a drafter, as text is: the content tokens
 * (3 .. V-2) are dealt into phrases of 2 to 6 distinct tokens, no token in two phrases, so that
 * inside a phrase the next token follows from the current one; each phrase has a usual
 * successor phrase (the phrases form one cycle in a random order), taken with probability
 * 1 - --noise (else a phrase at random), so that a phrase boundary is mostly predictable too. A sample is a turn of a chat:
 *     0 (user)  4..16 random content tokens  1 (assistant)  phrases ...  2 (end)
 * with labels -100 on the user turn and the assistant marker (not trained on) and the token id
 * elsewhere. The response is --min-len to --max-len tokens long (uniform), cut at the end of
 * the phrase that reaches its length. Token V-1 never occurs: it is the drafter's mask token.
 * A drafter that learns the language accepts about 7 tokens of a block of 8 (tau ~ 7 with the
 * default noise); one that learns nothing accepts about 1.
 * Deterministic: the same options give the same bytes. */
#include <errno.h>
#include <getopt.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cli.h"
#include "draft_rng.h"

enum { TOK_USER = 0, TOK_ASSISTANT = 1, TOK_END = 2, FIRST_CONTENT = 3 };

typedef struct language {
    int n_phrases;
    int *start, *len;   /* [n_phrases]: phrase p is tokens[start[p] .. start[p] + len[p]) */
    int *next;          /* [n_phrases]: the usual successor of phrase p */
    int *tokens;        /* [content]: the content tokens in phrase order */
} language;

static void usage(void)
{
    printf("Usage: demodata [OPTION]...\n"
           "Write the demo's synthetic chat dataset (JSON Lines: input_ids, labels).\n"
           "\n"
           "  -n, --samples N     samples (default 2000)\n"
           "      --vocab V       vocabulary size, 16 to 1000000 (default 256; V-1 is never used)\n"
           "      --min-len N     shortest response in tokens (default 24)\n"
           "      --max-len N     longest response in tokens (default 120)\n"
           "      --noise P       probability of a random phrase at a boundary (default 0.1)\n"
           "      --seed N        seed of the language and the samples (default 1)\n"
           "  -o, --output FILE   write to FILE (default: standard output)\n"
           "      --help          this text\n");
}

static int parse_int(const char *s, const char *opt, long lo, long hi, long *v)
{
    char *end;
    errno = 0;
    long x = strtol(s, &end, 10);
    if (errno || end == s || *end || x < lo || x > hi)
        return dfl_cli_usage_error("%s: '%s' is not an integer in [%ld, %ld]", opt, s, lo, hi);
    *v = x;
    return 0;
}

/* Deals the content tokens 3 .. V-2, shuffled, into phrases of 2 to 6 tokens, and draws each
 * phrase's usual successor. */
static int make_language(language *L, int vocab, dfl_rng *r)
{
    int content = vocab - 1 - FIRST_CONTENT;
    L->tokens = malloc(sizeof(int) * (size_t)content);
    L->start = malloc(sizeof(int) * (size_t)content);
    L->len = malloc(sizeof(int) * (size_t)content);
    L->next = malloc(sizeof(int) * (size_t)content);
    if (!L->tokens || !L->start || !L->len || !L->next)
        return -1;
    for (int i = 0; i < content; i++)
        L->tokens[i] = FIRST_CONTENT + i;
    for (int i = content - 1; i > 0; i--) {
        int j = (int)dfl_rng_below(r, (uint64_t)i + 1);
        int t = L->tokens[i];
        L->tokens[i] = L->tokens[j];
        L->tokens[j] = t;
    }
    L->n_phrases = 0;
    for (int at = 0; at < content;) {
        int n = 2 + (int)dfl_rng_below(r, 5);
        if (content - at - n < 2)   /* no phrase of one token: the last one takes the rest */
            n = content - at;
        L->start[L->n_phrases] = at;
        L->len[L->n_phrases++] = n;
        at += n;
    }
    /* successors: one cycle through every phrase in a random order, so that a response walks
     * through the whole language rather than falling into a short loop */
    int *order = malloc(sizeof(int) * (size_t)L->n_phrases);
    if (!order)
        return -1;
    for (int p = 0; p < L->n_phrases; p++)
        order[p] = p;
    for (int i = L->n_phrases - 1; i > 0; i--) {
        int j = (int)dfl_rng_below(r, (uint64_t)i + 1);
        int t = order[i];
        order[i] = order[j];
        order[j] = t;
    }
    for (int i = 0; i < L->n_phrases; i++)
        L->next[order[i]] = order[(i + 1) % L->n_phrases];
    free(order);
    return 0;
}

static void put_list(FILE *f, const int *v, const int *lab, int n)
{
    for (int i = 0; i < n; i++)
        fprintf(f, i ? ",%d" : "%d", lab && lab[i] < 0 ? -100 : v[i]);
}

int main(int argc, char **argv)
{
    dfl_cli_init(argv[0]);
    long samples = 2000, vocab = 256, min_len = 24, max_len = 120, seed = 1;
    double noise = 0.1;
    const char *out = NULL;
    static const struct option lo[] = {
        {"samples", 1, 0, 'n'}, {"vocab", 1, 0, 'V'}, {"min-len", 1, 0, 'a'},
        {"max-len", 1, 0, 'b'}, {"noise", 1, 0, 'p'}, {"seed", 1, 0, 's'},
        {"output", 1, 0, 'o'}, {"help", 0, 0, 'h'}, {0, 0, 0, 0}};
    int c;
    while ((c = getopt_long(argc, argv, "n:o:", lo, NULL)) != -1) {
        int rc = 0;
        switch (c) {
        case 'n': rc = parse_int(optarg, "--samples", 1, 100000000, &samples); break;
        case 'V': rc = parse_int(optarg, "--vocab", 16, 1000000, &vocab); break;
        case 'a': rc = parse_int(optarg, "--min-len", 1, 1000000, &min_len); break;
        case 'b': rc = parse_int(optarg, "--max-len", 1, 1000000, &max_len); break;
        case 's': rc = parse_int(optarg, "--seed", 0, 0x7fffffffL, &seed); break;
        case 'p': {
            char *end;
            noise = strtod(optarg, &end);
            if (end == optarg || *end || !(noise >= 0 && noise <= 1))
                rc = dfl_cli_usage_error("--noise: '%s' is not a probability", optarg);
            break;
        }
        case 'o': out = optarg; break;
        case 'h': usage(); return 0;
        default: return 1;
        }
        if (rc)
            return rc;
    }
    if (optind < argc)
        return dfl_cli_usage_error("unexpected argument '%s'", argv[optind]);
    if (min_len > max_len)
        return dfl_cli_usage_error("--min-len %ld is more than --max-len %ld", min_len, max_len);

    dfl_rng lang_rng, rng;
    dfl_rng_seed(&lang_rng, dfl_hash2((uint64_t)seed, 0x4c414e47ull));
    dfl_rng_seed(&rng, dfl_hash2((uint64_t)seed, 0x53414d50ull));
    language L = {0};
    int cap = (int)max_len + 32;   /* user, prompt, assistant, response, a phrase, end */
    int *ids = malloc(sizeof(int) * (size_t)cap), *lab = malloc(sizeof(int) * (size_t)cap);
    if (make_language(&L, (int)vocab, &lang_rng) || !ids || !lab) {
        fprintf(stderr, "demodata: out of memory\n");
        return 1;
    }
    FILE *f = stdout;
    if (out && !(f = fopen(out, "w"))) {
        fprintf(stderr, "demodata: %s: %s\n", out, strerror(errno));
        return 1;
    }
    int content = (int)vocab - 1 - FIRST_CONTENT;
    for (long s = 0; s < samples; s++) {
        int n = 0;
        ids[n] = TOK_USER, lab[n++] = -1;
        int prompt = 4 + (int)dfl_rng_below(&rng, 13);
        for (int i = 0; i < prompt; i++)
            ids[n] = FIRST_CONTENT + (int)dfl_rng_below(&rng, (uint64_t)content), lab[n++] = -1;
        ids[n] = TOK_ASSISTANT, lab[n++] = -1;
        int want = (int)min_len + (int)dfl_rng_below(&rng, (uint64_t)(max_len - min_len + 1));
        int p = (int)dfl_rng_below(&rng, (uint64_t)L.n_phrases);
        for (int got = 0; got < want;) {
            for (int i = 0; i < L.len[p]; i++, got++)
                ids[n] = L.tokens[L.start[p] + i], lab[n++] = 1;
            p = dfl_rng_double(&rng) < noise ? (int)dfl_rng_below(&rng, (uint64_t)L.n_phrases)
                                             : L.next[p];
        }
        ids[n] = TOK_END, lab[n++] = 1;
        fprintf(f, "{\"id\":%ld,\"input_ids\":[", s);
        put_list(f, ids, NULL, n);
        fputs("],\"labels\":[", f);
        put_list(f, ids, lab, n);
        fputs("]}\n", f);
    }
    if (fflush(f) || ferror(f) || (f != stdout && fclose(f))) {
        fprintf(stderr, "demodata: %s: write error: %s\n", out ? out : "standard output",
                strerror(errno));
        return 1;
    }
    free(ids), free(lab), free(L.tokens), free(L.start), free(L.len), free(L.next);
    return 0;
}
