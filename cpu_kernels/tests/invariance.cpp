// Op-level batch-invariance check for ggml's CPU matrix products and flash attention.
//
// For one weight type and one op (MUL_MAT or MUL_MAT_ID) it computes every column of a random
// activation matrix twice: alone (a width-1 product, the q1 reference) and inside products of
// widths 1..512. Every column of every width must be bit for bit its width-1 result. The width-1
// results (of the first 16 tokens and every 4th) are also compared with a dequantize-then-dot
// reference in double precision: that is how close the kernel is to the real product (a
// diagnostic with a per-type bound, never the verdict on invariance).
//
// Weights are placed the way llama.cpp places them: in the first extra buffer type of the CPU
// device (AMX, repack, ...) whose supports_op accepts the product, else in plain CPU memory
// (--placement auto); --placement cpu forces plain memory, --placement NAME that extra buffer type.
// Types whose quantizer needs an importance matrix (ggml_quantize_requires_imatrix) get a positive
// per-column one, the mean square of the activations per K index (--imatrix auto; on: every
// quantized type; off: none, a usage error for those types, whose quantizer would abort).
//
// --plant is the planted-bug twin: the wide products see their weights' K blocks rotated by one
// block relative to the width-1 run's (the same weights, summed in another order, as a kernel
// that walked K from another start would). The check must then report differences.
//
// --op flash_attn_ext checks ggml_flash_attn_ext the same way: --type is the K/V cache type
// (default f16), the cache holds --kv cells (+ --pad empty cells), each query token j of a batch
// has its own mask row (causal at cell kv - max_width + j, optionally a --window sliding window),
// and every query row computed alone (width 1) must equal the same row inside a batch of width n.
// The double-precision reference is a plain softmax over the visible cells. Its planted twin
// (--plant) gives the wide runs the cache with its cells permuted (K, V and every mask row the
// same way): the same terms summed in another order. --ref-view P gives each width-1 reference
// only the cells up to its own, padded to a multiple of P (llama.cpp's view of the cache after
// that token alone), while the batches see the whole cache: a row must not depend on how many
// masked cells follow it. --holes H gives the batches H masked cells in the middle of the cache
// (DeepSeek-V4 hands attention its raw cells, which grow with the batch, in front of its
// compressed rows): a row must not depend on where masked cells lie either; --holes-at C puts
// them in front of cell C instead of the middle.
//
// --backend NAME runs the products on another ggml device (e.g. CUDA0, ROCm0: the GPU check in
// scripts/gpu-check); weights then live in that device's buffer type and --placement is ignored.
// --src1 strided gives the activations rows with a stride of two rows (a view, as DeepSeek-V4's
// grouped output hands them over); --src1 broadcast gives them a third dimension of 2 over one
// weight matrix (ggml broadcasts src0 over src1's ne2): column j is then the pair of rows (j, b).
//
// --zero-tail T (MUL_MAT): every width, 1 included, multiplies over K + T instead, the weights
// given T more columns (random) and every activation column T zeros after its K values, as
// non-flash attention multiplies softmax weights of exactly 0 by the cells past a row's last visible
// one in a cache view that grows with the batch. Each column must still be its width-1 result over K:
// a kernel whose sum is not left as it was by a run of zero terms (a K split that follows K, a
// compensated sum that hands its correction to a zero partial) fails it.
//
// Shapes: --k (the reduction), --m (weight rows), --experts/--used (MUL_MAT_ID), --groups (a 3-D
// stack of matrices), --threads (of every product; --ref-threads N gives the width-1 reference runs
// N threads instead, a check of thread-count invariance on top of batch invariance).
//
// --op add_rms_norm checks a pattern that backends fuse rather than one op: rms_norm(x + r) * w over
// rows of --k values (one row a token), built as one graph, so the backend may run the three nodes
// as one dispatch (ggml-vulkan hands the norm partial sums from the add when a ubatch has one row).
// Every row alone must equal the same row inside a batch. Rows are f32 (no --type). Its planted twin
// gives the wide runs' norm another epsilon (1e-5 for 1e-6): a bug of one or two ulps per value, which
// the check must see. (An order-only plant would not do here: the CPU backend sums each row's
// squares in double precision, where another order changes nothing.)
//
// --list-types prints, as one JSON line, the weight types the CPU backend runs MUL_MAT for here
// (a to_float, a CPU vec_dot and supports_op accepting the product), the types it refuses with
// the reason, the types that need an importance matrix, and the extra buffer types it offers
// (every summary line names those too: "extra_buffers").
//
// Several checks separated by --then run in one process, each from the default options.
//
// Output: one JSON object per line per width, then a summary line per check; exit 0 when every
// width of every check is invariant (or, with --plant, when every width >= 2 was caught), 1
// otherwise, 2 on bad usage (one line on stderr). For flash_attn_ext the summary's "k" is the
// head dim (the q.k reduction) and "m" the cache cells.
#include "ggml.h"
#include "ggml-alloc.h"
#include "ggml-backend.h"
#include "ggml-cpu.h"

#include <algorithm>
#include <cerrno>
#include <cinttypes>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <numeric>
#include <random>
#include <string>
#include <thread>
#include <utility>
#include <vector>

