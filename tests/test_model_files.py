"""The tiny model writer is deterministic, and GGUF metadata is read strictly."""
import hashlib

import pytest

from dflash.core.errors import ModelError
from dflash.model import gguf_meta, tiny_model

from .conftest import run_json


def sha(p):
    return hashlib.sha256(p.read_bytes()).hexdigest()


@pytest.mark.parametrize("weights", tiny_model.DIRECT)
def test_tiny_model_bytes_are_deterministic(tmp_path, weights):
    cfg = tiny_model.TinyConfig(weights=weights)
    a = tiny_model.write(tmp_path / "a.gguf", cfg)
    b = tiny_model.write(tmp_path / "b.gguf", cfg)
    assert sha(a) == sha(b)
    c = tiny_model.write(tmp_path / "c.gguf", tiny_model.TinyConfig(weights=weights, seed=99))
    assert sha(c) != sha(a)  # the seed reaches the bytes: the equality above is not vacuous


@pytest.mark.parametrize("weights,ktype", [("q4_k_m", "Q4_K"), ("q6_k", "Q6_K")])
def test_k_quant_tiny_model_is_deterministic(tmp_path, tiny_models, weights, ktype):
    """llama.cpp's quantizer (one thread) makes the same bytes twice; rows of 128 cannot hold a
    256-element K block, so those matrices fall back to other types, which the JSON reports."""
    first = tiny_models[weights]  # made by `dflash tiny-model --out` in a subprocess
    d = run_json("tiny-model", "--weights", weights, "--out", tmp_path / "again.gguf")
    assert d["sha256"] == sha(first) != sha(tiny_models["f32"])
    types = d["tensor_types"]
    assert types == gguf_meta.read(first).weight_types and types.get(ktype, 0) > 0
    assert sum(types.values()) == sum(gguf_meta.read(tiny_models["f32"]).weight_types.values())
    with pytest.raises(ValueError, match="quantizer"):
        tiny_model.write(tmp_path / "no.gguf", tiny_model.TinyConfig(weights=weights))


def test_metadata_of_tiny_model(tiny_models):
    info = gguf_meta.read(tiny_models["mxfp4"])
    assert info.architecture == "deepseek4"
    assert info.compress_ratios == (0, 4, 128, 4, 128)
    assert (info.sliding_window, info.context_length, info.vocab_size, info.n_layers) == (64, 16384, 512, 5)
    assert {"Q8_0", "MXFP4", "BF16"} <= set(info.weight_types)
    assert "Q4_0" in gguf_meta.read(tiny_models["q4_0"]).weight_types


def test_non_deepseek_model_has_no_ratios(tmp_path):
    import gguf
    import numpy as np
    p = tmp_path / "llama.gguf"
    w = gguf.GGUFWriter(str(p), "llama")
    w.add_uint32("llama.context_length", 128)
    w.add_tensor("x", np.zeros((4, 32), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    info = gguf_meta.read(p)
    assert info.architecture == "llama" and info.compress_ratios == () and info.context_length == 128


@pytest.mark.parametrize("make,msg", [
    (lambda p, good: None, "not found"),
    (lambda p, good: p.write_bytes(b""), "empty"),
    (lambda p, good: p.write_bytes(good[: len(good) // 2]), "truncated"),
    (lambda p, good: p.write_bytes(good[:5000]), "truncated"),
    (lambda p, good: p.write_bytes(b"not a model at all" * 50), "not a GGUF"),
    (lambda p, good: p.write_bytes(b"GGUF" + b"\xff" * 500), "corrupt"),
    (lambda p, good: p.mkdir(), "directory"),
])
def test_bad_model_files(tmp_path, tiny_models, make, msg):
    p = tmp_path / "bad.gguf"
    make(p, tiny_models["q4_0"].read_bytes())
    with pytest.raises(ModelError, match=msg):
        gguf_meta.read(p)
