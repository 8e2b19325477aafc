"""Weight types outside the HIP narrow path (dflash/narrow.py), DFLASH_NARROW_MMVQ in settings."""
from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from dflash import gguf_meta, narrow, settings
from dflash.engine import Engine
from dflash.errors import UsageError


def test_covered_set_is_the_kernels_and_mmvf():
    assert narrow.COVERED_WEIGHT_TYPES == {"Q8_0", "Q4_0", "Q4_K", "MXFP4", "Q6_K", "Q5_K", "Q5_0",
                                           "F32", "F16", "BF16"}


def test_the_glue_routes_the_types_narrow_names():
    """dflash-mmvq.cu's launch switch and MMVF predicate name the same types as narrow.py."""
    glue = (Path(__file__).parents[1] / "hip_kernels" / "ggml" / "dflash-mmvq.cu").read_text()
    for t in narrow.COVERED_WEIGHT_TYPES:
        assert f"GGML_TYPE_{t}" in glue, t


@pytest.mark.parametrize("archs", [(), ("gfx1201",), ("gfx1151",), ("gfx1201", "gfx1151")])
def test_covered_types_are_not_named(archs):
    types = {"Q8_0": 3, "MXFP4": 2, "BF16": 1, "F32": 4}
    assert narrow.uncovered_weight_types(types, archs) == {}


def test_uncovered_types_on_hip_and_nothing_on_cpu():
    types = {"Q6_K": 12, "IQ4_XS": 3, "Q8_0": 40, "Q2_K": 1}
    assert narrow.uncovered_weight_types(types, ("gfx1201",)) == {"IQ4_XS": 3, "Q2_K": 1}
    assert narrow.uncovered_weight_types(types, ()) == {}


def test_switched_off_or_unrouted_arch_leaves_everything_uncovered():
    types = {"Q8_0": 40, "F16": 2}
    assert narrow.uncovered_weight_types(types, ("gfx1201",), narrow=False) == types
    assert narrow.uncovered_weight_types(types, ("gfx1201", "gfx90a")) == types
    assert "DFLASH_NARROW_MMVQ=0" in (narrow.warning(types, "hip:0", ("gfx1201",), narrow=False) or "")
    assert "gfx90a" in (narrow.warning(types, "hip:0", ("gfx90a",)) or "")


def test_warning_line_names_types_with_counts():
    line = narrow.warning({"IQ4_XS": 3, "Q6_K": 12}, "hip:0", ("gfx1201",))
    assert line is not None and "Q6_K (12 tensors), IQ4_XS (3)" in line and "hip:0" in line
    assert narrow.describe({"Q2_K": 1}) == "Q2_K (1 tensor)"
    assert narrow.warning({}, "hip:0") is None


@pytest.mark.parametrize("weights", ["mxfp4", "f32", "f16", "q8_0", "q4_0"])
def test_tiny_presets_are_covered_on_rdna(tiny_models, weights):
    info = gguf_meta.read(tiny_models[weights])
    assert info.matrix_types and set(info.matrix_types) <= set(info.weight_types)
    assert "I32" in info.weight_types and "I32" not in info.matrix_types  # the hash-routing table
    assert narrow.uncovered_weight_types(info.matrix_types, ("gfx1151",)) == {}


def _engine(info, device: str, archs: tuple[str, ...], env: dict[str, str] | None = None) -> Engine:
    return Engine(settings.resolve(env or {}), info, model=None, lib_dir=Path("/lib"),  # type: ignore[arg-type]
                  threads=1, device=device, gpu_archs=archs)


def test_engine_names_uncovered_types_for_hip_only(tiny_models):
    info = gguf_meta.read(tiny_models["q8_0"])
    info = replace(info, matrix_types={**info.matrix_types, "Q6_K": 12, "IQ4_XS": 3})
    hip = _engine(info, "hip:0", ("gfx1201",))
    assert hip.uncovered_weight_types == {"IQ4_XS": 3}  # Q6_K is covered
    assert len(hip.narrow_warnings()) == 1 and "IQ4_XS (3 tensors)" in hip.narrow_warnings()[0]
    cpu = _engine(info, "cpu", ())
    assert cpu.uncovered_weight_types == {} and cpu.narrow_warnings() == []
    off = _engine(info, "hip:0", ("gfx1201",), {settings.ENV_NARROW: "off"})
    assert off.uncovered_weight_types == info.matrix_types


@pytest.mark.parametrize("value, on", [("1", True), ("0", False), ("TRUE", True), ("false", False), ("yes", True),
                                       ("no", False), (" on ", True), ("Off", False), ("", True)])
def test_narrow_flag_parses_like_every_boolean(value, on):
    s = settings.resolve({settings.ENV_NARROW: value})
    assert s.narrow is on
    assert s.library_env()[settings.ENV_NARROW] == ("1" if on else "0")


def test_narrow_flag_defaults_on_and_rejects_junk():
    s = settings.resolve({})
    assert s.narrow is True and s.library_env() == {settings.ENV_MMVQ: "3", settings.ENV_NARROW: "1",
                                                    settings.ENV_SHORTCUT: "1"}
    with pytest.raises(UsageError, match=settings.ENV_NARROW):
        settings.resolve({settings.ENV_NARROW: "maybe"})
    assert dict(settings.resolve({settings.ENV_NARROW: "0"}).env_raw) == {settings.ENV_NARROW: "0"}