namespace {

struct Options {
    std::string type = "q4_0";
    bool type_set = false;
    std::string op = "mul_mat";
    std::string placement = "auto";
    std::string backend = "cpu";
    std::string src1 = "contiguous";  // contiguous, strided or broadcast
    std::string imatrix = "auto";     // auto, on or off
    int k = 1024;
    int m = 256;
    int threads = 2;
    int ref_threads = 0;  // threads of the width-1 reference runs (0: --threads)
    int n_expert = 4;
    int n_used = 2;
    int groups = 1;  // > 1: a stack of `groups` weight matrices and permuted activations (DeepSeek-V4's grouped output)
    bool plant = false;
    bool list_types = false;
    // flash attention
    int head_dim = 128;
    int head_dim_v = 0;  // 0: head_dim
    int heads = 8;
    int kv_heads = 2;
    int kv = 640;     // used cells
    int pad = 0;      // empty cells after them (masked for every row)
    int window = 0;   // > 0: a row sees only the last `window` cells up to its own
    bool sinks = false;
    float softcap = 0.0f;
    int ref_view = 0; // > 0: a width-1 reference sees the cache cut after its own cell, padded to a multiple of this
    int holes = 0;    // > 0: the batches see this many masked cells inserted in the middle of the cache
    int holes_at = -1; // the cell the holes go in front of (-1: kv / 2)
    int zero_tail = 0; // > 0 (mul_mat): every width runs over K + zero_tail, the extra activations 0
    std::vector<int> widths = {1, 2, 3, 4, 5, 7, 8, 9, 15, 16, 17, 63, 64, 65, 127, 128, 129, 257, 512};
    unsigned seed = 42;
};

[[noreturn]] void usage(const std::string & msg) {
    std::fprintf(stderr, "invariance: %s\n", msg.c_str());
    std::exit(2);
}

ggml_type parse_type(const std::string & name) {
    for (int t = 0; t < GGML_TYPE_COUNT; t++) {
        const char * n = ggml_type_name((ggml_type) t);
        if (n && ggml_blck_size((ggml_type) t) > 0 && name == n) {
            return (ggml_type) t;
        }
    }
    usage("unknown type " + name);
}

int parse_int(const std::string & opt, const char * s, long lo, long hi) {
    char * end = nullptr;
    errno = 0;
    long v = std::strtol(s, &end, 10);
    if (end == s || *end || errno || v < lo || v > hi) {
        usage(opt + " wants an integer in " + std::to_string(lo) + ".." + std::to_string(hi));
    }
    return (int) v;
}

std::vector<int> parse_widths(const char * s) {
    std::vector<int> out;
    for (const char * p = s; *p;) {
        char * end = nullptr;
        long v = std::strtol(p, &end, 10);
        if (end == p || v < 1 || v > 4096 || (*end && *end != ',')) {
            usage("--widths wants a comma-separated list of integers in 1..4096");
        }
        out.push_back((int) v);
        p = *end == ',' ? end + 1 : end;
    }
    if (out.empty()) usage("--widths wants a comma-separated list of integers in 1..4096");
    return out;
}

Options parse(const std::vector<std::string> & args) {
    Options o;
    const int argc = (int) args.size();
    for (int i = 0; i < argc; i++) {
        const std::string & a = args[i];
        auto val = [&]() -> const char * {
            if (i + 1 >= argc) usage(a + " needs a value");
            return args[++i].c_str();
        };
        if (a == "--type") { o.type = val(); o.type_set = true; }
        else if (a == "--op") o.op = val();
        else if (a == "--placement") o.placement = val();
        else if (a == "--k") o.k = parse_int(a, val(), 1, 1 << 20);
        else if (a == "--m") o.m = parse_int(a, val(), 1, 1 << 16);
        else if (a == "--threads") o.threads = parse_int(a, val(), 1, 1024);
        else if (a == "--ref-threads") o.ref_threads = parse_int(a, val(), 1, 1024);
        else if (a == "--widths") o.widths = parse_widths(val());
        else if (a == "--seed") o.seed = (unsigned) parse_int(a, val(), 0, 1 << 30);
        else if (a == "--plant") o.plant = true;
        else if (a == "--groups") o.groups = parse_int(a, val(), 1, 64);
        else if (a == "--experts") o.n_expert = parse_int(a, val(), 1, 256);
        else if (a == "--used") o.n_used = parse_int(a, val(), 1, 256);
        else if (a == "--backend") o.backend = val();
        else if (a == "--src1") o.src1 = val();
        else if (a == "--imatrix") o.imatrix = val();
        else if (a == "--list-types") o.list_types = true;
        else if (a == "--head-dim") o.head_dim = parse_int(a, val(), 1, 4096);
        else if (a == "--head-dim-v") o.head_dim_v = parse_int(a, val(), 1, 4096);
        else if (a == "--heads") o.heads = parse_int(a, val(), 1, 256);
        else if (a == "--kv-heads") o.kv_heads = parse_int(a, val(), 1, 256);
        else if (a == "--kv") o.kv = parse_int(a, val(), 1, 1 << 20);
        else if (a == "--pad") o.pad = parse_int(a, val(), 0, 1 << 20);
        else if (a == "--window") o.window = parse_int(a, val(), 0, 1 << 20);
        else if (a == "--sinks") o.sinks = true;
        else if (a == "--ref-view") o.ref_view = parse_int(a, val(), 0, 1 << 20);
        else if (a == "--holes") o.holes = parse_int(a, val(), 0, 1 << 20);
        else if (a == "--holes-at") o.holes_at = parse_int(a, val(), 0, 1 << 20);
        else if (a == "--zero-tail") o.zero_tail = parse_int(a, val(), 0, 1 << 20);
        else if (a == "--softcap") {
            const char * s = val();
            char * end = nullptr;
            o.softcap = std::strtof(s, &end);
            if (end == s || *end || !(o.softcap >= 0.0f) || !std::isfinite(o.softcap)) usage("--softcap wants a number >= 0");
        }
        else usage("unknown option " + a);
    }
    if (o.ref_threads == 0) o.ref_threads = o.threads;
    if (o.ref_threads != o.threads && o.backend != "cpu") usage("--ref-threads applies to the CPU backend only");
    if (o.op != "mul_mat" && o.op != "mul_mat_id" && o.op != "flash_attn_ext" && o.op != "add_rms_norm")
        usage("--op is mul_mat, mul_mat_id, flash_attn_ext or add_rms_norm");
    if (o.placement.empty()) usage("--placement is auto, cpu or the name of an extra buffer type (AMX, CPU_REPACK)");
    if (o.imatrix != "auto" && o.imatrix != "on" && o.imatrix != "off") usage("--imatrix is auto, on or off");
    if (o.groups > 1 && o.op != "mul_mat") usage("--groups needs --op mul_mat");
    if (o.n_used > o.n_expert) usage("--used must be <= --experts");
    if (o.src1 != "contiguous" && o.src1 != "strided" && o.src1 != "broadcast")
        usage("--src1 is contiguous, strided or broadcast");
    if (o.src1 != "contiguous" && (o.op != "mul_mat" || o.groups > 1))
        usage("--src1 strided|broadcast needs --op mul_mat without --groups");
    if (o.zero_tail && (o.op != "mul_mat" || o.groups > 1 || o.src1 != "contiguous" || o.plant))
        usage("--zero-tail needs --op mul_mat without --groups, --src1 or --plant");
    if (o.op == "add_rms_norm") {
        if (o.type_set && o.type != "f32") usage("--op add_rms_norm runs f32 rows (no --type)");
        o.type = "f32";
    }
    if (o.op == "flash_attn_ext") {
        if (!o.type_set) o.type = "f16";
        if (o.head_dim_v == 0) o.head_dim_v = o.head_dim;
        if (o.heads % o.kv_heads) usage("--heads must be a multiple of --kv-heads");
        if (o.placement != "auto") usage("--placement applies to mul_mat and mul_mat_id (the KV cache is plain memory)");
        if (o.holes && o.plant) usage("--holes and --plant are two different twins: one at a time");
        if (o.holes_at > o.kv) usage("--holes-at must be a cell of the cache (0 to --kv)");
    } else if (o.ref_view || o.holes || o.holes_at >= 0) {
        usage("--ref-view and --holes apply to flash_attn_ext");
    }
    return o;
}

// The checks that need the type's traits (after ggml_cpu_init), for every check of a command
// line before any runs.
void validate(const Options & o) {
    if (o.list_types) return;
    if (o.op == "add_rms_norm") {
        if (o.placement != "auto") usage("--placement applies to mul_mat and mul_mat_id");
        return;
    }
    const ggml_type type = parse_type(o.type);
    const int64_t blk = ggml_blck_size(type);
    const bool has_product = type == GGML_TYPE_F32 ||
                             (ggml_get_type_traits(type)->to_float && ggml_get_type_traits_cpu(type)->vec_dot);
    int max_w = 1;
    for (int w : o.widths) max_w = w > max_w ? w : max_w;
    if (o.op == "flash_attn_ext") {
        if (!has_product) usage("the CPU backend has no flash attention for a " + o.type + " cache (no to_float or vec_dot)");
        if (o.head_dim % blk || o.head_dim_v % blk)
            usage("--head-dim and --head-dim-v must be multiples of the type's block size (" + std::to_string(blk) + ")");
        if (ggml_quantize_requires_imatrix(type)) usage(o.type + " needs an importance matrix: not a KV cache type");
        if (max_w > o.kv) usage("--kv must hold the widest batch (" + std::to_string(max_w) + " cells)");
        return;
    }
    if (!has_product) usage("the CPU backend has no matrix product for " + o.type + " (no to_float or vec_dot)");
    if (o.k % blk) usage("--k must be a multiple of the type's block size (" + std::to_string(blk) + ")");
    if (o.zero_tail % blk) usage("--zero-tail must be a multiple of the type's block size (" + std::to_string(blk) + ")");
    if (o.plant && o.k / blk < 2)
        usage("--plant rotates K blocks: --k must hold at least two blocks of " + o.type + " (" + std::to_string(2 * blk) + ")");
    if (o.backend != "cpu" && o.placement != "auto") usage("--placement applies to the CPU backend only");
    if (ggml_quantize_requires_imatrix(type) && o.imatrix == "off")
        usage(o.type + " needs an importance matrix (--imatrix auto or on)");
}

std::string json_list(const std::vector<std::string> & v) {
    std::string s = "[";
    for (size_t i = 0; i < v.size(); i++) s += (i ? ", \"" : "\"") + v[i] + "\"";
    return s + "]";
}

// sum a[i] * b[i] in double precision, in 8 independent partial sums (the compiler may vectorize
// them: each lane's order is fixed), for the reference products
double dot_double(const float * a, const float * b, int64_t n) {
    double acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    int64_t i = 0;
    for (; i + 8 <= n; i += 8)
        for (int u = 0; u < 8; u++) acc[u] += (double) a[i + u] * (double) b[i + u];
    for (; i < n; i++) acc[0] += (double) a[i] * (double) b[i];
    return ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
}

// The tokens the double-precision reference is computed for: the first 16, then every 4th (it
// costs more than the products it checks)
bool reference_token(int j) { return j < 16 || j % 4 == 0; }

int reference_tokens(int max_w) {
    int n = 0;
    for (int j = 0; j < max_w; j++) n += reference_token(j);
    return n;
}

// Bits of a and b apart, as unsigned distance of their encodings (0: identical).
uint32_t ulp_distance(float a, float b) {
    uint32_t ua, ub;
    std::memcpy(&ua, &a, 4);
    std::memcpy(&ub, &b, 4);
    return ua > ub ? ua - ub : ub - ua;
}

// The CPU device's extra buffer types, in the order llama.cpp tries them.
std::vector<ggml_backend_buffer_type_t> cpu_extra_bufts() {
    std::vector<ggml_backend_buffer_type_t> out;
    ggml_backend_dev_t dev = ggml_backend_dev_by_type(GGML_BACKEND_DEVICE_TYPE_CPU);
    if (!dev) return out;
    ggml_backend_reg_t reg = ggml_backend_dev_backend_reg(dev);
    auto get_extra = (ggml_backend_dev_get_extra_bufts_t) ggml_backend_reg_get_proc_address(reg, "ggml_backend_dev_get_extra_bufts");
    if (!get_extra) return out;
    for (ggml_backend_buffer_type_t * b = get_extra(dev); b && *b; b++) out.push_back(*b);
    return out;
}

std::vector<std::string> cpu_extra_names() {
    std::vector<std::string> names;
    for (auto * b : cpu_extra_bufts()) names.push_back(ggml_backend_buft_name(b));
    return names;
}

bool needs_imatrix(const Options & o, ggml_type type) {
    if (o.imatrix == "off" || !ggml_is_quantized(type)) return false;
    return o.imatrix == "on" || ggml_quantize_requires_imatrix(type);
}

// Weight bytes of `type` for rows of k values, from float data (imatrix: k positive weights or null).
std::vector<uint8_t> quantize(ggml_type type, const std::vector<float> & f, int64_t rows, int64_t k, const float * imatrix,
                              int threads) {
    std::vector<uint8_t> out(ggml_row_size(type, k) * rows);
    if (type == GGML_TYPE_F32) {
        std::memcpy(out.data(), f.data(), out.size());
    } else {
        // rows are quantized independently: split them over threads (the IQ quantizers are slow)
        ggml_quantize_init(type);
        const float * im = ggml_is_quantized(type) ? imatrix : nullptr;
        const int64_t n_thr = std::max<int64_t>(1, std::min<int64_t>(threads, rows));
        const int64_t per = (rows + n_thr - 1) / n_thr;
        std::vector<std::thread> pool;
        for (int64_t r0 = 0; r0 < rows; r0 += per) {
            const int64_t nr = std::min(per, rows - r0);
            pool.emplace_back([&, r0, nr] { ggml_quantize_chunk(type, f.data(), out.data(), r0 * k, nr, k, im); });
        }
        for (auto & th : pool) th.join();
    }
    return out;
}

std::vector<float> dequantize(ggml_type type, const std::vector<uint8_t> & q, int64_t n) {
    std::vector<float> out(n);
    if (type == GGML_TYPE_F32) {
        std::memcpy(out.data(), q.data(), n * sizeof(float));
    } else {
        ggml_get_type_traits(type)->to_float(q.data(), out.data(), n);
    }
    return out;
}

// Rotate every row's K blocks by one block: the planted bug (another K order for the same sums).
std::vector<uint8_t> rotate_blocks(ggml_type type, const std::vector<uint8_t> & w, int64_t rows, int64_t k) {
    const size_t row = ggml_row_size(type, k);
    const size_t blk = ggml_type_size(type);
    const size_t nblk = row / blk;
    std::vector<uint8_t> out(w.size());
    for (int64_t r = 0; r < rows; r++) {
        for (size_t b = 0; b < nblk; b++) {
            std::memcpy(&out[r * row + ((b + 1) % nblk) * blk], &w[r * row + b * blk], blk);
        }
    }
    return out;
}

std::vector<float> rotate_floats(const std::vector<float> & x, int64_t cols, int64_t k, int64_t blk) {
    const int64_t nblk = k / blk;
    std::vector<float> out(x.size());
    for (int64_t c = 0; c < cols; c++) {
        for (int64_t b = 0; b < nblk; b++) {
            std::memcpy(&out[c * k + ((b + 1) % nblk) * blk], &x[c * k + b * blk], blk * sizeof(float));
        }
    }
    return out;
}

// One backend with its threads; every product of a run goes through it.
struct Device {
    const Options & o;
    ggml_backend_t backend = nullptr;

