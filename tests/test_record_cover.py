"""Qualification records cover what they vouch for (issue 17, item 4): the CPU variant, whether AMX
was granted, the kernel switches of the environment, the host of a DFLASH_LLAMA_LIB_DIR library and
the kind of KV cache are part of a record's identity, and a record covers prompts up to the length
it was qualified on; --chunk auto beyond that falls back with one warning line."""
import dataclasses
import json
import subprocess
import sys

import pytest

from dflash.core import settings
from dflash.core.errors import UsageError
from dflash.native import build, graph_switches, library_id, llama
from dflash.proof import records

from .conftest import HOST_HAS_AMX, ROOT, run_dflash, run_json

V = records.Verdict
EXACT = (1, True, 1, True, 1)


def verdicts(positions, widths=(1, 4, 8, 16)):
    return tuple(V(w, True, min(w, 4), True, w, "/ev", positions) for w in widths)


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """A cache of its own for the records (the built libraries shared), and a CPU that offers what
    `offer` says (default: what this host's library offers, without AMX)."""
    (tmp_path / "dflash").mkdir()
    (tmp_path / "dflash" / "llama").symlink_to(build.cache_root() / "llama")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    for name in [s.name for s in graph_switches.ENV_SWITCHES]:
        monkeypatch.delenv(name, raising=False)
    offered = {"bufts": ("CPU_REPACK",)}
    monkeypatch.setattr(library_id, "offered_buffer_types", lambda s, kind="cpu": offered["bufts"])
    return offered


def save(model, ident_settings=None, vs=None, **kw):
    i = records.identity(ident_settings or settings.resolve({}), model, **kw)
    records.save(records.Record(i, str(model), records.now_utc(), vs or verdicts(400)), print)
    return i


def look(model, s=None, chunk="auto", notes=None, **kw):
    notes = [] if notes is None else notes
    return records.lookup(s or settings.resolve({}), chunk, str(model), "mxfp4", "cpu", notes.append, notes.append,
                         **kw)


# ---------------------------------------------------------------------------------------------
# What a record is keyed by

def test_a_record_does_not_vouch_for_another_cpu_variant(tiny_models, cache):
    m = tiny_models["f32"]
    native = settings.resolve({})
    avx2 = dataclasses.replace(native, cpu="avx2")  # --cpu avx2 (DFLASH_CPU_VARIANT)
    i = save(m, native)
    j = records.identity(avx2, m)
    assert (i.cpu, j.cpu) == ("native", "avx2") and i.key != j.key
    assert j.library_key == build.build_key("exact", "none", "avx2") != i.library_key
    rendered = json.loads(records.render(records.Record(j, str(m), records.now_utc(), verdicts(9))))
    assert rendered["library"]["cpu"] == "avx2"
    assert look(m).width == 16
    notes = []
    assert look(m, avx2, notes=notes) is None
    assert "avx2 build" in notes[-1] and "no qualification record" in notes[-1]
    with pytest.raises(UsageError, match="no qualification record proves width 8") as e:
        look(m, avx2, chunk=8)
    assert str(e.value).endswith(f"run `dflash qualify --model {m} --cpu avx2 --widths 8`"), e.value
    assert look(m, chunk=8).width == 8


def test_a_refusal_names_the_command_that_makes_its_record(tiny_models, cache):
    """Everything that enters the record's key and is not the default is in the refusal's conditions
    and in the qualify command it suggests (a flag as a flag, an environment flag as a prefix), so
    running that command makes the record the refused run looks up."""
    m = tiny_models["f32"]
    tiled = settings.resolve({settings.ENV_TILE: "64", settings.ENV_WINDOW: "off"})
    with pytest.raises(UsageError) as e:
        look(m, tiled, chunk=512)
    msg = str(e.value)
    assert "indexer-tile 64" in msg.split("run `")[0] and f"{settings.ENV_WINDOW}=off" in msg.split("run `")[0]
    assert msg.endswith(f"run `{settings.ENV_WINDOW}=off dflash qualify --model {m} --indexer-tile 64 --widths 512`")
    save(m, tiled, verdicts(400, (1, 4, 512)))
    assert look(m, tiled, chunk=512).width == 512  # what the suggested command writes is what is looked up
    with pytest.raises(UsageError, match="--indexer-tile 64 --widths 512"):
        look(m, settings.resolve({settings.ENV_TILE: "64"}), chunk=512)  # the window's record proves nothing here


