/* dfl-target: runs a frozen target model (Hugging Face qwen3 / llama / qwen2) over token-batch
 * streams and writes the hidden states of chosen layers as a hidden-state stream. Options here;
 * the model is lib/models/target.c, the read-forward-write loop lib/train/target_run.c. */
#include <errno.h>
#include <getopt.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "backend.h"
#include "cli.h"
#include "hfmodel.h"
#include "json.h"
#include "log.h"
#include "target.h"
#include "tune_file.h"
#include "util.h"

static volatile sig_atomic_t stop_signal;

static void on_signal(int sig) { stop_signal = sig; }

static void usage(void)
{
    printf("Usage: %s --model DIR [OPTION]... [INPUT]...\n"
           "Run a target model over token-batch streams (files or stdin) and write the hidden\n"
           "states of the captured layers as one hidden-state stream.\n"
           "\n"
           "  -m, --model DIR       Hugging Face model directory (config.json, safetensors)\n"
           "  -l, --layers SPEC     captured layers: auto, auto:K or L1,L2,... (default auto:5)\n"
           "  -d, --device DEV      cpu, cuda or cuda:N (default cpu)\n"
           "      --dtype TYPE      dtype of the hidden states written: bf16 or f32 (default bf16;\n"
           "                        on CUDA f32 stores the bf16 forward's results in f32)\n"
           "      --compute TYPE    dtype of the forward's activations: f32 (the CPU's, and an exact\n"
           "                        check of a model on a GPU) or bf16 (the CUDA default)\n"
           "      --max-tokens N    size the buffers for batches of N tokens (default: the\n"
           "                        inputs' warm-up shapes or index on a GPU, else the first\n"
           "                        batch; on the CPU larger batches grow them)\n"
           "      --manifest FILE   size the buffers from dfl-bucket's manifest.json\n"
           "      --inflight N      batches between the forward and the writer (default 2;\n"
           "                        4 when splicing into a pipe)\n"
           "      --profile[=N]     print the time of each stage every N batches (default 10)\n"
           "      --tune            GPU: time cuBLASLt's GEMM algorithms before the first batch\n"
           "      --tune-file FILE  --tune, taking the choices stored in FILE for this GPU and\n"
           "                        cuBLAS, and storing there the ones it times\n"
           "  -o, --output FILE     write to FILE (with an index frame) instead of stdout\n"
           "      --file-io MODE    how FILE is written: write, map or register (default write)\n"
           "      --output-mode MODE\n"
           "                        auto (default): hand the hidden states to a pipe with\n"
           "                        vmsplice, write to anything else; vmsplice: the same; write:\n"
           "                        always write(2) (for consumers that splice(2) the pipe on)\n"
           "      --vmsplice        the same as --output-mode vmsplice\n"
           "      --pipe-size SIZE  enlarge a stdout pipe to SIZE bytes where allowed\n"
           "                        (default 64M; beyond fs.pipe-max-size needs CAP_SYS_RESOURCE)\n"
           "      --zstd LEVEL      compress frames with zstd at LEVEL (1..19; default off)\n"
           "      --no-index        do not end an output file with an index frame\n"
           "      --info            print the model summary and the captured layers as JSON, exit\n"
           "  -q, --quiet           only errors on stderr\n"
           "  -v, --verbose         more detail on stderr\n"
           "      --help            show this help and exit\n"
           "      --version         show the version and exit\n"
           "\n"
           "Exit status: 0 ok; 1 usage or runtime error, interrupted, or the consumer went away;\n"
           "2 invalid data (bad model, unsupported config, bad stream, token id out of range).\n"
           "See dfl-target(1).\n",
           dfl_progname);
}

enum {
    OPT_DTYPE = 256, OPT_COMPUTE, OPT_MAX_TOKENS, OPT_MANIFEST, OPT_INFLIGHT, OPT_PROFILE, OPT_TUNE, OPT_TUNE_FILE, OPT_FILE_IO,
    OPT_OUTPUT_MODE, OPT_VMSPLICE, OPT_PIPE_SIZE, OPT_ZSTD, OPT_NO_INDEX, OPT_INFO, OPT_HELP, OPT_VERSION
};

