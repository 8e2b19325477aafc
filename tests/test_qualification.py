"""Qualification records and the wide --chunk values they justify: reader/writer, --chunk parsing,
what `auto` picks, and the CLI end to end on the tiny model."""
import dataclasses
import hashlib
import json

import pytest

from dflash.core import settings
from dflash.core.errors import UsageError
from dflash.native import build, library_id
from dflash.proof import records
from dflash.run import engine

from .conftest import run_dflash, run_json

V = records.Verdict


def ident(device="cpu"):
    return records.Identity("exact", "build", "0123456789abcdef", "ab" * 32, device)


def record(*verdicts, device="cpu"):
    return records.Record(ident(device), "/models/m.gguf", "2025-01-02T03:04:05Z", tuple(verdicts))


ALL_EXACT = (V(1, True, 1, True, 1, "/ev", 389), V(4, True, 4, True, 4, "/ev", 389), V(8, True, 4, True, 8, "/ev", 389))


# ---------------------------------------------------------------------------------------------
# Reader and writer

def test_round_trip(tmp_path):
    r = record(*ALL_EXACT, device="hip:0,hip:1")
    p = records.write(tmp_path / "q" / "r.json", r)
    assert records.read(p) == r and records.parse(records.render(r)) == r
    d = json.loads(p.read_text())
    assert (d["schema"], d["schema_version"], d["key"]) == (
        records.SCHEMA, records.SCHEMA_VERSION, r.identity.key)
    assert [w["width"] for w in d["widths"]] == [1, 4, 8]
    assert not list((tmp_path / "q").glob(".*.tmp"))  # the temporary sibling is gone


def edited(**changes):
    d = records.to_json(record(*ALL_EXACT))
    d.update(changes)
    return json.dumps(d).encode()


@pytest.mark.parametrize("raw,needle", [
    (b"", "not valid JSON"),
    (b"{\"schema\": ", "not valid JSON"),
    (b"[1, 2]", "not a JSON object"),
    (edited(schema="dflash.evidence"), "schema is 'dflash.evidence'"),
    (edited(schema_version=1), "schema_version is 1"),
    (edited(schema_version=True), "schema_version is True"),
    (edited(extra=1), "unknown ['extra']"),
    (edited(key="0" * 24), "key does not match"),
    (edited(device="gpu"), "device 'gpu'"),
    (edited(updated_utc="yesterday"), "updated_utc"),
    (edited(widths=[]), "non-empty list"),
    (edited(widths=[dict(dataclasses.asdict(ALL_EXACT[0]), fixed_exact=1)]), "fixed_exact is not true or false"),
    (edited(widths=[dict(dataclasses.asdict(ALL_EXACT[1]), width=4097)]), "not in 1..4096"),
    (edited(widths=[dict(dataclasses.asdict(ALL_EXACT[1]), fixed_widest_band=5)]),
     "fixed_widest_band is not in 1..4"),
    (edited(widths=[dataclasses.asdict(ALL_EXACT[1]), dataclasses.asdict(ALL_EXACT[0])]), "sorted and unique"),
    (edited(model={"sha256": "AB" * 32, "path": "m"}), "model is not"),
    (edited(widths=[dict(dataclasses.asdict(ALL_EXACT[0]), positions=0)]), "positions is not in 1.."),
    (edited(library={"flavor": "exact", "source": "build", "key": "0123456789abcdef"}), "library is not"),
    (edited(library={"flavor": "exact", "source": "build", "key": "0123456789abcdef", "cpu": "avx9"}),
     "library is not"),
    (edited(runtime={"cpu_buffer_types": ["CPU_REPACK"], "amx": True, "kernel_switches": {}, "host": None,
                     "kv_cache": "full"}), "runtime.amx does not say"),
    (edited(runtime={"cpu_buffer_types": None, "amx": None, "kernel_switches": {"GGML_CPU_TILED_MM": 0},
                     "host": None, "kv_cache": "full"}), "kernel_switches is not"),
    (edited(runtime={"cpu_buffer_types": [], "amx": False, "kernel_switches": {}, "host": None,
                     "kv_cache": "ring"}), "kv_cache is not one of"),
    (edited(runtime={"cpu_buffer_types": [], "amx": False, "kernel_switches": {}, "host": None}),
     "runtime must have exactly"),
    (b"{\"schema\": NaN}", "not valid JSON"),
])
def test_strict_reader(raw, needle):
    with pytest.raises(records.RecordError) as e:
        records.parse(raw)
    assert needle in str(e.value)