def test_a_record_made_with_amx_does_not_vouch_for_a_run_without_it(tiny_models, cache):
    """The host has no AMX: the CPU's buffer types are faked (an AMX host offers AMX first)."""
    m = tiny_models["f32"]
    cache["bufts"] = ("AMX", "CPU_REPACK")
    i = save(m)
    d = json.loads(records.record_path(i).read_text())["runtime"]
    assert d["cpu_buffer_types"] == ["AMX", "CPU_REPACK"] and d["amx"] is True and i.amx
    assert look(m).width == 16
    cache["bufts"] = ("CPU_REPACK",)  # AMX not granted (a VM): the weights go to other kernels
    notes = []
    assert look(m, notes=notes) is None and "without AMX" in notes[-1]
    cache["bufts"] = ("AMX", "CPU_REPACK")
    assert look(m).width == 16
    # with plain buffers (--no-repack) what the CPU offers is not used, and is not in the key
    plain = save(m, repack=False)
    assert plain.cpu_buffer_types is None and plain.amx is None
    cache["bufts"] = ("CPU_REPACK",)
    assert look(m, repack=False).width == 16


def test_a_kernel_switch_in_the_environment_is_part_of_the_key(tiny_models, cache, monkeypatch):
    m = tiny_models["f32"]
    save(m)
    assert look(m).width == 16
    monkeypatch.setenv("GGML_CPU_TILED_MM", "0")  # the vec_dot kernels instead of the tiled ones
    notes = []
    assert look(m, notes=notes) is None and "GGML_CPU_TILED_MM=0" in notes[-1]
    i = save(m)  # qualified with it set: vouches for runs with it set, only
    assert i.kernel_switches == (("GGML_CPU_TILED_MM", "0"),)
    assert look(m).width == 16
    monkeypatch.setenv("GGML_CPU_TILED_MM", "1")
    assert look(m) is None
    monkeypatch.delenv("GGML_CPU_TILED_MM")
    monkeypatch.setenv("GGML_CUDA_MMQ_PREC", "1")  # a CUDA switch: nothing on the CPU
    assert look(m).width == 16
    monkeypatch.setenv("GGML_SCHED_DEBUG", "1")  # read by ggml, changes no kernel
    assert look(m).width == 16


def test_a_library_folder_is_keyed_by_the_host(tiny_models, cache, tmp_path, monkeypatch):
    lib = tmp_path / "lib"
    lib.mkdir()
    for name in ("libllama.so", "libggml.so", "libggml-cpu.so"):
        (lib / name).write_bytes(name.encode())
    s = settings.resolve({settings.ENV_LIB_DIR: str(lib)})
    m = tiny_models["f32"]
    here = records.identity(s, m)
    assert here.library_source == "dir" and here.host == graph_switches.host_fingerprint()
    monkeypatch.setattr(graph_switches, "host_fingerprint", lambda: "ab" * 8)  # the same folder on another CPU
    there = records.identity(s, m)
    assert there.library_key == here.library_key and there.key != here.key
    assert records.identity(settings.resolve({}), m).host is None  # a build's key hashes the CPU flags


def test_a_window_sized_cache_has_its_own_key(tiny_models, cache):
    m = tiny_models["f32"]
    window = save(m, kv_cache="window")
    assert window.kv_cache == "window" and window.key != records.identity(settings.resolve({}), m).key
    assert look(m) is None  # dflash's contexts are full-size: a window record never vouches for them
    with pytest.raises(ValueError, match="kv_cache"):
        records.identity(settings.resolve({}), m, kv_cache="ring")


SWA_SCRIPT = """
import sys
from dflash.native import build, llama
llama.load_library(build.library_dir("exact"))
L = llama._lib()
m = llama.Model(sys.argv[1])
full = llama.Context(m, 1024, 1, max_band=8)
default = L.llama_context_default_params
def without_swa_full():
    p = default()
    p.swa_full = False
    return p
L.llama_context_default_params = without_swa_full   # a llama.cpp whose default is a window-sized cache
pinned = llama.Context(m, 1024, 1, max_band=8)
ring = llama.Context(m, 1024, 1, max_band=8, swa_full=False)
print(full.swa_full, pinned.swa_full, ring.swa_full, full.memory()["kv"], pinned.memory()["kv"], ring.memory()["kv"])
"""


