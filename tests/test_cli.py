"""The command line: documented outputs, and one-line errors with the right exit codes."""
import json

import pytest

from .conftest import run_dflash

BANDS_ON = {"DFLASH_DS4_EXACT_PREFILL_BANDS": "1"}


def plan_widths(*args, env=None):
    r = run_dflash("plan", *args, "--json", env=env, check=True)
    return json.loads(r.stdout)


def test_plan_documented_examples():
    assert plan_widths("--n-tokens", 10, "--ratios", "4,128", "--chunk", 4, env=BANDS_ON)["widths"] == [4, 4, 2]
    d = plan_widths("--n-tokens", 10, "--start", 1, "--ratios", "4,128", "--chunk", 4, env=BANDS_ON)
    assert d["widths"] == [3, 4, 3]
    assert [(b["start"], b["width"], b["reason"]) for b in d["bands"]] == [
        (1, 3, "start"), (4, 4, "full"), (8, 3, "tail")]
    assert plan_widths("--n-tokens", 10, "--ratios", "4,128", "--chunk", 4)["widths"] == [1] * 10
    assert plan_widths("--n-tokens", 9, "--ratios", "none", env=BANDS_ON)["widths"] == [4, 4, 1]


def test_plan_reads_ratios_from_model(tiny_models):
    d = plan_widths("--n-tokens", 6, "--start", 126, "--model", tiny_models["q4_0"], env=BANDS_ON)
    assert d["ratios"] == [4, 128] and d["widths"] == [2, 4]


def test_plan_warns_when_bands_leave_narrow_path():
    d = plan_widths("--n-tokens", 8, "--ratios", "none", env={**BANDS_ON, "LUCE_MMVQ_MAX_NCOLS": "2"})
    assert {b["kernel"] for b in d["bands"]} == {"batched"} and d["warnings"]


def assert_one_line_error(r, code, *needles):
    assert r.returncode == code, (r.returncode, r.stdout, r.stderr)
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1, r.stderr
    assert "Traceback" not in r.stderr
    for n in needles:
        assert n in lines[0], lines[0]


@pytest.mark.parametrize("args,env,code,needle", [
    (["plan", "--n-tokens", "-3"], {}, 2, "--n-tokens"),
    (["plan", "--n-tokens", "5", "--ratios", "4,x"], {}, 2, "--ratios"),
    (["plan", "--n-tokens", "5", "--chunk", "0"], BANDS_ON, 2, "--chunk"),
    (["plan", "--n-tokens", "5", "--chunk", "5"], BANDS_ON, 2, "--chunk"),
    (["plan", "--n-tokens", "5"], {"DFLASH_DS4_EXACT_PREFILL_BANDS": "maybe"}, 2, "DFLASH_DS4_EXACT_PREFILL_BANDS"),
    (["plan", "--n-tokens", "5"], {"LUCE_MMVQ_MAX_NCOLS": "abc"}, 2, "LUCE_MMVQ_MAX_NCOLS"),
    (["prefill", "--chunk", "5"], BANDS_ON, 2, "--chunk"),
    (["prefill", "--bands", "--chunk", "0"], {}, 2, "--chunk"),
    (["prefill", "--prompt-file", "/nonexistent/prompt.txt"], {}, 2, "prompt file not found"),
    (["prefill", "--prompt", "   "], {}, 2, "prompt is empty"),
    (["prefill", "--model", "/nonexistent/model.gguf"], {}, 2, "not found"),
    (["prefill", "--model", "/tmp"], {}, 2, "directory"),
    (["prefill"], {"LUCE_MMVQ_MAX_NCOLS": "four"}, 2, "LUCE_MMVQ_MAX_NCOLS"),
    (["nonsense-command"], {}, 2, "No such command"),
    (["prefill", "--threads", "0"], {}, 2, "--threads"),
    (["prefill", "--chunk", "9"], {}, 2, "--chunk"),
    (["prefill", "--compare-q1"], {}, 2, "--compare-q1"),
    (["prefill", "--prompt-file", "/tmp"], {}, 2, "is a directory"),
    (["prefill", "--resume-at", "100000"], {}, 2, "--resume-at"),
    (["prefill"], {"DFLASH_LLAMA_LIB_DIR": "/tmp"}, 2, "has no libllama.so"),
    (["prefill", "--lib", "stock"], {"DFLASH_LLAMA_LIB_DIR": "/tmp"}, 2, "--lib stock"),
    (["prefill"], {"DFLASH_LLAMA_VERBOSE": "loud"}, 2, "DFLASH_LLAMA_VERBOSE"),
    (["bench", "--evidence", "/proc/no/such/ev"], {}, 1, "cannot create evidence directory"),
    (["matrix", "--chunk", "9"], {}, 2, "--chunk"),
    (["kernels", "selftest", "--device", "cpu"], {}, 2, "one HIP device"),
])
def test_errors_are_one_line(args, env, code, needle):
    assert_one_line_error(run_dflash(*args, env=env), code, needle)


