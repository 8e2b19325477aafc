"""Weight types outside the HIP narrow path (dflash/native/narrow.py), DFLASH_NARROW_MMVQ in settings."""
from __future__ import annotations

import re
from dataclasses import replace
from pathlib import Path

import pytest

from dflash.core import settings
from dflash.core.errors import UsageError
from dflash.model import gguf_meta
from dflash.native import narrow
from dflash.run.engine import Engine


def test_covered_set_is_the_kernels_and_mmvf():
    assert narrow.COVERED_WEIGHT_TYPES == {"Q8_0", "Q4_0", "Q4_K", "MXFP4", "Q6_K", "Q5_K", "Q5_0",
                                           "F32", "F16", "BF16"}


GLUE = Path(__file__).parents[1] / "hip_kernels" / "ggml" / "dflash-mmvq.cu"


def _code(text: str) -> str:
    """C++ source without comments and string or character literals (kept as empty quotes)."""
    token = re.compile(r'//[^\n]*|/\*.*?\*/|"(?:\\.|[^"\\\n])*"|\'(?:\\.|[^\'\\\n])*\'', re.S)
    return token.sub(lambda m: "" if m[0][0] == "/" else m[0][0] * 2, text)


def _braced(code: str, start: int) -> str:
    """The contents of the braces opened at code[start - 1]."""
    depth = 1
    for i in range(start, len(code)):
        depth += {"{": 1, "}": -1}.get(code[i], 0)
        if depth == 0:
            return code[start:i]
    raise AssertionError(f"unbalanced braces after {code[max(start - 60, 0):start]!r}")


def _body(code: str, function: str) -> str:
    """The body of the one definition of `function` (a return type, the name, a parameter list
    without parentheses, then braces: never a call)."""
    heads = list(re.finditer(rf"\b(?:bool|void|int)\s+{function}\s*\([^;{{}}()]*\)\s*\{{", code))
    assert len(heads) == 1, f"{function}: {len(heads)} definitions in {GLUE.name}"
    return _braced(code, heads[0].end())


def _switch_cases(body: str) -> dict[str, str]:
    """Label of each `case`/`default` of the function's one switch -> the statements it runs up
    to the next label (labels that fall through get the statements of the next one)."""
    (head,) = re.finditer(r"\bswitch\s*\(\s*\w+\s*\)\s*\{", body)
    parts = re.split(r"\b(case\s+[\w:]+|default)\s*:(?!:)", _braced(body, head.end()))
    assert not parts[0].strip(), f"statements before the first label: {parts[0]!r}"
    labels: dict[str, str] = {}
    pending: list[str] = []
    for label, stmts in zip(parts[1::2], parts[2::2], strict=True):
        pending.append(label.split()[-1])
        if stmts.strip():
            labels.update(dict.fromkeys(pending, " ".join(stmts.split())))
            pending = []
    assert not pending, f"labels without a statement: {pending}"
    return labels


def glue_routing(text: str) -> dict[str, set[str]]:
    """What the glue's code does per weight type: `kernel` (dflash_mmvq_type_ok returns true),
    `launched` (dflash_mmvq_launch_any starts dflash_mmvq_launch<dfmmvq::T> for GGML_TYPE_T) and
    `mmvf` (the types dflash_mmvf_type compares against)."""
    code = _code(text)
    ok = _switch_cases(_body(code, "dflash_mmvq_type_ok"))
    assert ok.pop("default") == "return false;"
    assert set(ok.values()) == {"return true;"}, ok
    launch = _switch_cases(_body(code, "dflash_mmvq_launch_any"))
    assert launch.pop("default").startswith("GGML_ABORT(")
    launched = set()
    for label, stmts in launch.items():
        m = re.fullmatch(r"dflash_mmvq_launch<dfmmvq::(\w+)>\(ncols, dense, id, grid, stream\); break;", stmts)
        assert m and label == f"GGML_TYPE_{m[1]}", (label, stmts)
        launched.add(m[1])
    mmvf = _body(code, "dflash_mmvf_type")
    terms = re.fullmatch(r"\s*return\s+(.*?);\s*", mmvf, re.S)
    assert terms, mmvf
    compared = [re.fullmatch(r"\s*type\s*==\s*GGML_TYPE_(\w+)\s*", t) for t in terms[1].split("||")]
    assert all(compared), terms[1]
    return {"kernel": {label.removeprefix("GGML_TYPE_") for label in ok}, "launched": launched,
            "mmvf": {m[1] for m in compared if m}}


def test_the_glue_routes_the_types_narrow_names():
    """dflash-mmvq.cu's routing predicate, launch switch and MMVF predicate (their code, not the
    names elsewhere in the file) take exactly the types narrow.py calls covered."""
    routing = glue_routing(GLUE.read_text())
    assert routing["kernel"] == routing["launched"] == narrow.NARROW_KERNEL_TYPES
    assert routing["mmvf"] == narrow.MMVF_TYPES


@pytest.mark.parametrize("function, label", [("dflash_mmvq_type_ok", "GGML_TYPE_Q5_K"),
                                             ("dflash_mmvq_launch_any", "GGML_TYPE_Q6_K")])
def test_a_deleted_case_is_seen(function, label):
    """Deleting one `case` from a switch of the glue changes what glue_routing reads, although the
    type's name is still in the file (static_asserts, the other switch)."""
    text = GLUE.read_text()
    start = text.index(function + "(")
    at = text.index(f"case {label}:", start)
    end = text.index("\n", at) + 1 if function == "dflash_mmvq_launch_any" else at + len(f"case {label}:")
    edited = text[:at] + text[end:]
    assert label in edited
    routing = glue_routing(edited)
    key = "kernel" if function == "dflash_mmvq_type_ok" else "launched"
    assert routing[key] == narrow.NARROW_KERNEL_TYPES - {label.removeprefix("GGML_TYPE_")}


def test_a_commented_out_case_is_seen():
    text = GLUE.read_text()
    edited = text.replace("        case GGML_TYPE_Q4_0:\n", "        // case GGML_TYPE_Q4_0:\n", 1)
    assert edited != text and glue_routing(edited)["kernel"] == narrow.NARROW_KERNEL_TYPES - {"Q4_0"}
    edited = text.replace("type == GGML_TYPE_BF16", "false /* type == GGML_TYPE_BF16 */", 1)
    with pytest.raises(AssertionError):
        glue_routing(edited)


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
                                                    settings.ENV_SHORTCUT: "1", settings.ENV_TILE: "0",
                                                    settings.ENV_WINDOW: "1"}
    with pytest.raises(UsageError, match=settings.ENV_NARROW):
        settings.resolve({settings.ENV_NARROW: "maybe"})
    assert dict(settings.resolve({settings.ENV_NARROW: "0"}).env_raw) == {settings.ENV_NARROW: "0"}
