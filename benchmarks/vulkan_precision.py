"""How far each Vulkan flavor's width-1 logits lie from the CPU library's, end to end on a model.

    .venv/bin/python benchmarks/vulkan_precision.py                 # tiny DeepSeek-V4 (MXFP4)
    .venv/bin/python benchmarks/vulkan_precision.py --model gemma-3-270m-q4_k_m.gguf --tokens 48

One child process per library (the exact CPU library, the exact Vulkan build, llama.cpp's own
Vulkan build on vulkan:0) prefills the same prompt one token per step (q1) with llama.cpp's or
dflash's usual settings for that library, keeping every position's logits; the parent compares the
two Vulkan runs with the CPU run: the largest absolute difference, the root-mean-square difference,
and the positions whose arg-max token differs. The CPU library is the reference only because it is
the one dflash proves exact on every CPU class; none of these is a double-precision product (the
op-level harness has that figure per weight type). `--cpu-cache f32` gives the CPU reference an f32
KV cache and attention without flash attention (llama.cpp's defaults, an f16 cache and flash
attention, round every query and every cell to f16 inside attention on the CPU, as stock Vulkan's
f16 attention does on a device with f16, and the exact flavor's f32 attention does not; with flash
attention llama.cpp casts an f32 cache back to f16): a reference nearer the true attention, to
tell whose error the distance is. `--cpu-weights f32` gives it the model's weights dequantized to
F32 (llama.cpp's own quantizer, ftype ALL_F32: every value the quantized file holds, exactly):
with F32 weights the CPU backend keeps the activations in f32, where with quantized weights it
rounds them to 8 bits (Q8_K, Q8_0) before every product, an error that outweighs either Vulkan
flavor's own; with `--cpu-cache f32` as well the reference computes the same function in f32
throughout. Not a test: nothing is asserted.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

RUNS = (("exact", "cpu"), ("exact", "vulkan:0"), ("stock", "vulkan:0"))


def child(model: str | None, lib: str, device: str, tokens: int, threads: int, out: str, cache: str,
          weights: str) -> None:
    from dflash.compare import sweep
    from dflash.core.settings import resolve
    from dflash.native import llama
    from dflash.proof import diff
    from dflash.run import engine
    from dflash.run.bands import from_widths
    from dflash.session import Session

    if weights == "f32" and device == "cpu":  # the same model with its weights dequantized to F32
        assert model is not None  # main() refuses --cpu-weights f32 without --model
        engine.load_library(resolve({}, lib=lib))  # the library whose quantizer writes the copy
        f32 = str(Path(out).with_suffix(".f32.gguf"))
        llama.quantize(model, f32, 0, requantize=True)  # LLAMA_FTYPE_ALL_F32
        model = f32
    with Session(model, lib=lib, device=device, threads=threads, bands=False) as s:
        if cache == "f32" and device == "cpu":  # the reference's K and V cache in f32 (GGML_TYPE_F32 = 0)
            import llama_cpp

            # without flash attention: llama.cpp's flash-attention graph casts an f32 cache to f16
            engine.Engine.flash_attn = property(lambda self: False)  # type: ignore[assignment,method-assign]

            default = llama_cpp.llama_context_default_params

            def f32_cache():  # type: ignore[no-untyped-def]
                cp = default()
                cp.type_k = cp.type_v = 0
                return cp

            llama_cpp.llama_context_default_params = f32_cache
        toks = sweep.repeat_to(s.tokenize, engine.DEFAULT_PROMPT, tokens)[1][:tokens]
        r = diff.untapped_request(s.engine, toks, from_widths([1] * len(toks)))  # a fresh context, logits kept
        assert r.logits is not None
        np.save(out, np.asarray(r.logits, dtype=np.float32))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="GGUF model [default: the built-in tiny DeepSeek-V4 model]")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--cpu-cache", choices=("f16", "f32"), default="f16",
                    help="the CPU reference's KV cache type [default: f16, llama.cpp's]")
    ap.add_argument("--cpu-weights", choices=("model", "f32"), default="model",
                    help="the CPU reference's weights: the model's own, or dequantized to F32 [default: model]")
    ap.add_argument("--json", dest="json_out", default=None, help="also write the figures to this file")
    ap.add_argument("--child", nargs=3, metavar=("LIB", "DEVICE", "OUT"), help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.cpu_weights == "f32" and not a.model:
        ap.error("--cpu-weights f32 needs --model (the tiny model's presets are files of their own)")
    if a.child:
        child(a.model, a.child[0], a.child[1], a.tokens, a.threads, a.child[2], a.cpu_cache, a.cpu_weights)
        return
    logits = {}
    with tempfile.TemporaryDirectory(prefix="dflash-precision-") as tmp:
        for lib, device in RUNS:  # one library per process, one process at a time
            out = str(Path(tmp) / f"{lib}-{device.replace(':', '')}.npy")
            cmd = [sys.executable, __file__, "--tokens", str(a.tokens), "--threads", str(a.threads),
                   "--cpu-cache", a.cpu_cache, "--cpu-weights", a.cpu_weights, "--child", lib, device, out]
            cmd += ["--model", a.model] if a.model else []
            subprocess.run(cmd, check=True, cwd=ROOT)
            logits[(lib, device)] = np.load(out).astype(np.float64)
    ref = logits[("exact", "cpu")]
    rows = []
    for lib, device in RUNS[1:]:
        x = logits[(lib, device)]
        d = x - ref
        reference = f"exact cpu, {a.cpu_weights} weights, {a.cpu_cache} cache"
        rows.append({"lib": lib, "device": device, "reference": reference,
                     "positions": int(ref.shape[0]),
                     "max_abs_diff": float(np.abs(d).max()), "rms_diff": float(np.sqrt((d * d).mean())),
                     "argmax_positions_differing": int((x.argmax(axis=1) != ref.argmax(axis=1)).sum())})
        print(json.dumps(rows[-1]))
    if a.json_out:
        Path(a.json_out).write_text(json.dumps({"model": a.model or "tiny DeepSeek-V4 (mxfp4)",
                                                "tokens": a.tokens, "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