@pytest.mark.parametrize("kind,needle", [("empty", "empty"), ("truncated", "truncated"),
                                         ("garbage", "not a GGUF")])
def test_bad_model_files_are_one_line_errors(tmp_path, tiny_models, kind, needle):
    good = tiny_models["q8_0"].read_bytes()
    data = {"empty": b"", "truncated": good[: len(good) * 2 // 3], "garbage": b"\x00garbage" * 1000}[kind]
    p = tmp_path / f"{kind}.gguf"
    p.write_bytes(data)
    assert_one_line_error(run_dflash("prefill", "--model", p), 1, needle)


def test_prompt_longer_than_context(tiny_models):
    r = run_dflash("prefill", "--model", tiny_models["q4_0"], "--prompt", "x" * 5000, "--ctx", 512)
    assert_one_line_error(r, 2, "does not fit", "--ctx 512")
    r = run_dflash("prefill", "--model", tiny_models["q4_0"], "--prompt", "x " * 50000)  # 20,000 tokens > 16384
    assert_one_line_error(r, 2, "context length 16384")


def test_debug_shows_traceback():
    r = run_dflash("--debug", "prefill", "--model", "/nonexistent/model.gguf")
    assert r.returncode != 0 and "Traceback" in r.stderr


def test_cli_py_matches_console_script():
    import subprocess
    import sys

    from .conftest import ROOT
    r = subprocess.run([sys.executable, "cli.py", "plan", "--n-tokens", "3", "--json"], cwd=ROOT,
                       capture_output=True, text=True)
    assert r.returncode == 0 and json.loads(r.stdout)["widths"] == [1, 1, 1]


def test_prompt_file_not_utf8(tmp_path):
    p = tmp_path / "latin1.txt"
    p.write_bytes("caf\xe9 ".encode("latin-1") * 10)
    assert_one_line_error(run_dflash("prefill", "--prompt-file", p), 2, "cannot read prompt file")


def test_model_without_vocabulary(tmp_path):
    import gguf
    import numpy as np
    p = tmp_path / "novocab.gguf"
    w = gguf.GGUFWriter(str(p), "llama")
    w.add_tokenizer_model("none")
    w.add_tensor("x", np.zeros((4, 32), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    assert_one_line_error(run_dflash("prefill", "--model", p), 1, "no vocabulary")


def test_help_names_every_environment_flag_and_the_flags_they_stand_for():
    from dflash.core import settings
    assert set(settings.ENV_DOCS) == {*settings.ENV_FLAGS, settings.ENV_DEBUG, settings.ENV_CCACHE, settings.ENV_STALL}
    top = run_dflash("--help", check=True).stdout
    for name in settings.ENV_DOCS:
        assert f"  {name} " in top, name
    sub = " ".join(run_dflash("prefill", "--help", check=True).stdout.split())  # unfolded
    for flag, env in (("--bands / --no-bands", settings.ENV_BANDS), ("--cpu", settings.ENV_CPU),
                      ("--indexer-tile", settings.ENV_TILE)):
        assert flag in sub and f"env: {env}]" in sub, (flag, env)
