"""The cached built-in tiny model: keyed by everything its bytes depend on, checked on reuse,
written atomically; and `dflash tiny-model`'s --seed and --out are usage errors when bad."""
import dataclasses
import hashlib
import json
import os
import stat

import numpy as np
import pytest

from dflash.core.errors import DflashError
from dflash.model import tiny_model

from .conftest import run_dflash, run_json

CFG = tiny_model.TinyConfig(weights="q4_0")  # the smallest preset written by tiny_model alone


def sha(p):
    return hashlib.sha256(p.read_bytes()).hexdigest()


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """An empty user cache of this test's own; returns its models folder."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    return tmp_path / "xdg" / "dflash" / "models"


@pytest.fixture
def fresh(tmp_path):
    """The bytes a fresh write of CFG makes."""
    return tiny_model.write(tmp_path / "fresh.gguf", CFG).read_bytes()


def no_rewrite(monkeypatch):
    def fail(*a, **k):
        raise AssertionError("the cached model was written again")
    monkeypatch.setattr(tiny_model, "_write", fail)


# --- the cache key ----------------------------------------------------------------------------

def test_ensure_writes_model_and_sidecar_then_reuses_them(cache, fresh, monkeypatch):
    p = tiny_model.ensure(CFG)
    assert p.parent == cache and p == tiny_model.default_path(CFG)
    assert p.read_bytes() == fresh
    meta = json.loads(tiny_model.sidecar_path(p).read_text())
    assert meta["sha256"] == sha(p) and meta["bytes"] == p.stat().st_size
    assert meta["key"] == tiny_model.cache_key(CFG)
    assert meta["inputs"]["config"] == json.loads(json.dumps(dataclasses.asdict(CFG)))
    assert sorted(f.name for f in cache.iterdir()) == sorted([p.name, p.name + ".json"])  # no temp left
    no_rewrite(monkeypatch)
    assert tiny_model.ensure(CFG) == p and p.read_bytes() == fresh


@pytest.mark.parametrize("field,value", [("n_ctx_train", 2048), ("n_vocab", 256), ("top_k", 8),
                                         ("ratios", (4, 128, 0)), ("seed", 99)])
def test_every_config_field_keys_the_cache(cache, field, value):
    """Only weights and seed were in the file name: another context length reused the default's file."""
    other = dataclasses.replace(CFG, **{field: value})
    assert tiny_model.default_path(other) != tiny_model.default_path(CFG)
    a, b = tiny_model.ensure(CFG), tiny_model.ensure(other)
    assert a != b and sha(a) != sha(b)


@pytest.mark.parametrize("source", ["writer_fingerprint", "gguf_version", "numpy_version"])
def test_new_writer_or_gguf_or_numpy_makes_a_new_file(cache, fresh, monkeypatch, source):
    old = tiny_model.ensure(CFG)
    old_meta = tiny_model.sidecar_path(old).read_text()
    monkeypatch.setattr(tiny_model, source, lambda: "something else")
    new = tiny_model.ensure(CFG)
    assert new != old and new.is_file() and new.read_bytes() == fresh  # made now, by this writer
    assert json.loads(tiny_model.sidecar_path(new).read_text())["inputs"][
        {"writer_fingerprint": "writer", "gguf_version": "gguf", "numpy_version": "numpy"}[source]
    ] == "something else"
    assert tiny_model.sidecar_path(old).read_text() == old_meta  # the other version's file is untouched


def test_writer_fingerprint_is_the_version_and_this_source():
    fp = tiny_model.writer_fingerprint()
    src = hashlib.sha256(open(tiny_model.__file__, "rb").read()).hexdigest()
    assert fp == f"{tiny_model.WRITER_VERSION}:{src}"
    import importlib.metadata
    assert tiny_model.gguf_version().startswith(importlib.metadata.version("gguf") + ":")


