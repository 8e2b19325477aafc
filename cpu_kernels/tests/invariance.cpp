// Op-level batch-invariance check for ggml's CPU matrix products.
//
// For one weight type and one op (MUL_MAT or MUL_MAT_ID) it computes every column of a random
// activation matrix twice: alone (a width-1 product, the q1 reference) and inside products of
// widths 1..512. Every column of every width must be bit for bit its width-1 result. Each result
// is also compared with a dequantize-then-dot reference in double precision: that is how close
// the kernel is to the real product (a diagnostic with a per-type bound, never the verdict on
// invariance).
//
// Weights are placed the way llama.cpp places them: in the first extra buffer type of the CPU
// device (AMX, repack, ...) whose supports_op accepts the product, else in plain CPU memory
// (--placement auto); --placement cpu forces plain memory, --placement NAME that extra buffer type.
//
// --plant SHIFT is the planted-bug twin: the wide products see their weights' K blocks rotated by
// one block relative to the width-1 run's (the same weights, summed in another order, as a
// kernel that walked K from another start would). The check must then report differences.
//
// --backend NAME runs the products on another ggml device (e.g. CUDA0, ROCm0: the GPU check in
// scripts/gpu-check); weights then live in that device's buffer type and --placement is ignored.
// --src1 strided gives the activations rows with a stride of two rows (a view, as DeepSeek-V4's
// grouped output hands them over); --src1 broadcast gives them a third dimension of 2 over one
// weight matrix (ggml broadcasts src0 over src1's ne2): column j is then the pair of rows (j, b).
//
// Output: one JSON object per line per width, then a summary line; exit 0 when every width is
// invariant (or, with --plant, when every width >= 2 was caught), 1 otherwise, 2 on bad usage.
#include "ggml.h"
#include "ggml-alloc.h"
#include "ggml-backend.h"
#include "ggml-cpu.h"

#include <cinttypes>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