    Device(const Options & opt, int threads) : o(opt) {
        if (o.backend == "cpu") {
            backend = ggml_backend_cpu_init();
            if (!backend) usage("cannot initialise the CPU backend");
            ggml_backend_cpu_set_n_threads(backend, threads);
            return;
        }
        static bool loaded = false;  // once per process (checks after --then reuse the registry)
        if (!loaded) ggml_backend_load_all();
        loaded = true;
        ggml_backend_dev_t dev = ggml_backend_dev_by_name(o.backend.c_str());
        if (!dev) usage("no ggml device named " + o.backend + " in this build");
        backend = ggml_backend_dev_init(dev, nullptr);
        if (!backend) usage("cannot initialise the " + o.backend + " backend");
    }
    Device(const Device &) = delete;
    Device & operator=(const Device &) = delete;
    ~Device() { ggml_backend_free(backend); }
    bool on_cpu() const { return o.backend == "cpu"; }
};

// Data set once in a buffer of its own (weights, a KV cache): extra buffer types convert on upload.
struct Resident {
    ggml_context * ctx = nullptr;
    ggml_backend_buffer_t buf = nullptr;
    std::vector<ggml_tensor *> t;

    Resident() = default;
    Resident(const Resident &) = delete;
    Resident & operator=(const Resident &) = delete;
    ~Resident() {
        if (buf) ggml_backend_buffer_free(buf);
        if (ctx) ggml_free(ctx);
    }
    void init(int n_tensors) {
        ggml_init_params p = {ggml_tensor_overhead() * (size_t) n_tensors, nullptr, true};
        ctx = ggml_init(p);
    }
    void alloc(ggml_backend_buffer_type_t buft) {
        buf = ggml_backend_alloc_ctx_tensors_from_buft(ctx, buft);
        if (!buf) usage("cannot allocate the weights");
        ggml_backend_buffer_set_usage(buf, GGML_BACKEND_BUFFER_USAGE_WEIGHTS);
    }
};

// The per-width comparison with the width-1 results, and its JSON line.
struct Tally {
    const Options & o;
    std::string buffer;
    int bad_widths = 0, caught = 0, wide = 0;