def test_contexts_pin_a_full_size_sliding_window_cache(tiny_models):
    """dflash's contexts set swa_full whatever llama.cpp's default; a window-sized cache is a ring of
    n_swa + n_ubatch cells (a quarter of this context: window 64, padded to 256)."""
    r = subprocess.run([sys.executable, "-c", SWA_SCRIPT, str(tiny_models["f32"])], capture_output=True, text=True,
                       cwd=ROOT, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    full, pinned, ring, kv_full, kv_pinned, kv_ring = r.stdout.split()
    assert (full, pinned, ring) == ("True", "True", "False")
    assert int(kv_full) == int(kv_pinned) == 4 * int(kv_ring)


def test_the_library_says_which_cpu_buffer_types_it_offers():
    """Asked in a probe process (nothing loaded here): AMX first where /proc/cpuinfo lists it."""
    bufts = llama.probe_cpu_extra_buffer_types(build.library_dir("exact"))
    assert "CPU_REPACK" in bufts and ("AMX" in bufts) == HOST_HAS_AMX, (bufts, HOST_HAS_AMX)
    assert HOST_HAS_AMX is False or bufts[0] == "AMX"
    with pytest.raises(llama.LlamaError, match="cannot learn"):
        llama.probe_cpu_extra_buffer_types(ROOT)


# ---------------------------------------------------------------------------------------------
# What a record covers (pure)

def test_proofs_hold_for_prompts_up_to_their_length():
    vs = (V(*EXACT, positions=2000), V(4, True, 4, True, 4, positions=2000), V(64, True, 4, True, 64, positions=2000),
          V(512, True, 4, True, 512, positions=600))
    assert records.widest_proven(vs) == (512, settings.FIXED)
    assert records.widest_proven(vs, n_tokens=600) == (512, settings.FIXED)
    assert records.widest_proven(vs, n_tokens=601) == (64, settings.FIXED)
    assert records.widest_proven(vs, n_tokens=2001) == (1, settings.PLANNER)  # nothing covers it: q1
    assert records.covered(vs, 512, settings.FIXED) == 600 and records.covered(vs, 64, settings.FIXED) == 2000
    assert records.proven_mode(vs, 512, 601) is None and records.covered(vs, 128, settings.FIXED) == 0
    # a narrower width found inexact stops the proof at every length, whatever prompt it failed on
    for failed_on in (100, 900):
        vs = (V(*EXACT, positions=300), V(8, True, 4, True, 8, positions=300),
              V(4, False, 4, False, 4, positions=failed_on))
        assert records.proven_mode(vs, 8, 300) is None and records.proven_mode(vs, 8, 200) is None
        assert records.widest_proven(vs, n_tokens=200) == (1, settings.FIXED)


def covered_settings(chunk, width, vs):
    q = records.Covered("/q.json", "k" * 24, width, settings.FIXED, records.covered(vs, width, settings.FIXED), vs)
    return settings.resolve({}, chunk=chunk, qualified=q)


def test_auto_beyond_the_record_falls_back_with_one_line():
    vs = verdicts(389, (1, 4, 8, 64))
    s = covered_settings("auto", 64, vs)
    assert records.for_prompt(s, 389) == (s, None)  # within: as chosen
    t, msg = records.for_prompt(s, 390)
    assert (t.chunk, t.cap, t.qualified, t.fixed, t.chunk_requested) == (4, 4, None, False, "auto")
    assert "390 tokens, more than the 389" in msg and "/q.json" in msg and "running 4" in msg
    assert "\n" not in msg and "dflash qualify" in msg
    # the record proves a narrower wide width for the longer prompt: that one
    longer = (*vs, V(16, True, 4, True, 16, "/ev", 5000), V(2, True, 2, True, 2, "/ev", 5000),
              V(1, True, 1, True, 1, "/ev", 5000))
    vs2 = tuple(sorted({v.width: v for v in (*vs, *longer)}.values(), key=lambda v: v.width))
    t, msg = records.for_prompt(covered_settings("auto", 64, vs2), 1000)
    assert (t.chunk, t.qualified.width, t.qualified.positions) == (16, 16, 5000) and "running width 16" in msg
    # the record found width 2 inexact: the narrow fallback stays below it (a stock library: q1)
    bad = tuple(dataclasses.replace(v, fixed_exact=False, planner_exact=False) if v.width == 2 else v for v in vs2)
    t, msg = records.for_prompt(covered_settings("auto", 64, bad), 1000)
    assert t.chunk == 1 and "running 1" in msg


def test_an_explicit_wide_chunk_beyond_the_record_is_refused():
    s = covered_settings(64, 64, verdicts(389, (1, 4, 8, 64)))
    assert records.for_prompt(s, 200)[0] is s
    with pytest.raises(UsageError, match="^chunk 64: the prompt has 400 tokens, more than the 389"):
        records.for_prompt(s, 400)


def test_a_qualified_without_coverage_covers_nothing():
    s = settings.resolve({}, chunk="auto", qualified=settings.Qualified("/q.json", "k" * 24, 8, settings.FIXED))
    t, msg = records.for_prompt(s, 10)
    assert t.chunk == 4 and "more than the 0" in msg
    assert records.for_prompt(settings.resolve({}, chunk=4), 10**6)[1] is None  # narrow: no record involved


# ---------------------------------------------------------------------------------------------
# End to end: qualify on a short prompt, then prefill/plan --chunk auto on a longer one

SHORT = " ".join(f"Short prompt sentence {i} for the qualification." for i in range(18))  # ~180 tokens


@pytest.fixture
def shared_cache(tmp_path):
    (tmp_path / "dflash").mkdir()
    (tmp_path / "dflash" / "llama").symlink_to(build.cache_root() / "llama")
    return {"XDG_CACHE_HOME": str(tmp_path)}


def test_auto_beyond_a_short_qualification(tiny_models, tmp_path, shared_cache):
    env, m = shared_cache, tiny_models["f32"]
    q = run_json("qualify", "--model", m, "--prompt", SHORT, "--widths", "1,8", "--threads", 1, "--n-predict", 2,
                 "--evidence", tmp_path / "ev", env=env)
    n = q["n_tokens"]
    assert q["all_exact"] and q["qualification"]["auto"] == {"width": 8, "mode": "fixed"} and 128 < n < 300
    rec = records.read(q["qualification"]["path"])
    assert {v.positions for v in rec.widths} == {n} and rec.identity.kernel_switches == ()
    assert rec.identity.cpu == "native" and rec.identity.amx is HOST_HAS_AMX and rec.identity.kv_cache == "full"

    within = run_json("prefill", "--model", m, "--prompt", SHORT, "--chunk", "auto", "--threads", 1,
                      "--n-predict", 2, env=env)
    assert within["chunk"] == 8 and within["warnings"] == [] and within["qualification"]["positions"] == n

    # the built-in prompt (373 tokens) is longer than the record covers: 4, said on stderr and in --json
    r = run_dflash("prefill", "--model", m, "--chunk", "auto", "--threads", 1, "--n-predict", 2, "--json", env=env)
    assert r.returncode == 0, r.stderr
    d = json.loads(r.stdout)
    assert d["n_prompt_tokens"] > n and d["chunk"] == 4 and max(d["widths"]) == 4 and d["qualification"] is None
    assert d["chunk_requested"] == "auto" and d["band_mode"] == "planner"
    line = f"{d['n_prompt_tokens']} tokens, more than the {n}"
    assert [w for w in d["warnings"] if line in w] and line in r.stderr
    assert len([x for x in r.stderr.splitlines() if line in x]) == 1
    plan = run_json("plan", "--n-tokens", n + 1, "--model", m, "--chunk", "auto", env=env)
    assert plan["cap"] == 4 and plan["qualification"] is None and "more than the" in plan["warnings"][0]
    assert run_json("plan", "--n-tokens", n, "--model", m, "--chunk", "auto", env=env)["cap"] == 8

    r = run_dflash("prefill", "--model", m, "--chunk", 8, "--threads", 1, "--n-predict", 2, env=env)
    assert r.returncode == 2 and "more than the" in r.stderr and len(r.stderr.strip().splitlines()) == 1

    # the same short prompt with a kernel switch set: the record does not vouch for it
    r = run_dflash("prefill", "--model", m, "--prompt", SHORT, "--chunk", "auto", "--threads", 1, "--n-predict", 2,
                   "--json", env={**env, "GGML_CPU_TILED_MM": "0"})
    assert r.returncode == 0 and json.loads(r.stdout)["chunk"] == 4
    assert "no qualification record" in r.stderr and "GGML_CPU_TILED_MM=0" in r.stderr