namespace {

struct Options {
    std::string type = "q4_0";
    std::string op = "mul_mat";
    std::string placement = "auto";
    std::string backend = "cpu";
    std::string src1 = "contiguous";  // contiguous, strided or broadcast
    int k = 1024;
    int m = 256;
    int threads = 2;
    int n_expert = 4;
    int n_used = 2;
    int groups = 1;  // > 1: a stack of `groups` weight matrices and permuted activations (DeepSeek-V4's grouped output)
    bool plant = false;
    std::vector<int> widths = {1, 2, 3, 4, 5, 7, 8, 9, 15, 16, 17, 63, 64, 65, 127, 128, 129, 257, 512};
    unsigned seed = 42;
};

[[noreturn]] void usage(const char * msg) {
    std::fprintf(stderr, "invariance: %s\n", msg);
    std::exit(2);
}

ggml_type parse_type(const std::string & name) {
    for (int t = 0; t < GGML_TYPE_COUNT; t++) {
        const char * n = ggml_type_name((ggml_type) t);
        if (n && name == n) {
            return (ggml_type) t;
        }
    }
    usage(("unknown type " + name).c_str());
}

std::vector<int> parse_widths(const char * s) {
    std::vector<int> out;
    for (const char * p = s; *p;) {
        char * end = nullptr;
        long v = std::strtol(p, &end, 10);
        if (end == p || v < 1 || v > 4096) {
            usage("--widths wants a comma-separated list of integers in 1..4096");
        }
        out.push_back((int) v);
        p = *end == ',' ? end + 1 : end;
    }
    return out;
}

Options parse(int argc, char ** argv) {
    Options o;
    for (int i = 1; i < argc; i++) {
        std::string a = argv[i];
        auto val = [&]() -> const char * {
            if (i + 1 >= argc) usage((a + " needs a value").c_str());
            return argv[++i];
        };
        if (a == "--type") o.type = val();
        else if (a == "--op") o.op = val();
        else if (a == "--placement") o.placement = val();
        else if (a == "--k") o.k = std::atoi(val());
        else if (a == "--m") o.m = std::atoi(val());
        else if (a == "--threads") o.threads = std::atoi(val());
        else if (a == "--widths") o.widths = parse_widths(val());
        else if (a == "--seed") o.seed = (unsigned) std::atoi(val());
        else if (a == "--plant") o.plant = true;
        else if (a == "--groups") o.groups = std::atoi(val());
        else if (a == "--backend") o.backend = val();
        else if (a == "--src1") o.src1 = val();
        else usage(("unknown option " + a).c_str());
    }
    if (o.op != "mul_mat" && o.op != "mul_mat_id") usage("--op is mul_mat or mul_mat_id");
    if (o.placement.empty()) usage("--placement is auto, cpu or the name of an extra buffer type (AMX, CPU_REPACK)");
    if (o.k < 1 || o.m < 1 || o.threads < 1 || o.groups < 1) usage("--k, --m, --threads and --groups must be >= 1");
    if (o.groups > 1 && o.op != "mul_mat") usage("--groups needs --op mul_mat");
    if (o.src1 != "contiguous" && o.src1 != "strided" && o.src1 != "broadcast")
        usage("--src1 is contiguous, strided or broadcast");
    if (o.src1 != "contiguous" && (o.op != "mul_mat" || o.groups > 1))
        usage("--src1 strided|broadcast needs --op mul_mat without --groups");
    return o;
}

// Weight bytes of `type` for rows of k values, from float data.
std::vector<uint8_t> quantize(ggml_type type, const std::vector<float> & f, int64_t rows, int64_t k) {
    std::vector<uint8_t> out(ggml_row_size(type, k) * rows);
    if (type == GGML_TYPE_F32) {
        std::memcpy(out.data(), f.data(), out.size());
    } else {
        ggml_quantize_chunk(type, f.data(), out.data(), 0, rows, k, nullptr);
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

struct Runner {
    const Options & o;
    ggml_type type;
    ggml_backend_t backend = nullptr;
    ggml_backend_buffer_type_t weight_buft = nullptr;
    std::string weight_buft_name;
    bool moe;

    Runner(const Options & opt, ggml_type t) : o(opt), type(t), moe(opt.op == "mul_mat_id") {
        if (o.backend == "cpu") {
            backend = ggml_backend_cpu_init();
            if (!backend) usage("cannot initialise the CPU backend");
            ggml_backend_cpu_set_n_threads(backend, o.threads);
            return;
        }
        ggml_backend_load_all();
        ggml_backend_dev_t dev = ggml_backend_dev_by_name(o.backend.c_str());
        if (!dev) usage(("no ggml device named " + o.backend + " in this build").c_str());
        backend = ggml_backend_dev_init(dev, nullptr);
        if (!backend) usage(("cannot initialise the " + o.backend + " backend").c_str());
    }
    bool on_cpu() const { return o.backend == "cpu"; }
    // activation columns per token: 1, or 2 with --src1 broadcast (rows (j, 0) and (j, 1))
    int64_t per_token() const { return o.src1 == "broadcast" ? 2 : 1; }
    ~Runner() { ggml_backend_free(backend); }

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

    struct Weights {
        ggml_context * ctx = nullptr;
        ggml_backend_buffer_t buf = nullptr;
        ggml_tensor * w = nullptr;
    };

    // Weights of `wbytes` in `buft` (set once: extra buffer types convert them on upload).
    Weights upload(const std::vector<uint8_t> & wbytes, ggml_backend_buffer_type_t buft) {
        Weights out;
        ggml_init_params wp = {ggml_tensor_overhead() * 4, nullptr, true};
        out.ctx = ggml_init(wp);
        out.w = new_weight(out.ctx);
        out.buf = ggml_backend_alloc_ctx_tensors_from_buft(out.ctx, buft);
        if (!out.buf) usage("cannot allocate the weights");
        ggml_backend_buffer_set_usage(out.buf, GGML_BACKEND_BUFFER_USAGE_WEIGHTS);
        ggml_backend_tensor_set(out.w, wbytes.data(), 0, wbytes.size());
        return out;
    }

    static void release(Weights & w) {
        ggml_backend_buffer_free(w.buf);
        ggml_free(w.ctx);
    }

    // The product of `w` with `n` activation columns (and their expert ids); dst as float.
    std::vector<float> run(const Weights & w, const float * x, const int32_t * ids, int n) {
        ggml_init_params ap = {ggml_tensor_overhead() * 8 + ggml_graph_overhead(), nullptr, true};
        ggml_context * actx = ggml_init(ap);
        ggml_tensor * out;
        ggml_tensor * xt;
        ggml_tensor * it = nullptr;
        ggml_tensor * in = new_input(actx, n, &xt);
        if (moe) {
            it = ggml_new_tensor_2d(actx, GGML_TYPE_I32, o.n_used, n);
            out = ggml_mul_mat_id(actx, w.w, in, it);
        } else {
            out = ggml_mul_mat(actx, w.w, in);
        }
        ggml_cgraph * gf = ggml_new_graph(actx);
        ggml_build_forward_expand(gf, out);
        ggml_backend_buffer_t abuf = ggml_backend_alloc_ctx_tensors(actx, backend);
        if (o.src1 == "strided") {  // token j in row 2j; the odd rows hold garbage the product must not read
            std::vector<float> rows((size_t) 2 * n * o.k, 1e30f);
            for (int j = 0; j < n; j++) std::memcpy(&rows[(size_t) 2 * j * o.k], &x[(size_t) j * o.k], o.k * sizeof(float));
            ggml_backend_tensor_set(xt, rows.data(), 0, ggml_nbytes(xt));
        } else {
            ggml_backend_tensor_set(xt, x, 0, ggml_nbytes(xt));
        }
        if (it) ggml_backend_tensor_set(it, ids, 0, ggml_nbytes(it));
        if (ggml_backend_graph_compute(backend, gf) != GGML_STATUS_SUCCESS) usage("graph compute failed");
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

    // The buffer type llama.cpp would give the weights: the first extra buffer type whose
    // supports_op accepts this product, else plain CPU memory.
    void choose_buft() {
        if (!on_cpu()) {  // a GPU device: its own buffer type, as llama.cpp offloads weights
            weight_buft = ggml_backend_get_default_buffer_type(backend);
            weight_buft_name = ggml_backend_buft_name(weight_buft);
            return;
        }
        weight_buft = ggml_backend_cpu_buffer_type();
        weight_buft_name = "CPU";
        if (o.placement == "cpu") return;
        const bool named = o.placement != "auto";  // only this extra buffer type, or fail
        ggml_backend_dev_t dev = ggml_backend_get_device(backend);
        ggml_backend_reg_t reg = ggml_backend_dev_backend_reg(dev);
        auto get_extra = (ggml_backend_dev_get_extra_bufts_t) ggml_backend_reg_get_proc_address(reg, "ggml_backend_dev_get_extra_bufts");
        if (!get_extra) return;
        for (ggml_backend_buffer_type_t * b = get_extra(dev); b && *b; b++) {
            ggml_init_params wp = {ggml_tensor_overhead() * 8, nullptr, true};
            ggml_context * ctx = ggml_init(wp);
            ggml_tensor * w = new_weight(ctx);
            ggml_backend_buffer_t buf = ggml_backend_alloc_ctx_tensors_from_buft(ctx, *b);
            bool ok = false;
            if (buf) {
                // supports_op reads the type and shape only: no upload (an extra buffer type
                // that cannot convert this type would fail on it)
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
                ok = ggml_backend_dev_supports_op(dev, op);
                ggml_backend_buffer_free(buf);
            }
            ggml_free(ctx);
            if (ok && (!named || o.placement == ggml_backend_buft_name(*b))) {
                weight_buft = *b;
                weight_buft_name = ggml_backend_buft_name(*b);
                return;
            }
        }
        if (named) usage(("no extra buffer type named " + o.placement + " accepts this product").c_str());
    }
};

}  // namespace

int main(int argc, char ** argv) {
    const Options o = parse(argc, argv);
    const ggml_type type = parse_type(o.type);
    const int64_t blk = ggml_blck_size(type);
    if (o.k % blk) usage("--k must be a multiple of the type's block size");
    ggml_cpu_init();
    if (o.backend != "cpu" && o.placement != "auto") usage("--placement applies to the CPU backend only");

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
    const std::vector<uint8_t> wq = quantize(type, wf, rows, o.k);

    // dequantized weights for the reference product
    std::vector<float> wd(rows * o.k);
    if (type == GGML_TYPE_F32) {
        wd = wf;
    } else {
        ggml_get_type_traits(type)->to_float(wq.data(), wd.data(), rows * o.k);
    }

    Runner r(o, type);
    r.choose_buft();

    // planted bug: the wide runs see weights and activations with K blocks rotated by one block
    const std::vector<uint8_t> wq_wide = o.plant ? rotate_blocks(type, wq, rows, o.k) : wq;
    const std::vector<float> xf_wide = o.plant ? rotate_floats(xf, max_w * (kx / o.k), o.k, blk) : xf;
    // with --src1 broadcast one matrix serves both halves of a token: rows (e / m) index the halves
    const int64_t w_groups = o.src1 == "broadcast" ? 1 : o.groups;

    const int64_t out_per_col = (int64_t) o.m * (moe ? o.n_used : o.groups) * (o.src1 == "broadcast" ? 2 : 1);
    // width-1 reference of every column
    Runner::Weights w_main = r.upload(wq, r.weight_buft);
    Runner::Weights w_wide = o.plant ? r.upload(wq_wide, r.weight_buft) : w_main;
    std::vector<float> ref((size_t) max_w * out_per_col);
    for (int j = 0; j < max_w; j++) {
        std::vector<float> y = r.run(w_main, &xf[(size_t) j * kx], &ids[(size_t) j * o.n_used], 1);
        std::memcpy(&ref[(size_t) j * out_per_col], y.data(), out_per_col * sizeof(float));
    }

    // closeness of the width-1 results to a double-precision dequantize-then-dot product
    double max_rel = 0.0;
    for (int j = 0; j < max_w; j++) {
        double scale = 0.0, err = 0.0;
        for (int64_t e = 0; e < out_per_col; e++) {
            const int64_t row = moe ? ids[j * o.n_used + e / o.m] * o.m + e % o.m : (e / o.m % w_groups) * o.m + e % o.m;
            const float * xj = &xf[(size_t) j * kx + (moe ? 0 : (e / o.m) * o.k)];
            double dot = 0.0;
            for (int64_t i = 0; i < o.k; i++) dot += (double) wd[row * o.k + i] * xj[i];
            scale = std::fmax(scale, std::fabs(dot));
            err = std::fmax(err, std::fabs(dot - ref[(size_t) j * out_per_col + e]));
        }
        max_rel = std::fmax(max_rel, scale > 0 ? err / scale : err);
    }

    int bad_widths = 0, caught = 0, wide = 0;
    for (int n : o.widths) {
        const bool planted = o.plant && n > 1;
        std::vector<float> y = r.run(planted ? w_wide : w_main, planted ? xf_wide.data() : xf.data(), ids.data(), n);
        int64_t cols_diff = 0, first_col = -1, values_diff = 0;
        uint32_t max_ulp = 0;
        for (int j = 0; j < n; j++) {
            bool col_diff = false;
            for (int64_t e = 0; e < out_per_col; e++) {
                float a = y[(size_t) j * out_per_col + e], b = ref[(size_t) j * out_per_col + e];
                uint32_t ua, ub;
                std::memcpy(&ua, &a, 4);
                std::memcpy(&ub, &b, 4);
                if (ua != ub) {
                    values_diff++;
                    col_diff = true;
                    uint32_t d = ua > ub ? ua - ub : ub - ua;
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
                    o.type.c_str(), o.op.c_str(), o.src1.c_str(), r.weight_buft_name.c_str(), o.threads, n,
                    planted ? "true" : "false",
                    cols_diff ? "false" : "true", cols_diff, first_col, values_diff, max_ulp);
    }
    Runner::release(w_main);
    if (o.plant) Runner::release(w_wide);
    const bool ok = o.plant ? caught == wide : bad_widths == 0;
    std::printf("{\"summary\": true, \"type\": \"%s\", \"op\": \"%s\", \"src1\": \"%s\", \"backend\": \"%s\", "
                "\"buffer\": \"%s\", \"k\": %d, \"m\": %d, "
                "\"widths\": %zu, \"widths_differing\": %d, \"planted\": %s, \"reference_max_rel_err\": %.3e, \"ok\": %s}\n",
                o.type.c_str(), o.op.c_str(), o.src1.c_str(), o.backend.c_str(), r.weight_buft_name.c_str(), o.k, o.m,
                o.widths.size(), bad_widths,
                o.plant ? "true" : "false", max_rel, ok ? "true" : "false");
    return ok ? 0 : 1;
}