    void width(int n, bool planted, const std::vector<float> & y, const std::vector<float> & ref, int64_t per_col) {
        int64_t cols_diff = 0, first_col = -1, values_diff = 0;
        uint32_t max_ulp = 0;
        for (int j = 0; j < n; j++) {
            bool col_diff = false;
            for (int64_t e = 0; e < per_col; e++) {
                const uint32_t d = ulp_distance(y[(size_t) j * per_col + e], ref[(size_t) j * per_col + e]);
                if (d) {
                    values_diff++;
                    col_diff = true;
                    max_ulp = d > max_ulp ? d : max_ulp;
                }
            }
            if (col_diff) {
                cols_diff++;
                if (first_col < 0) first_col = j;
            }
        }
        if (n > 1) wide++;
        if (cols_diff) {
            bad_widths++;
            if (planted) caught++;
        }
        std::printf("{\"type\": \"%s\", \"op\": \"%s\", \"src1\": \"%s\", \"buffer\": \"%s\", \"threads\": %d, \"width\": %d, "
                    "\"planted\": %s, \"identical\": %s, \"columns_differing\": %" PRId64 ", \"first_column\": %" PRId64
                    ", \"values_differing\": %" PRId64 ", \"max_ulp\": %u}\n",
                    o.type.c_str(), o.op.c_str(), o.src1.c_str(), buffer.c_str(), o.threads, n,
                    planted ? "true" : "false",
                    cols_diff ? "false" : "true", cols_diff, first_col, values_diff, max_ulp);
        std::fflush(stdout);
    }
    bool ok() const { return o.plant ? caught == wide : bad_widths == 0; }
};

// ---------------------------------------------------------------- MUL_MAT / MUL_MAT_ID

struct Runner {
    const Options & o;
    ggml_type type;
    Device & dev;  // the wide runs (and the placement); width-1 runs may take another (--ref-threads)
    ggml_backend_buffer_type_t weight_buft = nullptr;
    std::string weight_buft_name;
    bool moe;

    Runner(const Options & opt, ggml_type t, Device & d) : o(opt), type(t), dev(d), moe(opt.op == "mul_mat_id") {}
    // activation columns per token: 1, or 2 with --src1 broadcast (rows (j, 0) and (j, 1))
    int64_t per_token() const { return o.src1 == "broadcast" ? 2 : 1; }

    // experts (MUL_MAT_ID), a stack of `groups` matrices, or one matrix
    int64_t n_mat() const { return moe ? o.n_expert : o.groups; }

    ggml_tensor * new_weight(ggml_context * ctx) const {
        return n_mat() > 1 ? ggml_new_tensor_3d(ctx, type, o.k, o.m, n_mat()) : ggml_new_tensor_2d(ctx, type, o.k, o.m);
    }

    // the activations of n tokens: [k, n], or [k, groups, n] permuted to [k, n, groups]; strided:
    // a view of every other row of [k, 2n]; broadcast: [k, 2, n] permuted to [k, n, 2]
    ggml_tensor * new_input(ggml_context * ctx, int n, ggml_tensor ** data) const {
        if (moe) return *data = ggml_new_tensor_3d(ctx, GGML_TYPE_F32, o.k, 1, n);
        if (o.src1 == "strided") {
            *data = ggml_new_tensor_2d(ctx, GGML_TYPE_F32, o.k, 2 * n);
            return ggml_view_2d(ctx, *data, o.k, n, 2 * (*data)->nb[1], 0);
        }
        if (o.src1 == "broadcast") {
            *data = ggml_new_tensor_3d(ctx, GGML_TYPE_F32, o.k, 2, n);
            return ggml_permute(ctx, *data, 0, 2, 1, 3);
        }
        if (o.groups == 1) return *data = ggml_new_tensor_2d(ctx, GGML_TYPE_F32, o.k, n);
        *data = ggml_new_tensor_3d(ctx, GGML_TYPE_F32, o.k, o.groups, n);
        return ggml_permute(ctx, *data, 0, 2, 1, 3);
    }

    void upload(Resident & w, const std::vector<uint8_t> & wbytes) const {
        w.init(4);
        w.t.push_back(new_weight(w.ctx));
        w.alloc(weight_buft);
        ggml_backend_tensor_set(w.t[0], wbytes.data(), 0, wbytes.size());
    }

    // The product of `w` with `n` activation columns (and their expert ids); dst as float.
    std::vector<float> run(Device & on, const Resident & w, const float * x, const int32_t * ids, int n) {
        ggml_init_params ap = {ggml_tensor_overhead() * 8 + ggml_graph_overhead(), nullptr, true};
        ggml_context * actx = ggml_init(ap);
        ggml_tensor * out;
        ggml_tensor * xt;
        ggml_tensor * it = nullptr;
        ggml_tensor * in = new_input(actx, n, &xt);
        if (moe) {
            it = ggml_new_tensor_2d(actx, GGML_TYPE_I32, o.n_used, n);
            out = ggml_mul_mat_id(actx, w.t[0], in, it);
        } else {
            out = ggml_mul_mat(actx, w.t[0], in);
        }
        ggml_cgraph * gf = ggml_new_graph(actx);
        ggml_build_forward_expand(gf, out);
        ggml_backend_buffer_t abuf = ggml_backend_alloc_ctx_tensors(actx, on.backend);
        if (o.src1 == "strided") {  // token j in row 2j; the odd rows hold garbage the product must not read
            std::vector<float> rows((size_t) 2 * n * o.k, 1e30f);
            for (int j = 0; j < n; j++) std::memcpy(&rows[(size_t) 2 * j * o.k], &x[(size_t) j * o.k], o.k * sizeof(float));
            ggml_backend_tensor_set(xt, rows.data(), 0, ggml_nbytes(xt));
        } else {
            ggml_backend_tensor_set(xt, x, 0, ggml_nbytes(xt));
        }
        if (it) ggml_backend_tensor_set(it, ids, 0, ggml_nbytes(it));
        if (ggml_backend_graph_compute(on.backend, gf) != GGML_STATUS_SUCCESS) usage("graph compute failed");
        std::vector<float> raw(ggml_nelements(out));
        ggml_backend_tensor_get(out, raw.data(), 0, ggml_nbytes(out));
        // token-major: y[token][group][row] (the grouped output is [m, n, groups]; broadcast [m, n, 2])
        std::vector<float> y(raw.size());
        const int64_t g_n = moe ? 1 : o.groups * per_token(), per = raw.size() / ((size_t) n * g_n);
        for (int64_t t = 0; t < n; t++)
            for (int64_t g = 0; g < g_n; g++)
                std::memcpy(&y[(t * g_n + g) * per], &raw[(g * n + t) * per], per * sizeof(float));
        ggml_backend_buffer_free(abuf);
        ggml_free(actx);
        return y;
    }

    // Whether the CPU device accepts this product with the weights in `buft` (supports_op reads
    // the type and shape only: no upload, which an extra buffer type that cannot convert this
    // type would fail on).
    bool accepts(ggml_backend_buffer_type_t buft) const {
        ggml_init_params wp = {ggml_tensor_overhead() * 8, nullptr, true};
        ggml_context * ctx = ggml_init(wp);
        ggml_tensor * w = new_weight(ctx);
        ggml_backend_buffer_t buf = ggml_backend_alloc_ctx_tensors_from_buft(ctx, buft);
        bool ok = false;
        if (buf) {
            ggml_backend_buffer_set_usage(buf, GGML_BACKEND_BUFFER_USAGE_WEIGHTS);
            ggml_tensor * x_data;
            ggml_tensor * x = new_input(ctx, 8, &x_data);
            ggml_tensor * op;
            if (moe) {
                ggml_tensor * ids = ggml_new_tensor_2d(ctx, GGML_TYPE_I32, o.n_used, 8);
                op = ggml_mul_mat_id(ctx, w, x, ids);
            } else {
                op = ggml_mul_mat(ctx, w, x);
            }
            ok = ggml_backend_dev_supports_op(ggml_backend_get_device(dev.backend), op);
            ggml_backend_buffer_free(buf);
        }
        ggml_free(ctx);
        return ok;
    }