static const struct option long_opts[] = {
    {"model", required_argument, NULL, 'm'},
    {"layers", required_argument, NULL, 'l'},
    {"device", required_argument, NULL, 'd'},
    {"dtype", required_argument, NULL, OPT_DTYPE},
    {"compute", required_argument, NULL, OPT_COMPUTE},
    {"max-tokens", required_argument, NULL, OPT_MAX_TOKENS},
    {"manifest", required_argument, NULL, OPT_MANIFEST},
    {"inflight", required_argument, NULL, OPT_INFLIGHT},
    {"profile", optional_argument, NULL, OPT_PROFILE},
    {"tune", no_argument, NULL, OPT_TUNE},
    {"tune-file", required_argument, NULL, OPT_TUNE_FILE},
    {"file-io", required_argument, NULL, OPT_FILE_IO},
    {"output-mode", required_argument, NULL, OPT_OUTPUT_MODE},
    {"vmsplice", no_argument, NULL, OPT_VMSPLICE},
    {"pipe-size", required_argument, NULL, OPT_PIPE_SIZE},
    {"output", required_argument, NULL, 'o'},
    {"zstd", required_argument, NULL, OPT_ZSTD},
    {"no-index", no_argument, NULL, OPT_NO_INDEX},
    {"info", no_argument, NULL, OPT_INFO},
    {"quiet", no_argument, NULL, 'q'},
    {"verbose", no_argument, NULL, 'v'},
    {"help", no_argument, NULL, OPT_HELP},
    {"version", no_argument, NULL, OPT_VERSION},
    {NULL, 0, NULL, 0},
};

static void print_layers(char *buf, size_t n, const int32_t *layers, int k)
{
    size_t used = 0;
    buf[0] = 0;
    for (int i = 0; i < k && used < n; i++)
        used += (size_t)snprintf(buf + used, n - used, "%s%d", i ? "," : "", layers[i]);
}

/* --info: the model summary as JSON on stdout, without loading the weights. */
static int print_info(const char *dir, const dfl_hf_config *c, const int32_t *layers, int k,
                      dfl_err *e)
{
    char fp[33];
    int rc = dfl_hf_fingerprint(dir, fp, e);
    if (rc)
        return rc;
    json_t *ls = json_array();
    for (int i = 0; i < k; i++)
        json_array_append_new(ls, json_integer(layers[i]));
    json_t *v = json_pack("{s:s,s:I,s:I,s:I,s:I,s:I,s:I,s:I,s:f,s:f,s:b,s:o,s:s}",
                          "model_type", c->model_type, "num_hidden_layers", (json_int_t)c->n_layers,
                          "hidden_size", (json_int_t)c->hidden_size,
                          "num_attention_heads", (json_int_t)c->n_heads,
                          "num_key_value_heads", (json_int_t)c->n_kv_heads,
                          "head_dim", (json_int_t)c->head_dim,
                          "intermediate_size", (json_int_t)c->intermediate_size,
                          "vocab_size", (json_int_t)c->vocab_size, "rms_norm_eps", c->rms_norm_eps,
                          "rope_theta", c->rope_theta, "tie_word_embeddings", c->tie_word_embeddings,
                          "layers", ls, "fingerprint", fp);
    /* what each layer is: attention, gated attention (qwen3_5 full_attention) or gated deltanet
     * (qwen3_5 linear_attention) */
    json_t *kinds = json_array();
    for (int64_t i = 0; i < c->n_layers; i++)
        json_array_append_new(kinds, json_string(dfl_layer_kind_name(c->layer_kind[i])));
    if (v)
        json_object_set_new(v, "layer_kinds", kinds);
    else
        json_decref(kinds);
    if (v && c->arch == DFL_HF_QWEN35) {
        json_object_set_new(v, "rotary_dims", json_integer(c->rot_dim));
        if (c->n_linear)
            json_object_set_new(v, "linear_attention",
                                json_pack("{s:I,s:I,s:I,s:I,s:I,s:I}", "layers",
                                          (json_int_t)c->n_linear, "num_key_heads",
                                          (json_int_t)c->lin_k_heads, "key_head_dim",
                                          (json_int_t)c->lin_k_dim, "num_value_heads",
                                          (json_int_t)c->lin_v_heads, "value_head_dim",
                                          (json_int_t)c->lin_v_dim, "conv_kernel_dim",
                                          (json_int_t)c->lin_conv));
    }
    if (v && c->rope.kind != DFL_ROPE_DEFAULT)
        json_object_set_new(v, "rope_type", json_string(dfl_rope_kind_name(c->rope.kind)));
    if (v && c->n_experts) {
        int64_t sparse = 0;
        for (int64_t l = 0; l < c->n_layers; l++)
            sparse += dfl_hf_layer_is_moe(c, l);
        json_object_set_new(v, "num_experts", json_integer(c->n_experts));
        json_object_set_new(v, "num_experts_per_tok", json_integer(c->top_k));
        json_object_set_new(v, "moe_intermediate_size", json_integer(c->moe_intermediate));
        json_object_set_new(v, "sparse_layers", json_integer(sparse));
        if (c->shared_intermediate)
            json_object_set_new(v, "shared_expert_intermediate_size",
                                json_integer(c->shared_intermediate));
    }
    char *s = v ? dfl_json_dump(v, 2) : NULL;
    json_decref(v);
    if (!s)
        return dfl_fail(e, DFL_ENOMEM, "out of memory");
    printf("%s\n", s);
    free(s);
    return fflush(stdout) == 0 ? DFL_OK : dfl_fail(e, DFL_EIO, "stdout: write failed");
}

