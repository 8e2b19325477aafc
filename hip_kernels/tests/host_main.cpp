// dflash_mmvq_host: the narrow-MMVQ kernel body run on the CPU, lane by lane, in the GPU's order.
//
//   dflash_mmvq_host --selfcheck
//       random weights of every type, ncols 1..4: (a) within float tolerance of a
//       dequantize-then-dot reference, (b) column c of ncols = k bit-identical to ncols = 1.
//   dflash_mmvq_host --selfcheck --expect-planted      (binary built with the planted bug)
//       succeeds only if (a) fails for the nibble formats while (b) still holds.
//   dflash_mmvq_host --type q4_0 --ncols 3 --rows R --cols K --w W.bin (--x X.f32 | --xq XQ.bin)
//                    --y Y.f32 [--xq-out XQ.bin]
//       W: R rows of GGUF blocks; X: ncols x K float32 (column after column); XQ: ncols x K/32
//       ggml block_q8_1 (36 bytes each); Y: ncols x R float32, exactly what the GPU kernel
//       dflash_mmvq_<type>_nc<ncols> writes for the same W and XQ.
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <iterator>
#include <map>

#include "host_check.h"

using namespace dftest;

namespace {

bool read_file(const std::string& path, std::vector<uint8_t>& out) {
    std::ifstream f(path, std::ios::binary);
    if (!f) {
        return false;
    }
    out.assign(std::istreambuf_iterator<char>(f), std::istreambuf_iterator<char>());
    return true;
}

bool write_file(const std::string& path, const void* data, size_t n) {
    std::ofstream f(path, std::ios::binary);
    f.write((const char*)data, (std::streamsize)n);
    return (bool)f;
}

int usage(const char* msg) {
    std::fprintf(stderr, "dflash_mmvq_host: %s\nsee the header of hip_kernels/tests/host_main.cpp for usage\n", msg);
    return 2;
}

int run_files(std::map<std::string, std::string>& a) {
    const type_info* t = find_type(a["type"]);
    if (!t) {
        return usage(("unknown --type '" + a["type"] + "' (q8_0, q4_0, q4_k, mxfp4, q5_0, q5_k, q6_k)").c_str());
    }
    for (const char* key : {"ncols", "rows", "cols", "w", "y"}) {
        if (!a.count(key)) {
            return usage((std::string("missing --") + key).c_str());
        }
    }
    const int ncols = std::atoi(a["ncols"].c_str()), nrows = std::atoi(a["rows"].c_str());
    const int k = std::atoi(a["cols"].c_str());
    if (ncols < 1 || ncols > 4 || nrows < 1 || k < t->qk || k % t->qk != 0) {
        return usage("need 1 <= ncols <= 4, rows >= 1, cols a positive multiple of the block size");
    }
    const int nblocks = k / t->qk, xb = k / 32;
    std::vector<uint8_t> w, xraw;
    if (!read_file(a["w"], w) || w.size() != (size_t)nrows * nblocks * t->bytes) {
        return usage("--w must hold rows * cols / qk blocks");
    }
    std::vector<q8_1_block> xq((size_t)ncols * xb);
    if (a.count("xq")) {
        if (!read_file(a["xq"], xraw) || xraw.size() != xq.size() * sizeof(q8_1_block)) {
            return usage("--xq must hold ncols * cols / 32 q8_1 blocks");
        }
        std::memcpy(xq.data(), xraw.data(), xraw.size());
    } else if (a.count("x")) {
        if (!read_file(a["x"], xraw) || xraw.size() != (size_t)ncols * k * sizeof(float)) {
            return usage("--x must hold ncols * cols float32");
        }
        std::vector<float> x((size_t)ncols * k);
        std::memcpy(x.data(), xraw.data(), xraw.size());
        for (int c = 0; c < ncols; ++c) {
            quantize_q8_1(&x[(size_t)c * k], k, &xq[(size_t)c * xb]);
        }
    } else {
        return usage("need --x or --xq");
    }
    std::vector<float> y((size_t)ncols * nrows);
    dfmmvq::emulate_dense_any(t->type, ncols, w.data(), xq.data(), y.data(), nblocks, nrows,
                              (int64_t)nblocks * t->bytes, xb, nrows);
    if (a.count("xq-out") && !write_file(a["xq-out"], xq.data(), xq.size() * sizeof(q8_1_block))) {
        return usage("cannot write --xq-out");
    }
    if (!write_file(a["y"], y.data(), y.size() * sizeof(float))) {
        return usage("cannot write --y");
    }
    return 0;
}

}  // namespace

int main(int argc, char** argv) {
    std::map<std::string, std::string> a;
    for (int i = 1; i < argc; ++i) {
        std::string k = argv[i];
        if (k.rfind("--", 0) != 0) {
            return usage(("unexpected argument " + k).c_str());
        }
        k = k.substr(2);
        if (k == "selfcheck" || k == "expect-planted") {
            a[k] = "1";
        } else if (i + 1 < argc) {
            a[k] = argv[++i];
        } else {
            return usage(("--" + k + " needs a value").c_str());
        }
    }
    if (a.count("selfcheck")) {
        return selfcheck(a.count("expect-planted") > 0);
    }
    return run_files(a);
}