    // The buffer type llama.cpp would give the weights: the first extra buffer type whose
    // supports_op accepts this product, else plain CPU memory.
    void choose_buft() {
        if (!dev.on_cpu()) {  // a GPU device: its own buffer type, as llama.cpp offloads weights
            weight_buft = ggml_backend_get_default_buffer_type(dev.backend);
            weight_buft_name = ggml_backend_buft_name(weight_buft);
            return;
        }
        weight_buft = ggml_backend_cpu_buffer_type();
        weight_buft_name = "CPU";
        if (o.placement == "cpu") return;
        const bool named = o.placement != "auto";  // only this extra buffer type, or fail
        for (ggml_backend_buffer_type_t b : cpu_extra_bufts()) {
            if ((!named || o.placement == ggml_backend_buft_name(b)) && accepts(b)) {
                weight_buft = b;
                weight_buft_name = ggml_backend_buft_name(b);
                return;
            }
        }
        if (named) usage("no extra buffer type named " + o.placement + " accepts this product");
    }
};

int run_mul_mat(const Options & o) {
    const ggml_type type = parse_type(o.type);
    const int64_t blk = ggml_blck_size(type);

    const bool moe = o.op == "mul_mat_id";
    const int64_t n_as = moe ? o.n_expert : o.groups;  // weight matrices
    const int64_t rows = (int64_t) o.m * n_as;
    const int64_t kx = (int64_t) o.k * (moe ? 1 : o.groups) * (o.src1 == "broadcast" ? 2 : 1);  // values per token
    int max_w = 1;
    for (int w : o.widths) max_w = w > max_w ? w : max_w;

    std::mt19937 rng(o.seed);
    std::normal_distribution<float> nd(0.0f, 1.0f);
    std::vector<float> wf(rows * o.k);
    for (float & v : wf) v = nd(rng) / std::sqrt((float) o.k);
    std::vector<float> xf((size_t) max_w * kx);
    for (float & v : xf) v = nd(rng);
    std::vector<int32_t> ids((size_t) max_w * o.n_used);
    for (int t = 0; t < max_w; t++) {
        int first = (int) (rng() % n_as);
        for (int u = 0; u < o.n_used; u++) ids[t * o.n_used + u] = (int32_t) ((first + u) % n_as);
    }
    // importance matrix: the mean square of the activations at each K index (positive), as
    // llama-imatrix collects it
    const bool use_imatrix = needs_imatrix(o, type);
    std::vector<float> imat(o.k, 0.0f);
    for (size_t c = 0; c < xf.size() / o.k; c++)
        for (int i = 0; i < o.k; i++) imat[i] += xf[c * o.k + i] * xf[c * o.k + i];
    for (float & v : imat) v = v / (float) (xf.size() / o.k) + 1e-3f;
    const std::vector<uint8_t> wq = quantize(type, wf, rows, o.k, use_imatrix ? imat.data() : nullptr, o.threads);
    const std::vector<float> wd = dequantize(type, wq, rows * o.k);  // for the reference product

    Device dev(o, o.threads);
    std::unique_ptr<Device> other_dev(o.ref_threads != o.threads ? new Device(o, o.ref_threads) : nullptr);
    Device & ref_dev = other_dev ? *other_dev : dev;
    Runner r(o, type, dev);
    r.choose_buft();

    // planted bug: the wide runs see weights and activations with K blocks rotated by one block
    const std::vector<uint8_t> wq_wide = o.plant ? rotate_blocks(type, wq, rows, o.k) : wq;
    const std::vector<float> xf_wide = o.plant ? rotate_floats(xf, max_w * (kx / o.k), o.k, blk) : xf;
    // with --src1 broadcast one matrix serves both halves of a token: rows (e / m) index the halves
    const int64_t w_groups = o.src1 == "broadcast" ? 1 : o.groups;

    const int64_t out_per_col = (int64_t) o.m * (moe ? o.n_used : o.groups) * (o.src1 == "broadcast" ? 2 : 1);
    // width-1 reference of every column
    Resident w_main, w_planted;
    r.upload(w_main, wq);
    if (o.plant) r.upload(w_planted, wq_wide);
    const Resident & w_wide = o.plant ? w_planted : w_main;
    std::vector<float> ref((size_t) max_w * out_per_col);
    for (int j = 0; j < max_w; j++) {
        std::vector<float> y = r.run(ref_dev, w_main, &xf[(size_t) j * kx], &ids[(size_t) j * o.n_used], 1);
        std::memcpy(&ref[(size_t) j * out_per_col], y.data(), out_per_col * sizeof(float));
    }

    // closeness of the width-1 results to a double-precision dequantize-then-dot product (on the
    // reference tokens: a diagnostic, not the verdict)
    double max_rel = 0.0;
    for (int j = 0; j < max_w; j++) {
        if (!reference_token(j)) continue;
        double scale = 0.0, err = 0.0;
        for (int64_t e = 0; e < out_per_col; e++) {
            const int64_t row = moe ? ids[j * o.n_used + e / o.m] * o.m + e % o.m : (e / o.m % w_groups) * o.m + e % o.m;
            const float * xj = &xf[(size_t) j * kx + (moe ? 0 : (e / o.m) * o.k)];
            const double dot = dot_double(&wd[row * o.k], xj, o.k);
            scale = std::fmax(scale, std::fabs(dot));
            err = std::fmax(err, std::fabs(dot - ref[(size_t) j * out_per_col + e]));
        }
        max_rel = std::fmax(max_rel, scale > 0 ? err / scale : err);
    }

    // --zero-tail: the same rows with T more columns (their leading blocks byte for byte the K-wide
    // weights', the tail quantized apart) and the same activations followed by T zeros
    Options o_tail = o;
    o_tail.k = o.k + o.zero_tail;
    Runner r_tail(o_tail, type, dev);
    Resident w_tail;
    std::vector<float> xf_tail;
    if (o.zero_tail) {
        std::vector<float> tf(rows * o.zero_tail);
        for (float & v : tf) v = nd(rng) / std::sqrt((float) o.k);
        const std::vector<uint8_t> tq = quantize(type, tf, rows, o.zero_tail, nullptr, o.threads);
        const size_t rs = ggml_row_size(type, o.k), ts = ggml_row_size(type, o.zero_tail);
        std::vector<uint8_t> wq_tail(rows * (rs + ts));
        for (int64_t row = 0; row < rows; row++) {
            std::memcpy(&wq_tail[row * (rs + ts)], &wq[row * rs], rs);
            std::memcpy(&wq_tail[row * (rs + ts) + rs], &tq[row * ts], ts);
        }
        xf_tail.assign((size_t) max_w * o_tail.k, 0.0f);
        for (int j = 0; j < max_w; j++) std::memcpy(&xf_tail[(size_t) j * o_tail.k], &xf[(size_t) j * o.k], o.k * sizeof(float));
        r_tail.choose_buft();
        r_tail.upload(w_tail, wq_tail);
    }

    Tally tally{o, r.weight_buft_name};
    for (int n : o.widths) {
        const bool planted = o.plant && n > 1;
        std::vector<float> y = o.zero_tail ? r_tail.run(dev, w_tail, xf_tail.data(), ids.data(), n)
                                           : r.run(dev, planted ? w_wide : w_main, planted ? xf_wide.data() : xf.data(), ids.data(), n);
        tally.width(n, planted, y, ref, out_per_col);
    }
    const bool ok = tally.ok();
    std::printf("{\"summary\": true, \"type\": \"%s\", \"op\": \"%s\", \"src1\": \"%s\", \"backend\": \"%s\", "
                "\"buffer\": \"%s\", \"k\": %d, \"m\": %d, "
                "\"widths\": %zu, \"widths_differing\": %d, \"planted\": %s, \"reference_max_rel_err\": %.3e, \"ok\": %s, "
                "\"reference_tokens\": %d, \"threads\": %d, \"ref_threads\": %d, \"placement\": \"%s\", \"groups\": %d, \"experts\": %d, \"used\": %d, \"imatrix\": %s, "
                "\"zero_tail\": %d, \"extra_buffers\": %s}\n",
                o.type.c_str(), o.op.c_str(), o.src1.c_str(), o.backend.c_str(), r.weight_buft_name.c_str(), o.k, o.m,
                o.widths.size(), tally.bad_widths,
                o.plant ? "true" : "false", max_rel, ok ? "true" : "false", reference_tokens(max_w),
                o.threads, o.ref_threads, o.placement.c_str(), o.groups, moe ? o.n_expert : 0, moe ? o.n_used : 0,
                use_imatrix ? "true" : "false", o.zero_tail, json_list(cpu_extra_names()).c_str());
    return ok ? 0 : 1;
}

// ---------------------------------------------------------------- FLASH_ATTN_EXT

// The KV cache (K, V, and the sinks) on the device, in cell order `perm` (identity, or the plant's).
struct Cache {
    Resident res;
    ggml_tensor * k = nullptr;
    ggml_tensor * v = nullptr;
    ggml_tensor * sinks = nullptr;
};

struct Attention {
    const Options & o;
    ggml_type type;
    Device & dev;
    int64_t n_kv, dk, dv, max_w;
    float scale;