int main(int argc, char **argv)
{
    dfl_cli_init(argv[0]);
    const char *model = NULL, *layers_spec = "auto", *device = "cpu", *output = "-";
    const char *manifest = NULL;
    dfl_dtype dtype = DFL_BF16, compute = DFL_DT_INVALID;   /* compute: the backend's default */
    int64_t max_tokens = 0, inflight = 0, profile = 0;
    int file_io = DFL_FILE_IO_WRITE;
    bool info_only = false, tune = false;
    const char *tune_file = NULL;
    /* --output-mode auto: splices only into a pipe; standard output let go of right after the
     * END frame, so that the consumer does not wait for the GPU's teardown to see the end */
    dfl_writer_opts wopts = {.vmsplice = true, .end_releases_fd = true};
    dfl_err e = {0};
    int c;
    while ((c = getopt_long(argc, argv, "m:l:d:o:qv", long_opts, NULL)) != -1) {
        switch (c) {
        case 'm': model = optarg; break;
        case 'l': layers_spec = optarg; break;
        case 'd': device = optarg; break;
        case 'o': output = optarg; break;
        case OPT_DTYPE:
            dtype = dfl_dtype_from_name(optarg);
            if (dtype != DFL_BF16 && dtype != DFL_F32)
                return dfl_cli_usage_error("--dtype: '%s' is not bf16 or f32", optarg);
            break;
        case OPT_COMPUTE:
            compute = dfl_dtype_from_name(optarg);
            if (compute != DFL_BF16 && compute != DFL_F32)
                return dfl_cli_usage_error("--compute: '%s' is not bf16 or f32", optarg);
            break;
        case OPT_MAX_TOKENS: {
            uint64_t v;
            if (dfl_parse_size(optarg, &v, "--max-tokens", &e) || v < 1 || v > INT32_MAX)
                return dfl_cli_usage_error("--max-tokens: '%s' is not a token count in [1, %d]",
                                           optarg, INT32_MAX);
            max_tokens = (int64_t)v;
            break;
        }
        case OPT_MANIFEST: manifest = optarg; break;
        case OPT_INFLIGHT:
            if (dfl_parse_i64(optarg, 1, 64, &inflight, "--inflight", &e))
                return dfl_cli_usage_error("%s", e.msg);
            break;
        case OPT_PROFILE:
            profile = 10;
            if (optarg && dfl_parse_i64(optarg, 1, 1000000, &profile, "--profile", &e))
                return dfl_cli_usage_error("%s", e.msg);
            break;
        case OPT_TUNE: tune = true; break;
        case OPT_TUNE_FILE:
            if (!optarg[0])
                return dfl_cli_usage_error("--tune-file: an empty file name");
            tune = true;
            tune_file = optarg;
            break;
        case OPT_FILE_IO:
            if (strcmp(optarg, "write") == 0)
                file_io = DFL_FILE_IO_WRITE;
            else if (strcmp(optarg, "map") == 0)
                file_io = DFL_FILE_IO_MAP;
            else if (strcmp(optarg, "register") == 0)
                file_io = DFL_FILE_IO_REGISTER;
            else
                return dfl_cli_usage_error("--file-io: '%s' is not write, map or register", optarg);
            break;
        case OPT_OUTPUT_MODE:
            if (dfl_writer_output_mode(optarg, &wopts, &e))
                return dfl_cli_usage_error("%s", e.msg);
            break;
        case OPT_VMSPLICE: wopts.vmsplice = true; break;
        case OPT_PIPE_SIZE: {
            uint64_t v;
            if (dfl_parse_size(optarg, &v, "--pipe-size", &e) || v < 4096 || v > (1u << 30))
                return dfl_cli_usage_error("--pipe-size: '%s' is not a size in [4K, 1G]", optarg);
            wopts.pipe_size = (uint32_t)v;
            break;
        }
        case OPT_ZSTD: {
            int64_t v;
            if (dfl_parse_i64(optarg, 1, 19, &v, "--zstd", &e))
                return dfl_cli_usage_error("%s", e.msg);
            wopts.zstd_level = (int)v;
            break;
        }
        case OPT_NO_INDEX: wopts.no_index = true; break;
        case OPT_INFO: info_only = true; break;
        case 'q': dfl_log_level = DFL_LOG_ERROR; break;
        case 'v': dfl_log_level = dfl_log_level < DFL_LOG_VERBOSE ? DFL_LOG_VERBOSE : DFL_LOG_DEBUG; break;
        case OPT_HELP: usage(); return 0;
        case OPT_VERSION: puts(dfl_cli_version_line()); return 0;
        default: return dfl_cli_usage_error("unknown or incomplete option");
        }
    }
    if (!model)
        return dfl_cli_usage_error("--model DIR is required");
    if (max_tokens && manifest)
        return dfl_cli_usage_error("--max-tokens and --manifest both size the buffers: give one");
    const char *stdin_only[] = {"-"};
    const char *const *inputs = optind < argc ? (const char *const *)argv + optind : stdin_only;
    int n_inputs = optind < argc ? argc - optind : 1;

    /* What can be checked cheaply is checked before the (slow) weight loading. */
    if (!info_only && strcmp(output, "-") == 0 && dfl_is_tty(1))
        return dfl_cli_usage_error("refusing to write binary hidden states to a terminal "
                                   "(redirect stdout or use -o FILE)");
    for (int i = 0; i < n_inputs && !info_only; i++)
        if (strcmp(inputs[i], "-") != 0 && access(inputs[i], R_OK) != 0) {
            dfl_fail_errno(&e, DFL_EIO, errno, "%s", inputs[i]);
            return dfl_cli_report(&e);
        }
    dfl_hf_config cfg;
    if (dfl_hf_config_load(model, &cfg, NULL, &e))
        return dfl_cli_report(&e);
    int32_t layers[DFL_MAX_LAYERS];
    int n_layers = 0;
    if (dfl_target_parse_layers(layers_spec, cfg.n_layers, layers, &n_layers, &e))
        return dfl_cli_report(&e);
    char lbuf[DFL_MAX_LAYERS * 12];
    print_layers(lbuf, sizeof lbuf, layers, n_layers);
    if (strncmp(layers_spec, "auto", 4) == 0) {
        int64_t k = 5;
        if (layers_spec[4] == ':')
            dfl_parse_i64(layers_spec + 5, 1, DFL_MAX_LAYERS, &k, "--layers", &e);
        if (n_layers < k)
            dfl_info("%s: %lld layers is too few for %lld captured layers: capturing %d",
                     model, (long long)cfg.n_layers, (long long)k, n_layers);
    }
    if (info_only) {
        if (print_info(model, &cfg, layers, n_layers, &e))
            return dfl_cli_report(&e);
        return 0;
    }

    dfl_tune_file *tf = NULL;   /* read and checked before the run, whether a GPU uses it or not */
    if (tune_file && dfl_tune_file_open(&tf, tune_file, &e)) {
        dfl_err_prefix(&e, "--tune-file: ");
        return dfl_cli_report(&e);
    }

    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_handler = on_signal;
    sa.sa_flags = SA_RESETHAND | SA_RESTART; /* a second signal ends the program at once */
    sigemptyset(&sa.sa_mask);
    sigaction(SIGINT, &sa, NULL);
    sigaction(SIGTERM, &sa, NULL);

    dfl_be *be = NULL;
    dfl_target *t = NULL;
    int rc = dfl_be_open(&be, device, compute, &e);
    if (!rc) {
        double t0 = dfl_now();
        rc = dfl_target_open(&t, be, model, layers[n_layers - 1] + 1, &e);
        if (!rc) {
            char b[32];
            dfl_info("%s: %s, %lld layers (%d loaded), hidden %lld, %s of weights on %s in %.1f s; "
                     "computing in %s, capturing layers %s as %s", model, cfg.model_type, (long long)cfg.n_layers,
                     t->n_loaded, (long long)cfg.hidden_size,
                     dfl_fmt_bytes((double)t->weight_bytes, b, sizeof b), be->name,
                     dfl_now() - t0, dfl_dtype_lower(be->act), lbuf, dfl_dtype_lower(dtype));
        }
    }
    if (!rc) {
        dfl_target_run_opts o = {
            .inputs = inputs, .n_inputs = n_inputs, .output = output,
            .n_caps = n_layers, .layers = layers, .dtype = dtype,
            .max_tokens = max_tokens, .manifest = manifest, .grow = be->kind == DFL_BE_CPU,
            .inflight = (int)inflight, .profile = (int)profile, .file_io = file_io, .tune = tune,
            .tune_file = tf,
            .wopts = wopts, .stop = &stop_signal,
        };
        dfl_target_stats st;
        rc = dfl_target_run(t, &o, &st, &e);
        if (!rc) {
            dfl_verbose("setup (buffers, warm-up) took %.2f s before the first batch",
                        st.setup_seconds);
            dfl_info("%llu batches, %llu sequences, %llu tokens in %.2f s (%.0f tokens/s)",
                     (unsigned long long)st.batches, (unsigned long long)st.seqs,
                     (unsigned long long)st.tokens, st.seconds,
                     st.tokens / (st.seconds > 0 ? st.seconds : 1e-9));
        }
    }
    dfl_target_close(t);
    dfl_be_close(be);
    dfl_tune_file_close(tf);
    return rc ? dfl_cli_report(&e) : 0;
}
