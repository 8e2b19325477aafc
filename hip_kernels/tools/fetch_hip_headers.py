#!/usr/bin/env python3
"""Fetch HIP headers without ROCm: the include folder of the pinned `triton` wheel from PyPI.

The triton wheel carries HIP 6.2's headers under triton/backends/amd/include (hip/,
hip/amd_detail/, hsa/, ...) and ROCm's device libraries as bitcode
(triton/backends/amd/lib/ocml.bc, ockl.bc). This script downloads the wheel once with pip
(`pip download --no-deps triton==<TRITON_VERSION>`, never a URL), extracts only those two
folders into <cache>/hip-headers/<version>/{include,lib} (temp dir + rename: a half-extracted
tree never sits at the keyed path), deletes the wheel, and prints the include path.

    fetch_hip_headers.py [--python PY] [--cache DIR] [--print-version] [--lib]

--python: the interpreter whose pip downloads the wheel (default: this one; the wheel is
CPython-version specific, but the headers in it are not). --cache: default
$XDG_CACHE_HOME/dflash or ~/.cache/dflash. --lib prints the bitcode folder instead.
Stdlib only: CMake runs it with any Python 3.
"""
from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

# The newest triton whose HIP header set is complete for ggml (hip_fp16.h, hip_bf16.h, hip_fp8.h,
# cooperative groups; 3.9.0's lacks the first three); bump deliberately (cache and build keys follow it)
TRITON_VERSION = "3.5.0"
_PREFIX = "triton/backends/amd/"
_WANT = ("include/", "lib/ocml.bc", "lib/ockl.bc")
_MARK = ".complete"


def cache_dir(cache: Path | None = None) -> Path:
    if cache is None:
        base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
        cache = Path(base) / "dflash"
    return cache / "hip-headers" / TRITON_VERSION


def fetch(python: str = sys.executable, cache: Path | None = None, log=lambda s: None) -> Path:
    """The version's folder (with include/ and lib/), downloaded and extracted once."""
    dest = cache_dir(cache)
    if (dest / _MARK).is_file():
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{TRITON_VERSION}-", dir=dest.parent))
    try:
        log(f"downloading triton=={TRITON_VERSION} with pip (about 290 MB, once) for its HIP headers")
        cmd = [python, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:", "-q",
               "-d", str(tmp / "wheel"), f"triton=={TRITON_VERSION}"]
        r = subprocess.run(cmd, capture_output=True, text=True)
        wheels = sorted((tmp / "wheel").glob("triton-*.whl"))
        if r.returncode != 0 or not wheels:
            tail = (r.stderr or r.stdout).strip().splitlines()[-1:] or ["no output"]
            raise SystemExit(f"fetch_hip_headers: pip download triton=={TRITON_VERSION} failed: {tail[0]}")
        out = tmp / "tree"
        with zipfile.ZipFile(wheels[0]) as zf:
            names = [n for n in zf.namelist()
                     if n.startswith(_PREFIX) and n[len(_PREFIX):].startswith(_WANT) and not n.endswith("/")]
            if not any(n.endswith("include/hip/hip_runtime.h") for n in names):
                raise SystemExit(f"fetch_hip_headers: {wheels[0].name} has no {_PREFIX}include/hip/hip_runtime.h")
            for n in names:
                target = out / n[len(_PREFIX):]
                if ".." in Path(n).parts:
                    raise SystemExit(f"fetch_hip_headers: refusing member {n!r}")
                target.parent.mkdir(parents=True, exist_ok=True)
                with zf.open(n) as src, open(target, "wb") as dst:
                    shutil.copyfileobj(src, dst)
        (out / _MARK).write_text(f"triton=={TRITON_VERSION} {wheels[0].name}\n")
        try:
            os.replace(out, dest)  # atomic; fails if another process got there first
        except OSError:
            if not (dest / _MARK).is_file():
                shutil.rmtree(dest, ignore_errors=True)  # a leftover without the mark: replace it
                os.replace(out, dest)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return dest


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--python", default=sys.executable, help="interpreter whose pip downloads the wheel")
    ap.add_argument("--cache", type=Path, default=None, help="cache root (default ~/.cache/dflash)")
    ap.add_argument("--print-version", action="store_true", help="print the pinned triton version and exit")
    ap.add_argument("--lib", action="store_true", help="print the device bitcode folder, not the include folder")
    a = ap.parse_args(argv)
    if a.print_version:
        print(TRITON_VERSION)
        return 0
    root = fetch(a.python, a.cache, log=lambda s: print(s, file=sys.stderr))
    print(root / ("lib" if a.lib else "include"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