    Attention(const Options & opt, ggml_type t, Device & d, int mw, int64_t extra = 0)
        : o(opt), type(t), dev(d), n_kv((int64_t) opt.kv + opt.pad + extra), dk(opt.head_dim), dv(opt.head_dim_v), max_w(mw),
          scale(1.0f / std::sqrt((float) opt.head_dim)) {}

    // cell c is visible to query token j (at cell kv - max_w + j): causal, within the window, not
    // padding; c < 0 is a hole (--holes), masked for every row
    bool visible(int64_t j, int64_t c) const {
        const int64_t pos = o.kv - max_w + j;
        return c >= 0 && c < o.kv && c <= pos && (o.window == 0 || pos - c < o.window);
    }

    // K and V as cells x kv heads x head dim (the cache's own layout), cells in `perm` order
    void upload(Cache & cache, const std::vector<uint8_t> & kq, const std::vector<uint8_t> & vq,
                const std::vector<float> & sinks, const std::vector<int64_t> & perm) const {
        cache.res.init(4);
        cache.k = ggml_new_tensor_3d(cache.res.ctx, type, dk, o.kv_heads, n_kv);
        cache.v = ggml_new_tensor_3d(cache.res.ctx, type, dv, o.kv_heads, n_kv);
        cache.sinks = ggml_new_tensor_1d(cache.res.ctx, GGML_TYPE_F32, o.heads);
        cache.res.alloc(ggml_backend_get_default_buffer_type(dev.backend));
        const size_t kcell = ggml_row_size(type, dk) * o.kv_heads, vcell = ggml_row_size(type, dv) * o.kv_heads;
        std::vector<uint8_t> kp(kq.size()), vp(vq.size());
        kp.resize(n_kv * kcell);
        vp.resize(n_kv * vcell);
        for (int64_t p = 0; p < n_kv; p++) {
            const int64_t src = perm[p] >= 0 ? perm[p] : p % o.kv;  // a hole holds some cell's data, masked
            std::memcpy(&kp[p * kcell], &kq[src * kcell], kcell);
            std::memcpy(&vp[p * vcell], &vq[src * vcell], vcell);
        }
        ggml_backend_tensor_set(cache.k, kp.data(), 0, kp.size());
        ggml_backend_tensor_set(cache.v, vp.data(), 0, vp.size());
        ggml_backend_tensor_set(cache.sinks, sinks.data(), 0, sinks.size() * sizeof(float));
    }

    // The cells a width-1 reference of token j sees with --ref-view P: llama.cpp hands attention
    // the cache up to the last cell in use, padded, so a token decoded alone sees fewer cells than
    // inside a wider batch (the rest are masked there)
    int64_t ref_cells(int64_t j) const {
        if (o.ref_view == 0) return n_kv;
        const int64_t used = o.kv - max_w + j + 1;
        return std::min(n_kv, (used + o.ref_view - 1) / o.ref_view * o.ref_view);
    }