def test_quantizer_key_is_part_of_k_quant_keys_only(cache):
    cfg = tiny_model.TinyConfig(weights="q4_k_m")
    assert tiny_model.default_path(cfg, "lib-a") != tiny_model.default_path(cfg, "lib-b")
    assert tiny_model.default_path(CFG, "lib-a") == tiny_model.default_path(CFG, "lib-b")
    with pytest.raises(ValueError, match="quantizer"):
        tiny_model.ensure(cfg)
    calls = []

    def fake_quantize(src, dst, ftype):  # stands in for llama.cpp: a copy of the f32 model
        calls.append(ftype)
        with open(src, "rb") as f, open(dst, "wb") as g:
            g.write(f.read())
    p = tiny_model.ensure(cfg, fake_quantize, quantizer_key="lib-a")
    assert tiny_model.ensure(cfg, fake_quantize, quantizer_key="lib-a") == p and calls == [15]
    assert tiny_model.ensure(cfg, fake_quantize, quantizer_key="lib-b") != p and calls == [15, 15]


# --- the check on reuse -----------------------------------------------------------------------

def flip(p):
    b = bytearray(p.read_bytes())
    b[len(b) // 2] ^= 0x01
    p.write_bytes(bytes(b))


@pytest.mark.parametrize("damage", [
    flip,
    lambda p: p.write_bytes(p.read_bytes()[:-1]),                       # truncated
    lambda p: p.write_bytes(b""),                                       # empty
    lambda p: p.unlink(),                                               # gone
    lambda p: tiny_model.sidecar_path(p).unlink(),                      # no sidecar (an older dflash)
    lambda p: tiny_model.sidecar_path(p).write_text("{not json"),
    lambda p: tiny_model.sidecar_path(p).write_bytes(b"\xff\xfe"),
    lambda p: tiny_model.sidecar_path(p).write_text("[]"),
    lambda p: tiny_model.sidecar_path(p).write_text(json.dumps(
        {**json.loads(tiny_model.sidecar_path(p).read_text()), "key": "0" * 64})),
], ids=["flipped", "truncated", "empty", "gone", "no-sidecar", "bad-json", "not-utf8", "not-object",
        "other-key"])
def test_damaged_cache_is_rewritten_never_used(cache, fresh, damage):
    p = tiny_model.ensure(CFG)
    damage(p)
    assert not tiny_model.verify(p, tiny_model.cache_key(CFG))
    assert tiny_model.ensure(CFG) == p
    assert p.read_bytes() == fresh
    assert tiny_model.verify(p, tiny_model.cache_key(CFG))
    assert sorted(f.name for f in cache.iterdir()) == sorted([p.name, p.name + ".json"])


def test_cached_path_that_is_a_directory_is_an_error(cache):
    tiny_model.default_path(CFG).mkdir(parents=True)
    with pytest.raises(DflashError, match="cannot write the tiny model"):
        tiny_model.ensure(CFG)


# --- atomic writes ----------------------------------------------------------------------------

def test_crash_while_writing_leaves_nothing_that_is_reused(cache, fresh, monkeypatch):
    real = tiny_model._write

    def crash(gguf, QT, out, c):
        with open(out, "wb") as f:
            f.write(fresh[:1000])  # half a model under the temporary name
        raise KeyboardInterrupt
    monkeypatch.setattr(tiny_model, "_write", crash)
    with pytest.raises(KeyboardInterrupt):
        tiny_model.ensure(CFG)
    assert not cache.exists() or list(cache.iterdir()) == []
    monkeypatch.setattr(tiny_model, "_write", real)
    assert tiny_model.ensure(CFG).read_bytes() == fresh


def test_crash_between_sidecar_and_model_is_a_mismatch(cache, fresh, monkeypatch):
    p = tiny_model.ensure(CFG)
    flip(p)
    real = os.replace

    def crash_on_model(src, dst):
        if str(dst).endswith(".gguf"):
            raise KeyboardInterrupt
        real(src, dst)
    monkeypatch.setattr(tiny_model.os, "replace", crash_on_model)
    with pytest.raises(KeyboardInterrupt):
        tiny_model.ensure(CFG)
    monkeypatch.setattr(tiny_model.os, "replace", real)
    assert not tiny_model.verify(p, tiny_model.cache_key(CFG))  # new sidecar, old damaged bytes
    assert tiny_model.ensure(CFG).read_bytes() == fresh
    assert sorted(f.name for f in cache.iterdir()) == sorted([p.name, p.name + ".json"])


def test_written_model_has_the_umask_mode_not_0600(tmp_path):
    old = os.umask(0o022)
    try:
        p = tiny_model.write(tmp_path / "m.gguf", CFG)
    finally:
        os.umask(old)
    assert stat.S_IMODE(p.stat().st_mode) == 0o644


# --- seeds ------------------------------------------------------------------------------------

@pytest.mark.parametrize("seed", [-1, 2**32, True, 1.5, "7"])
def test_config_rejects_seeds_outside_the_range(seed):
    with pytest.raises(ValueError, match="seed"):
        tiny_model.TinyConfig(seed=seed)


def test_config_accepts_the_seed_range():
    assert tiny_model.TinyConfig(seed=0).seed == 0
    assert tiny_model.TinyConfig(seed=tiny_model.SEED_MAX).seed == 2**32 - 1
    s = tiny_model.TinyConfig(seed=np.int64(5)).seed
    assert s == 5 and type(s) is int


# --- the command ------------------------------------------------------------------------------

def one_line_usage_error(r, needle):
    assert r.returncode == 2, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("dflash: usage error:") and needle in lines[0], r.stderr
    assert "Traceback" not in r.stderr and r.stdout == ""


@pytest.mark.parametrize("seed", ["-1", str(2**32), "x"])
def test_cli_bad_seed_is_a_usage_error(tmp_path, seed):
    r = run_dflash("tiny-model", "--seed", seed, env={"XDG_CACHE_HOME": str(tmp_path)})
    one_line_usage_error(r, "--seed")
    assert not (tmp_path / "dflash" / "models").exists()


def test_cli_help_shows_the_seed_range():
    r = run_dflash("tiny-model", "--help", check=True)
    assert "0<=x<=4294967295" in r.stdout


def test_cli_largest_seed_writes_a_model(tmp_path):
    d = run_json("tiny-model", "--weights", "q4_0", "--seed", 2**32 - 1, "--out", tmp_path / "m.gguf")
    cfg = tiny_model.TinyConfig(weights="q4_0", seed=2**32 - 1)
    assert d["seed"] == 2**32 - 1 and d["sha256"] == sha(tiny_model.write(tmp_path / "ref.gguf", cfg))


@pytest.mark.parametrize("out", ["", "   ", "\t"])
def test_cli_empty_out_is_a_usage_error(tmp_path, out):
    r = run_dflash("tiny-model", "--weights", "q4_0", "--out", out, env={"XDG_CACHE_HOME": str(tmp_path)})
    one_line_usage_error(r, "--out is empty")
    assert not (tmp_path / "dflash" / "models").exists()  # not the default in disguise


def test_cli_out_directory_is_a_usage_error(tmp_path):
    d = tmp_path / "dir"
    d.mkdir()
    r = run_dflash("tiny-model", "--weights", "q4_0", "--out", d)
    one_line_usage_error(r, "--out is a directory")
    assert list(d.iterdir()) == []


def test_cli_out_inside_a_file_is_a_usage_error(tmp_path):
    f = tmp_path / "file"
    f.write_text("x")
    r = run_dflash("tiny-model", "--weights", "q4_0", "--out", f / "sub" / "m.gguf")
    one_line_usage_error(r, "--out is inside a file")
    assert f.read_text() == "x"


def test_cli_repairs_a_corrupt_cached_model(tmp_path):
    env = {"XDG_CACHE_HOME": str(tmp_path / "xdg")}
    first = run_json("tiny-model", "--weights", "q4_0", env=env)
    p = tmp_path / "xdg" / "dflash" / "models" / os.path.basename(first["path"])
    assert first["path"] == str(p) and sha(p) == first["sha256"]
    assert first["sha256"] == sha(tiny_model.write(tmp_path / "ref.gguf", CFG))
    flip(p)
    again = run_json("tiny-model", "--weights", "q4_0", env=env)
    assert again["path"] == first["path"] and again["sha256"] == first["sha256"] == sha(p)