def test_load_treats_a_corrupt_or_foreign_record_as_none(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    r = record(*ALL_EXACT)
    warnings = []
    assert records.load(r.identity, warnings.append) is None and warnings == []  # no record: silent
    path = records.record_path(r.identity)
    assert path.parent == tmp_path / "dflash" / "qualifications"
    assert records.save(r, warnings.append) == r and records.load(r.identity, warnings.append) == r
    path.write_bytes(b"\x00garbage")
    assert records.load(r.identity, warnings.append) is None
    assert len(warnings) == 1 and str(path) in warnings[0] and "\n" not in warnings[0]
    records.write(path, record(*ALL_EXACT, device="hip:0"))  # valid, but about another device
    assert records.load(r.identity, warnings.append) is None and "another" in warnings[-1]


def test_save_merges_widths(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    records.save(record(*ALL_EXACT), print)
    again = record(V(1, True, 1, True, 1, "/ev2", 99), V(8, True, 4, False, 8, "/ev2", 99),
                   V(64, True, 4, True, 64, "/ev2", 99))
    stored = records.save(again, print)
    assert [(v.width, v.evidence_dir) for v in stored.widths] == [(1, "/ev2"), (4, "/ev"), (8, "/ev2"), (64, "/ev2")]
    assert records.read(records.record_path(again.identity)) == stored


# ---------------------------------------------------------------------------------------------
# What a record proves

def test_auto_takes_the_widest_proven_width_and_prefers_fixed():
    assert records.widest_proven(ALL_EXACT) == (8, settings.FIXED)
    planner_only = (V(1, True, 1, True, 1), V(8, True, 4, False, 8))
    assert records.widest_proven(planner_only) == (8, settings.PLANNER)
    assert records.proven_mode(planner_only, 8) == settings.PLANNER
    assert records.proven_mode(planner_only, 4) is None


def test_auto_never_picks_an_inexact_width():
    vs = (V(1, True, 1, True, 1), V(4, True, 4, True, 4), V(8, False, 4, False, 8))
    assert records.widest_proven(vs) == (4, settings.FIXED) and records.proven_mode(vs, 8) is None
    # a wider exact width above an inexact one is not proven: its tails would decode that width
    vs = (V(1, True, 1, True, 1), V(6, False, 4, False, 6), V(8, True, 4, True, 8))
    assert records.widest_proven(vs) == (1, settings.FIXED)
    stock = (V(1, True, 1, True, 1), V(2, False, 2, False, 2), V(4, False, 4, False, 4))
    assert records.widest_proven(stock) == (1, settings.FIXED)  # q1


def test_identity_key_depends_on_every_part():
    i = ident()
    keys = {i.key, ident("hip:0").key, dataclasses.replace(i, flavor="stock").key,
            dataclasses.replace(i, model_sha256="cd" * 32).key,
            dataclasses.replace(i, library_key="fedcba9876543210").key,
            dataclasses.replace(i, cpu="avx2").key,
            dataclasses.replace(i, cpu_buffer_types=("AMX", "CPU_REPACK")).key,
            dataclasses.replace(i, cpu_buffer_types=None).key,
            dataclasses.replace(i, kernel_switches=(("GGML_CPU_TILED_MM", "0"),)).key,
            dataclasses.replace(i, host="00" * 8).key,
            dataclasses.replace(i, kv_cache="window").key}
    assert len(keys) == 11 and all(len(k) == 24 for k in keys)


def test_dir_key_hashes_the_library_files(tmp_path):
    (tmp_path / "libllama.so").write_bytes(b"llama")
    (tmp_path / "libggml-cpu.so").write_bytes(b"cpu")
    (tmp_path / "notes.txt").write_text("not a library")
    k = library_id.dir_key(tmp_path)
    (tmp_path / "notes.txt").write_text("still not a library")
    assert library_id.dir_key(tmp_path) == k and len(k) == 64
    (tmp_path / "libggml-cpu.so").write_bytes(b"cpu2")
    assert library_id.dir_key(tmp_path) != k
    with pytest.raises(UsageError, match="no libllama.so"):
        library_id.dir_key(tmp_path / "missing")


# ---------------------------------------------------------------------------------------------
# --chunk parsing and settings

@pytest.mark.parametrize("text,value", [("auto", "auto"), ("AUTO", "auto"), ("1", 1), (" 4 ", 4),
                                        ("512", 512), ("4096", 4096), (64, 64), (None, None)])
def test_parse_chunk(text, value):
    assert settings.parse_chunk(text) == value


@pytest.mark.parametrize("text,needle", [("0", "out of range"), ("4097", "out of range"), (-1, "out of range"),
                                         ("x", "malformed"), ("4.5", "malformed"), ("", "malformed")])
def test_parse_chunk_rejects(text, needle):
    with pytest.raises(UsageError, match=needle):
        settings.parse_chunk(text)


def test_wide_chunk_settings():
    q = settings.Qualified("/r.json", "k" * 24, 8, settings.FIXED)
    s = settings.resolve({}, chunk="8", qualified=q)
    assert (s.bands, s.bands_from, s.cap, s.fixed, s.qualified) == (True, "chunk", 8, True, q)
    assert s.leaves_narrow_path and s.warnings() == []  # the record proves it: no batched warning
    s = settings.resolve({}, chunk="auto", qualified=dataclasses.replace(q, mode=settings.PLANNER))
    assert (s.cap, s.fixed, s.chunk_requested) == (8, False, "auto")
    s = settings.resolve({}, chunk="auto")  # no record: today's 4
    assert (s.bands, s.cap, s.qualified) == (True, 4, None)
    s = settings.resolve({settings.ENV_BANDS: "1"}, bands=False, chunk="64")  # --no-bands: q1, no record needed
    assert (s.bands, s.cap, s.qualified) == (False, 1, None)
    with pytest.raises(UsageError, match="^chunk 16"):
        settings.resolve({}, chunk=16, qualified=q)  # the record proves 8, not 16
    s = settings.resolve({settings.ENV_BANDS: "1"}, chunk=4, qualified=q)  # narrow: as today, no record
    assert (s.cap, s.fixed, s.qualified) == (4, False, None)


# ---------------------------------------------------------------------------------------------
# The CLI, without llama.cpp (plan; prefill refusing before it loads anything)

def hand_record(monkeypatch, tmp_path, model, verdicts):
    """A record for `model` on the exact built library and the CPU (what this host's library offers,
    the kernel switches of this environment, which the CLI's processes inherit), written into
    tmp_path's cache."""
    i = records.identity(settings.resolve({}), model)
    assert i.library_key == build.build_key("exact")
    assert i.model_sha256 == hashlib.sha256(model.read_bytes()).hexdigest()
    (tmp_path / "dflash").mkdir(exist_ok=True)  # the built libraries: a lookup asks the library what it offers
    (tmp_path / "dflash" / "llama").symlink_to(build.cache_root() / "llama")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    record = records.Record(i, str(model), records.now_utc(), tuple(verdicts))
    return records.write(records.record_path(i), record)


def test_auto_with_a_hand_written_record_picks_the_exact_width(tiny_models, tmp_path, monkeypatch):
    m = tiny_models["q8_0"]
    path = hand_record(monkeypatch, tmp_path, m,
                       [V(1, True, 1, True, 1, None, 50), V(4, True, 4, True, 4, None, 50),
                        V(8, False, 4, False, 8, None, 50)])
    env = {"XDG_CACHE_HOME": str(tmp_path)}
    d = run_json("plan", "--n-tokens", 10, "--model", m, "--chunk", "auto", env=env)
    assert d["cap"] == 4 and d["band_mode"] == "fixed" and d["widths"] == [4, 4, 2]
    assert d["qualification"] == {"path": str(path), "key": path.stem, "width": 4, "mode": "fixed", "positions": 50}
    r = run_dflash("plan", "--n-tokens", 10, "--model", m, "--chunk", 8, env=env)
    assert r.returncode == 2 and "no qualification record proves width 8" in r.stderr
    r = run_dflash("prefill", "--model", m, "--chunk", 8, "--threads", 1, env=env)
    assert r.returncode == 2 and f"dflash qualify --model {m} --widths 8" in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and "Traceback" not in r.stderr


def test_corrupt_record_is_no_record(tiny_models, tmp_path, monkeypatch):
    m = tiny_models["q8_0"]
    path = hand_record(monkeypatch, tmp_path, m, [V(1, True, 1, True, 1, None, 9)])
    path.write_text("{\"schema\": \"dflash.qualification\"")
    r = run_dflash("plan", "--n-tokens", 10, "--model", m, "--chunk", "auto", "--json",
                   env={"XDG_CACHE_HOME": str(tmp_path)})
    assert r.returncode == 0 and json.loads(r.stdout)["cap"] == 4 and json.loads(r.stdout)["qualification"] is None
    assert "ignoring qualification record" in r.stderr and "no qualification record" in r.stderr
    assert "dflash qualify" in r.stderr and "Traceback" not in r.stderr


@pytest.mark.parametrize("args,needle", [
    (["--chunk", "4097"], "--chunk 4097 is out of range"),
    (["--chunk", "wide"], "--chunk 'wide' is malformed"),
    (["--chunk", "0"], "out of range"),
    (["--chunk", "auto"], "needs --model"),
    (["--chunk", "64", "--ratios", "4"], "needs --model"),
])
def test_plan_chunk_errors(args, needle):
    r = run_dflash("plan", "--n-tokens", 5, *args)
    assert r.returncode == 2 and needle in r.stderr and len(r.stderr.strip().splitlines()) == 1


def test_plan_no_bands_ignores_a_wide_chunk():
    assert run_json("plan", "--n-tokens", 3, "--chunk", 64, "--no-bands")["widths"] == [1, 1, 1]


# ---------------------------------------------------------------------------------------------
# End to end: qualify writes a record, prefill runs what it proves

@pytest.fixture
def cache_with_library(tmp_path):
    """A temporary XDG cache that shares the built llama.cpp libraries of the real one."""
    (tmp_path / "dflash").mkdir()
    (tmp_path / "dflash" / "llama").symlink_to(build.cache_root() / "llama")
    return {"XDG_CACHE_HOME": str(tmp_path)}


def test_qualify_then_wide_prefill(tiny_models, tmp_path, cache_with_library):
    env, m = cache_with_library, tiny_models["f32"]
    ev = tmp_path / "ev"
    q = run_json("qualify", "--model", m, "--widths", "1,4,8", "--threads", 1, "--n-predict", 2,
                 "--evidence", ev, env=env)
    assert q["all_exact"] and q["recommended_chunk"] == 8 and q["recommended_band_mode"] == "fixed"
    rec = records.read(q["qualification"]["path"])
    assert [(v.width, v.planner_exact, v.fixed_exact, v.fixed_widest_band) for v in rec.widths] == \
        [(1, True, True, 1), (4, True, True, 4), (8, True, True, 8)]
    assert rec.identity.key == q["qualification"]["key"] and rec.widths[0].evidence_dir == str(ev)
    assert records.read(ev / records.FILE_NAME) == rec
    assert q["qualification"]["auto"] == {"width": 8, "mode": "fixed"}
    assert run_json("verify", ev)["ok"]

    d = run_json("prefill", "--model", m, "--chunk", 8, "--threads", 1, "--n-predict", 2, "--compare-q1", env=env)
    assert d["identical_to_q1"] and max(d["widths"]) == 8 and d["band_mode"] == "fixed" and d["warnings"] == []
    a = run_json("prefill", "--model", m, "--chunk", "auto", "--threads", 1, "--n-predict", 2, env=env)
    assert a["chunk"] == 8 and a["chunk_requested"] == "auto"
    assert a["qualification"] == {"path": q["qualification"]["path"], "key": rec.identity.key, "width": 8,
                                  "mode": "fixed", "positions": q["n_tokens"]}
    assert {v.positions for v in rec.widths} == {q["n_tokens"]} and a["n_prompt_tokens"] <= q["n_tokens"]
    assert (a["logits_sha256"], a["response_sha256"]) == (d["logits_sha256"], d["response_sha256"])
    r = run_dflash("prefill", "--model", m, "--chunk", 64, "--threads", 1, env=env)
    assert r.returncode == 2 and "dflash qualify" in r.stderr and "--widths 64" in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1


@pytest.mark.long
def test_widths_to_4096_are_exact_on_the_tiny_model_and_auto_runs_them(tmp_path, cache_with_library):
    """Widths past 512 (what DeepSeek-V4 runs in the field: 2,048-4,096 tokens per step): qualify
    1,024, 2,048 and 4,096 on the built-in model over a prompt of more than 8,200 tokens, each
    really decoding a band of its width (the fixed-width run) and bit-identical to q1; --chunk auto
    then runs 4,096 from that record and equals q1. The stock library at 1,024 is the twin that
    must differ."""
    env = cache_with_library
    q = run_json("qualify", "--widths", "1024,2048,4096", "--threads", 2, "--n-predict", 2,
                 "--evidence", tmp_path / "ev", env=env)
    assert q["all_exact"] and q["recommended_chunk"] == 4096 and q["n_tokens"] > 2 * 4096 + 8
    for r in q["results"][1:]:
        assert r["fixed_width"]["exact"] and r["fixed_width"]["widest_band"] == r["width"]
    prompt = tmp_path / "long.txt"
    prompt.write_text(engine.DEFAULT_PROMPT * 12)  # ~4,500 tokens: one band of 4,096 and a tail
    a = run_json("prefill", "--prompt-file", prompt, "--chunk", "auto", "--threads", 2, "--n-predict", 2,
                 "--compare-q1", env=env)
    assert a["chunk"] == 4096 and max(a["widths"]) == 4096 and a["identical_to_q1"]
    stock = run_json("qualify", "--lib", "stock", "--widths", "1024", "--threads", 2, "--n-predict", 2,
                     "--evidence", tmp_path / "stock", env=env)
    assert not stock["all_exact"] and stock["results"][0]["exact"]  # its q1 repeats; width 1,024 differs


@pytest.mark.long
def test_gemma_is_exact_at_1024(gemma, tmp_path, cache_with_library):
    """A real model past 512: Gemma 3 270M (262,144-token vocabulary, sliding-window layers) at
    width 1,024 over a 2,056-token prompt, bit-identical to q1 (widths 2,048 and 4,096 on Gemma:
    README, measured runs)."""
    q = run_json("qualify", "--model", gemma, "--widths", "1024", "--threads", 2, "--n-predict", 2,
                 "--evidence", tmp_path / "ev", env=cache_with_library)
    assert q["all_exact"] and q["recommended_chunk"] == 1024
    assert q["results"][1]["fixed_width"]["widest_band"] == 1024