    // Attention of query tokens first..first+n-1 over the first `cells` cells of the cache (0:
    // all); out[token][head][dv].
    std::vector<float> run(Device & on, const Cache & cache, const std::vector<float> & q, int64_t first, int n,
                           const std::vector<int64_t> & perm, int64_t cells = 0) {
        const int64_t nc = cells ? cells : n_kv;
        ggml_init_params ap = {ggml_tensor_overhead() * 16 + ggml_graph_overhead(), nullptr, true};
        ggml_context * actx = ggml_init(ap);
        // q as llama.cpp hands it over: [dk, heads, n] permuted to [dk, n, heads]; K and V the
        // cache (its first nc cells) permuted to [d, cells, kv heads]
        ggml_tensor * qt = ggml_new_tensor_3d(actx, GGML_TYPE_F32, dk, o.heads, n);
        ggml_tensor * mask = ggml_new_tensor_2d(actx, GGML_TYPE_F16, nc, n);
        ggml_tensor * kview = ggml_view_3d(actx, cache.k, dk, o.kv_heads, nc, cache.k->nb[1], cache.k->nb[2], 0);
        ggml_tensor * vview = ggml_view_3d(actx, cache.v, dv, o.kv_heads, nc, cache.v->nb[1], cache.v->nb[2], 0);
        ggml_tensor * out = ggml_flash_attn_ext(actx, ggml_permute(actx, qt, 0, 2, 1, 3),
                                                ggml_permute(actx, kview, 0, 2, 1, 3),
                                                ggml_permute(actx, vview, 0, 2, 1, 3), mask, scale, 0.0f, o.softcap);
        if (o.sinks) ggml_flash_attn_ext_add_sinks(out, cache.sinks);
        ggml_cgraph * gf = ggml_new_graph(actx);
        ggml_build_forward_expand(gf, out);
        if (!ggml_backend_supports_op(on.backend, out)) usage("the " + o.backend + " backend does not support this flash attention");
        ggml_backend_buffer_t abuf = ggml_backend_alloc_ctx_tensors(actx, on.backend);
        ggml_backend_tensor_set(qt, &q[(size_t) first * o.heads * dk], 0, ggml_nbytes(qt));
        const ggml_fp16_t zero = ggml_fp32_to_fp16(0.0f), ninf = ggml_fp32_to_fp16(-INFINITY);
        std::vector<ggml_fp16_t> m((size_t) n * nc);
        for (int j = 0; j < n; j++)
            for (int64_t p = 0; p < nc; p++) m[(size_t) j * nc + p] = visible(first + j, perm[p]) ? zero : ninf;
        ggml_backend_tensor_set(mask, m.data(), 0, ggml_nbytes(mask));
        if (ggml_backend_graph_compute(on.backend, gf) != GGML_STATUS_SUCCESS) usage("graph compute failed");
        std::vector<float> y(ggml_nelements(out));  // [dv, heads, n]: token-major already
        ggml_backend_tensor_get(out, y.data(), 0, ggml_nbytes(out));
        ggml_backend_buffer_free(abuf);
        ggml_free(actx);
        return y;
    }
};

int run_flash_attn(const Options & o) {
    const ggml_type type = parse_type(o.type);
    int max_w = 1;
    for (int w : o.widths) max_w = w > max_w ? w : max_w;

    Device dev(o, o.threads);
    std::unique_ptr<Device> other_dev(o.ref_threads != o.threads ? new Device(o, o.ref_threads) : nullptr);
    Device & ref_dev = other_dev ? *other_dev : dev;
    Attention a(o, type, dev, max_w);
    const int64_t n_kv = a.n_kv, dk = a.dk, dv = a.dv, hkv = o.kv_heads, h = o.heads;

    std::mt19937 rng(o.seed);
    std::normal_distribution<float> nd(0.0f, 1.0f);
    std::vector<float> kf(n_kv * hkv * dk), vf(n_kv * hkv * dv), qf((size_t) max_w * h * dk), sinks(h);
    for (float & x : kf) x = nd(rng);
    for (float & x : vf) x = nd(rng);
    for (float & x : qf) x = nd(rng);
    for (float & x : sinks) x = nd(rng);
    const std::vector<uint8_t> kq = quantize(type, kf, n_kv * hkv, dk, nullptr, o.threads);
    const std::vector<uint8_t> vq = quantize(type, vf, n_kv * hkv, dv, nullptr, o.threads);
    const std::vector<float> kd = dequantize(type, kq, kf.size()), vd = dequantize(type, vq, vf.size());

    std::vector<int64_t> ident(n_kv), perm(n_kv);
    std::iota(ident.begin(), ident.end(), 0);
    perm = ident;
    if (o.plant) std::shuffle(perm.begin(), perm.end(), rng);
    Cache main_cache, planted_cache, holey_cache;
    a.upload(main_cache, kq, vq, sinks, ident);
    if (o.plant) a.upload(planted_cache, kq, vq, sinks, perm);
    // --holes: the batches' cache has masked cells in the middle (as DeepSeek-V4's raw cells
    // grow in front of its compressed rows with the batch): [0, at), holes, [at, kv + pad), at =
    // --holes-at (default kv/2; DeepSeek-V4's raw view holds whole multiples of 256 cells)
    Attention holey(o, type, dev, max_w, o.holes);
    std::vector<int64_t> hperm;
    if (o.holes) {
        const int64_t at = o.holes_at >= 0 ? o.holes_at : o.kv / 2;
        for (int64_t p = 0; p < at; p++) hperm.push_back(p);
        for (int64_t p = 0; p < o.holes; p++) hperm.push_back(-1);
        for (int64_t p = at; p < n_kv; p++) hperm.push_back(p);
        holey.upload(holey_cache, kq, vq, sinks, hperm);
    }

    const int64_t per_col = h * dv;
    std::vector<float> ref((size_t) max_w * per_col);
    for (int j = 0; j < max_w; j++) {
        std::vector<float> y = a.run(ref_dev, main_cache, qf, j, 1, ident, a.ref_cells(j));
        std::memcpy(&ref[(size_t) j * per_col], y.data(), per_col * sizeof(float));
    }

    // closeness of the width-1 rows to a double-precision softmax over the dequantized cache
    double max_rel = 0.0;
    std::vector<double> s(n_kv), acc(dv);
    for (int j = 0; j < max_w; j++) {
        if (!reference_token(j)) continue;
        double scale_j = 0.0, err = 0.0;
        for (int64_t hh = 0; hh < h; hh++) {
            const int64_t kh = hh / (h / hkv);
            const float * qj = &qf[((size_t) j * h + hh) * dk];
            double mx = o.sinks ? (double) sinks[hh] : -INFINITY;
            for (int64_t c = 0; c < n_kv; c++) {
                if (!a.visible(j, c)) continue;
                double dot = dot_double(qj, &kd[(c * hkv + kh) * dk], dk) * a.scale;
                if (o.softcap > 0.0f) dot = o.softcap * std::tanh(dot / o.softcap);
                s[c] = dot;
                mx = std::fmax(mx, dot);
            }
            double den = o.sinks ? std::exp((double) sinks[hh] - mx) : 0.0;
            std::fill(acc.begin(), acc.end(), 0.0);
            for (int64_t c = 0; c < n_kv; c++) {
                if (!a.visible(j, c)) continue;
                const double p = std::exp(s[c] - mx);
                den += p;
                for (int64_t d = 0; d < dv; d++) acc[d] += p * vd[(c * hkv + kh) * dv + d];
            }
            for (int64_t d = 0; d < dv; d++) {
                const double want = acc[d] / den;
                scale_j = std::fmax(scale_j, std::fabs(want));
                err = std::fmax(err, std::fabs(want - ref[(size_t) j * per_col + hh * dv + d]));
            }
        }
        max_rel = std::fmax(max_rel, scale_j > 0 ? err / scale_j : err);
    }

    Tally tally{o, ggml_backend_buft_name(ggml_backend_get_default_buffer_type(dev.backend))};
    for (int n : o.widths) {
        const bool planted = o.plant && n > 1;
        std::vector<float> y = o.holes ? holey.run(dev, holey_cache, qf, 0, n, hperm)
                                       : a.run(dev, planted ? planted_cache : main_cache, qf, 0, n, planted ? perm : ident);
        tally.width(n, planted, y, ref, per_col);
    }
    const bool ok = tally.ok();
    std::printf("{\"summary\": true, \"type\": \"%s\", \"op\": \"%s\", \"src1\": \"%s\", \"backend\": \"%s\", "
                "\"buffer\": \"%s\", \"k\": %d, \"m\": %d, "
                "\"widths\": %zu, \"widths_differing\": %d, \"planted\": %s, \"reference_max_rel_err\": %.3e, \"ok\": %s, "
                "\"reference_tokens\": %d, \"threads\": %d, \"ref_threads\": %d, \"head_dim\": %d, \"head_dim_v\": %d, \"heads\": %d, \"kv_heads\": %d, \"kv\": %d, "
                "\"pad\": %d, \"window\": %d, \"sinks\": %s, \"softcap\": %g, \"ref_view\": %d, \"holes\": %d, \"extra_buffers\": %s}\n",
                o.type.c_str(), o.op.c_str(), o.src1.c_str(), o.backend.c_str(), tally.buffer.c_str(), o.head_dim, (int) n_kv,
                o.widths.size(), tally.bad_widths, o.plant ? "true" : "false", max_rel, ok ? "true" : "false",
                reference_tokens(max_w), o.threads, o.ref_threads, o.head_dim, o.head_dim_v, o.heads, o.kv_heads, o.kv, o.pad, o.window,
                o.sinks ? "true" : "false", o.softcap, o.ref_view, o.holes, json_list(cpu_extra_names()).c_str());
    return ok ? 0 : 1;
}

// ---------------------------------------------------------------- ADD + RMS_NORM + MUL

// rms_norm(x + r) * w for n rows of k values, as one graph; rows token-major
std::vector<float> run_add_rms_norm(Device & on, const Options & o, const float * x, const float * r, const float * w,
                                    int n, float eps) {
    ggml_init_params ap = {ggml_tensor_overhead() * 8 + ggml_graph_overhead(), nullptr, true};
    ggml_context * actx = ggml_init(ap);
    ggml_tensor * xt = ggml_new_tensor_2d(actx, GGML_TYPE_F32, o.k, n);
    ggml_tensor * rt = ggml_new_tensor_2d(actx, GGML_TYPE_F32, o.k, n);
    ggml_tensor * wt = ggml_new_tensor_1d(actx, GGML_TYPE_F32, o.k);
    ggml_tensor * out = ggml_mul(actx, ggml_rms_norm(actx, ggml_add(actx, xt, rt), eps), wt);
    ggml_cgraph * gf = ggml_new_graph(actx);
    ggml_build_forward_expand(gf, out);
    ggml_backend_buffer_t abuf = ggml_backend_alloc_ctx_tensors(actx, on.backend);
    ggml_backend_tensor_set(xt, x, 0, ggml_nbytes(xt));
    ggml_backend_tensor_set(rt, r, 0, ggml_nbytes(rt));
    ggml_backend_tensor_set(wt, w, 0, ggml_nbytes(wt));
    if (ggml_backend_graph_compute(on.backend, gf) != GGML_STATUS_SUCCESS) usage("graph compute failed");
    std::vector<float> y(ggml_nelements(out));
    ggml_backend_tensor_get(out, y.data(), 0, ggml_nbytes(out));
    ggml_backend_buffer_free(abuf);
    ggml_free(actx);
    return y;
}

int run_add_rms(const Options & o) {
    int max_w = 1;
    for (int w : o.widths) max_w = w > max_w ? w : max_w;
    const int64_t k = o.k;
    const float eps = 1e-6f;
    Device dev(o, o.threads);
    std::unique_ptr<Device> other_dev(o.ref_threads != o.threads ? new Device(o, o.ref_threads) : nullptr);
    Device & ref_dev = other_dev ? *other_dev : dev;

    std::mt19937 rng(o.seed);
    std::normal_distribution<float> nd(0.0f, 1.0f);
    std::vector<float> x((size_t) max_w * k), r((size_t) max_w * k), w(k);
    for (float & v : x) v = nd(rng);
    for (float & v : r) v = nd(rng);
    for (float & v : w) v = 1.0f + 0.1f * nd(rng);

    std::vector<float> ref((size_t) max_w * k);
    for (int j = 0; j < max_w; j++) {
        std::vector<float> y = run_add_rms_norm(ref_dev, o, &x[(size_t) j * k], &r[(size_t) j * k], w.data(), 1, eps);
        std::memcpy(&ref[(size_t) j * k], y.data(), k * sizeof(float));
    }
    double max_rel = 0.0;  // width 1 against the same arithmetic in double precision
    for (int j = 0; j < max_w; j++) {
        if (!reference_token(j)) continue;
        double ss = 0.0, scale_j = 0.0, err = 0.0;
        for (int64_t e = 0; e < k; e++) {
            const double v = (double) x[j * k + e] + (double) r[j * k + e];
            ss += v * v;
        }
        const double inv = 1.0 / std::sqrt(ss / (double) k + (double) eps);
        for (int64_t e = 0; e < k; e++) {
            const double want = ((double) x[j * k + e] + (double) r[j * k + e]) * inv * (double) w[e];
            scale_j = std::fmax(scale_j, std::fabs(want));
            err = std::fmax(err, std::fabs(want - ref[(size_t) j * k + e]));
        }
        max_rel = std::fmax(max_rel, scale_j > 0 ? err / scale_j : err);
    }

    Tally tally{o, ggml_backend_buft_name(ggml_backend_get_default_buffer_type(dev.backend))};
    for (int n : o.widths) {
        const bool planted = o.plant && n > 1;
        std::vector<float> y = run_add_rms_norm(dev, o, x.data(), r.data(), w.data(), n, planted ? 10 * eps : eps);
        tally.width(n, planted, y, ref, k);
    }
    const bool ok = tally.ok();
    std::printf("{\"summary\": true, \"type\": \"%s\", \"op\": \"%s\", \"src1\": \"%s\", \"backend\": \"%s\", "
                "\"buffer\": \"%s\", \"k\": %d, \"m\": %d, \"widths\": %zu, \"widths_differing\": %d, \"planted\": %s, "
                "\"reference_max_rel_err\": %.3e, \"ok\": %s, \"reference_tokens\": %d, \"threads\": %d, \"ref_threads\": %d, "
                "\"extra_buffers\": %s}\n",
                o.type.c_str(), o.op.c_str(), o.src1.c_str(), o.backend.c_str(), tally.buffer.c_str(), o.k, o.k, o.widths.size(),
                tally.bad_widths, o.plant ? "true" : "false", max_rel, ok ? "true" : "false", reference_tokens(max_w),
                o.threads, o.ref_threads, json_list(cpu_extra_names()).c_str());
    return ok ? 0 : 1;
}

// ---------------------------------------------------------------- --list-types

// Every ggml type the CPU backend runs MUL_MAT and MUL_MAT_ID for with F32 activations: a
// to_float (the weights can be read back), a CPU vec_dot (the kernel), and the device's
// supports_op accepting both products in plain memory. The rest with the reason.
int list_types() {
    ggml_backend_dev_t dev = ggml_backend_dev_by_type(GGML_BACKEND_DEVICE_TYPE_CPU);
    if (!dev) usage("no CPU device in this build");
    std::vector<std::string> types, imatrix, refused;
    ggml_init_params p = {ggml_tensor_overhead() * 8, nullptr, true};
    for (int t = 0; t < GGML_TYPE_COUNT; t++) {
        const ggml_type type = (ggml_type) t;
        if (ggml_blck_size(type) <= 0) continue;  // removed from ggml: no traits at all
        const std::string name = ggml_type_name(type);
        const char * why = nullptr;
        if (type != GGML_TYPE_F32 && !ggml_get_type_traits(type)->to_float) why = "no to_float";
        else if (!ggml_get_type_traits_cpu(type)->vec_dot) why = "no CPU vec_dot";
        else if (type != GGML_TYPE_F32 && type != GGML_TYPE_F16 && type != GGML_TYPE_BF16 && !ggml_is_quantized(type))
            why = "not a weight type";
        if (!why) {
            const int64_t k = 256 % ggml_blck_size(type) ? ggml_blck_size(type) : 256;
            ggml_context * ctx = ggml_init(p);
            ggml_tensor * w = ggml_new_tensor_2d(ctx, type, k, 64);
            ggml_tensor * x = ggml_new_tensor_2d(ctx, GGML_TYPE_F32, k, 8);
            ggml_tensor * we = ggml_new_tensor_3d(ctx, type, k, 64, 4);
            ggml_tensor * xe = ggml_new_tensor_3d(ctx, GGML_TYPE_F32, k, 1, 8);
            ggml_tensor * ids = ggml_new_tensor_2d(ctx, GGML_TYPE_I32, 2, 8);
            if (!ggml_backend_dev_supports_op(dev, ggml_mul_mat(ctx, w, x))) why = "supports_op refuses MUL_MAT";
            else if (!ggml_backend_dev_supports_op(dev, ggml_mul_mat_id(ctx, we, xe, ids))) why = "supports_op refuses MUL_MAT_ID";
            ggml_free(ctx);
        }
        if (why) {
            refused.push_back(name + "\": \"" + why);
        } else {
            types.push_back(name);
            if (ggml_quantize_requires_imatrix(type)) imatrix.push_back(name);
        }
    }
    std::string ref = "{";
    for (size_t i = 0; i < refused.size(); i++) ref += (i ? ", \"" : "\"") + refused[i] + "\"";
    ref += "}";
    // the instruction sets this libggml-cpu was compiled for (which CPU variant is loaded)
    const std::pair<const char *, int> features[] = {
        {"avx2", ggml_cpu_has_avx2()}, {"fma", ggml_cpu_has_fma()}, {"f16c", ggml_cpu_has_f16c()},
        {"avx_vnni", ggml_cpu_has_avx_vnni()}, {"avx512", ggml_cpu_has_avx512()},
        {"avx512_vbmi", ggml_cpu_has_avx512_vbmi()}, {"avx512_vnni", ggml_cpu_has_avx512_vnni()},
        {"avx512_bf16", ggml_cpu_has_avx512_bf16()}, {"amx_int8", ggml_cpu_has_amx_int8()}};
    std::string feat = "{";
    for (const auto & f : features) feat += std::string(feat.size() > 1 ? ", \"" : "\"") + f.first + "\": " + (f.second ? "true" : "false");
    feat += "}";
    std::printf("{\"list_types\": true, \"types\": %s, \"requires_imatrix\": %s, \"refused\": %s, "
                "\"extra_buffers\": %s, \"cpu_has_amx_int8\": %s, \"cpu_features\": %s}\n",
                json_list(types).c_str(), json_list(imatrix).c_str(), ref.c_str(), json_list(cpu_extra_names()).c_str(),
                ggml_cpu_has_amx_int8() ? "true" : "false", feat.c_str());
    return 0;
}

}  // namespace

// Checks separated by --then run one after another in this process (each with its own options,
// from the defaults): the IQ quantizers' tables (ggml_quantize_init, seconds each) are built once.
int main(int argc, char ** argv) {
    std::vector<std::vector<std::string>> segments(1);
    for (int i = 1; i < argc; i++) {
        if (std::string(argv[i]) == "--then") segments.emplace_back();
        else segments.back().push_back(argv[i]);
    }
    std::vector<Options> checks;
    for (const auto & seg : segments) checks.push_back(parse(seg));
    ggml_cpu_init();
    for (const Options & o : checks) {
        if (o.list_types && checks.size() > 1) usage("--list-types runs alone (no --then)");
        validate(o);
    }
    if (checks[0].list_types) return list_types();
    int rc = 0;
    for (const Options & o : checks) {
        const int r = o.op == "flash_attn_ext" ? run_flash_attn(o) : o.op == "add_rms_norm" ? run_add_rms(o) : run_mul_mat(o);
        if (r != 0) rc = 1;
    }
    return rc;
}
