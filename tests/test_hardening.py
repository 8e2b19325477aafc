"""Hostile input and native crashes: one line, the documented exit code, nothing half-written.

The crash tests are real: a worker process running llama.cpp is sent SIGSEGV, SIGABRT or
SIGSTOP (a hang) in the middle of a band, or llama.cpp itself divides by zero on a model
dflash's checks would have refused. Each first waits, through the worker's state file, until
the worker is inside a band, so the reported stage is known.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dflash.core.stage import ENV_WORKER
from dflash.model import tiny_model
from dflash.run.supervisor import ENV_STALL

from .conftest import CLEAN_ENV, ROOT, run_dflash

LONG_PROMPT = " ".join(f"word{i % 97}" for i in range(2600))  # ~3000 tokens: seconds of q1 at 1 thread


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in CLEAN_ENV}
    env.update(extra)
    return env


def _one_line(stderr: str) -> str:
    lines = [ln for ln in stderr.splitlines() if ln.strip()]
    assert len(lines) == 1, f"expected one line on stderr, got {lines!r}"
    return lines[0]


def _worker_of(pid: int, timeout: float = 60.0) -> tuple[int, Path]:
    """The supervised worker of the dflash process `pid`, and its state file."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
            for child in children:
                environ = Path(f"/proc/{child}/environ").read_bytes().split(b"\0")
                for item in environ:
                    if item.startswith(ENV_WORKER.encode() + b"="):
                        return int(child), Path(item.split(b"=", 1)[1].decode().split(",", 2)[2])
        except (FileNotFoundError, ProcessLookupError):
            pass
        time.sleep(0.02)
    raise AssertionError("no supervised worker appeared")


def _stage(state: Path) -> str:
    try:
        return state.read_bytes()[:1024].split(b"\0", 1)[0].decode()
    except FileNotFoundError:
        return ""


def _start_and_wait_for_band(args: list[str], env: dict[str, str] | None = None):
    proc = subprocess.Popen([sys.executable, "-m", "dflash", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, cwd=ROOT, env=env or _env())
    worker, state = _worker_of(proc.pid)
    deadline = time.monotonic() + 120
    while "band at position" not in _stage(state):
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline, f"no band started (stage {_stage(state)!r})"
        time.sleep(0.01)
    return proc, worker


def _no_temp_left(folder: Path) -> None:
    assert [p.name for p in folder.iterdir() if p.name.startswith(".tmp")] == []


@pytest.mark.parametrize("sig", [signal.SIGSEGV, signal.SIGABRT])
def test_worker_crash_mid_band_is_one_line_and_leaves_nothing(tmp_path, sig):
    ev = tmp_path / "ev"
    proc, worker = _start_and_wait_for_band(["bench", "--threads", "1", "--runs", "1", "--warmup", "0",
                                             "--prompt", LONG_PROMPT, "--evidence", str(ev), "--json"])
    os.kill(worker, sig)
    out, err = proc.communicate(timeout=60)
    line = _one_line(err)
    assert proc.returncode == 1
    assert signal.Signals(sig).name in line and "band at position" in line, line
    assert out == ""  # --json: valid JSON or nothing
    assert not ev.exists()
    _no_temp_left(tmp_path)


def test_hung_worker_is_stopped_after_the_stall_timeout(tmp_path):
    proc, worker = _start_and_wait_for_band(["prefill", "--threads", "1", "--prompt", LONG_PROMPT, "--json"],
                                            _env(**{ENV_STALL: "1"}))
    os.kill(worker, signal.SIGSTOP)  # a worker that makes no progress, as a hang inside llama.cpp
    out, err = proc.communicate(timeout=60)
    line = _one_line(err)
    assert proc.returncode == 1 and out == ""
    assert "no progress for 1 s" in line and "band at position" in line, line


def test_sigterm_stops_like_ctrl_c_and_removes_temp_evidence(tmp_path):
    ev = tmp_path / "ev"
    proc, _ = _start_and_wait_for_band(["bench", "--threads", "1", "--runs", "1", "--warmup", "0",
                                        "--prompt", LONG_PROMPT, "--evidence", str(ev)])
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err
    assert "interrupted" in _one_line(err)
    assert not ev.exists()
    _no_temp_left(tmp_path)


def _model_with_ratios(path: Path, ratios: tuple[int, ...]) -> Path:
    cfg = tiny_model.TinyConfig(weights="f32")
    object.__setattr__(cfg, "ratios", ratios)  # past the writer's own check, as a hostile file would be
    return tiny_model.write(path, cfg)


def test_model_without_a_ratio_4_layer_is_refused_before_llama_cpp(tmp_path):
    model = _model_with_ratios(tmp_path / "r0_128.gguf", (0, 128))
    r = run_dflash("prefill", "--model", model, "--threads", "1", "--json")
    assert r.returncode == 1 and r.stdout == ""
    assert "no layer has compress ratio 4" in _one_line(r.stderr)
    r = run_dflash("prefill", "--model", _model_with_ratios(tmp_path / "r8.gguf", (4, 8)), "--threads", "1")
    assert r.returncode == 1 and "not supported" in _one_line(r.stderr)


def test_a_real_llama_cpp_crash_is_reported_with_signal_and_stage(tmp_path):
    """The same model with dflash's ratio check switched off: llama.cpp itself dies (SIGFPE) and
    the supervisor names the signal and the stage."""
    model = _model_with_ratios(tmp_path / "r0_128.gguf", (0, 128))
    child = ("import sys; from dflash.model import gguf_meta; from dflash.core import stage; "
             "from dflash.__main__ import run_cli; "
             "gguf_meta._check_ds4_ratios = lambda *a: None; stage.become_worker(); "
             f"run_cli(['prefill', '--model', {str(model)!r}, '--threads', '1', '--json'])")
    parent = ("import sys; from dflash.run import supervisor; "
              f"sys.exit(supervisor.supervise([sys.executable, '-c', {child!r}]))")
    r = subprocess.run([sys.executable, "-c", parent], capture_output=True, text=True, cwd=ROOT, env=_env(),
                       timeout=300)
    line = _one_line(r.stderr)
    assert r.returncode == 1 and r.stdout == ""
    assert "SIGFPE" in line and "context creation" in line, line


@pytest.mark.parametrize("threads", ["100000", "99999999999999999999", "0"])
def test_thread_counts_llama_cpp_cannot_take_are_usage_errors(threads):
    r = run_dflash("prefill", "--threads", threads, "--json")
    assert r.returncode == 2 and r.stdout == ""
    assert "--threads" in _one_line(r.stderr)


@pytest.mark.parametrize("ctx, why", [(str(2**32), "1<=x<=4294967295"), (str(2**32 + 400), "1<=x<=4294967295"),
                                      ("16385", "exceeds the model's context length 16384")])
def test_ctx_is_checked_against_the_c_type_and_the_model(ctx, why):
    r = run_dflash("prefill", "--ctx", ctx, "--threads", "1", "--json")
    assert r.returncode == 2 and r.stdout == "" and why in _one_line(r.stderr)


def test_model_sha_names_the_bytes_and_ctx_in_range_runs():
    r = run_dflash("prefill", "--ctx", "4096", "--threads", "1", "--json", check=True)
    assert json.loads(r.stdout)["n_ctx"] == 4096


@pytest.mark.parametrize("args", [["prefill", "--model", ""], ["prefill", "--prompt-file", " "],
                                  ["bench", "--evidence", ""], ["tiny-model", "--out", ""],
                                  ["qualify", "--evidence", ""], ["sweep", "--plot", ""],
                                  ["matrix", "--model", ""], ["plan", "--n-tokens", "8", "--ratios", ""]])
def test_empty_values_are_usage_errors(args):
    r = run_dflash(*args)
    assert r.returncode == 2
    assert "is empty" in _one_line(r.stderr)


def test_markup_in_paths_is_printed_as_given(tmp_path):
    ev = tmp_path / "[/red]" / "ev"
    r = run_dflash("bench", "--threads", "1", "--runs", "1", "--warmup", "0", "--n-predict", "0",
                   "--evidence", ev)
    assert r.returncode == 0, r.stderr
    assert f"evidence {ev}" in r.stdout
    out = tmp_path / "d[v2]" / "m.gguf"
    out.parent.mkdir()
    r = run_dflash("tiny-model", "--weights", "f32", "--out", out)
    assert r.returncode == 0 and str(out) in r.stdout


@pytest.mark.parametrize("command", [["plan", "--n-tokens", "8"], ["prefill", "--threads", "1"],
                                     ["bench", "--threads", "1", "--runs", "1", "--warmup", "0"]])
def test_one_boolean_parser_for_every_command(command):
    r = run_dflash(*command, env={"DFLASH_DS4_EXACT_PREFILL_BANDS": "maybe"})
    assert r.returncode == 2
    assert "DFLASH_DS4_EXACT_PREFILL_BANDS='maybe' is not a boolean" in _one_line(r.stderr)
    r = run_dflash(*command, env={"DFLASH_DEBUG": "maybe"})
    assert r.returncode == 2 and "DFLASH_DEBUG='maybe' is not a boolean" in _one_line(r.stderr)


def test_debug_keeps_the_documented_exit_codes():
    r = run_dflash("--debug", "prefill", "--ctx", "17000", "--threads", "1")
    assert r.returncode == 2
    assert "Traceback" in r.stderr and r.stderr.rstrip().splitlines()[-1].startswith("dflash: usage error:")
    r = run_dflash("prefill", "--ctx", "17000", env={"DFLASH_DEBUG": "1"})
    assert r.returncode == 2


def test_prompt_file_dash_reads_standard_input():
    text = "A prompt that arrives on standard input, long enough to tokenize."
    r = subprocess.run([sys.executable, "-m", "dflash", "prefill", "--prompt-file", "-", "--threads", "1",
                        "--n-predict", "0", "--json"], input=text, capture_output=True, text=True, cwd=ROOT,
                       env=_env(), timeout=300)
    assert r.returncode == 0, r.stderr
    given = run_dflash("prefill", "--prompt", text, "--threads", "1", "--n-predict", "0", "--json", check=True)
    assert json.loads(r.stdout)["prompt_sha256"] == json.loads(given.stdout)["prompt_sha256"]


def test_load_failure_names_llama_cpp_s_reason(tmp_path):
    import gguf
    import numpy as np
    path = tmp_path / "ds5.gguf"
    w = gguf.GGUFWriter(str(path), "deepseek5")
    w.add_key_value("tokenizer.ggml.model", "llama", gguf.GGUFValueType.STRING)
    w.add_array("tokenizer.ggml.tokens", ["a", "b", "c"])
    w.add_array("tokenizer.ggml.scores", [0.0, 0.0, 0.0])
    w.add_array("tokenizer.ggml.token_type", [1, 1, 1])
    w.add_tensor("x", np.zeros(4, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    r = run_dflash("prefill", "--model", path, "--threads", "1")
    assert r.returncode == 1
    assert "unknown model architecture: 'deepseek5'" in _one_line(r.stderr)


def test_model_paths_that_are_not_files_are_named(tmp_path):
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    loop = tmp_path / "loop"
    loop.symlink_to(loop)
    for path, what in ((fifo, "is a FIFO"), (Path("/dev/zero"), "is a character device"),
                       (loop, "is a symlink loop"), (tmp_path / "missing.gguf", "not found")):
        r = run_dflash("prefill", "--model", path)
        assert r.returncode == 2 and what in _one_line(r.stderr), (path, r.stderr)
    r = run_dflash("matrix", "--model", tmp_path / "missing.gguf")
    assert r.returncode == 2 and "not found" in _one_line(r.stderr)


def test_seed_out_of_range_is_a_usage_error():
    r = run_dflash("tiny-model", "--seed", "-1")
    assert r.returncode == 2 and "--seed" in _one_line(r.stderr)


def test_an_unwritable_cache_names_the_path(tmp_path):
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("a file where the cache folder should be")
    r = run_dflash("tiny-model", "--weights", "f32", env={"XDG_CACHE_HOME": str(blocker)})
    assert r.returncode == 1
    line = _one_line(r.stderr)
    assert "internal error" not in line and str(blocker) in line, line


def test_sigkill_of_dflash_stops_its_worker_and_removes_temp_evidence(tmp_path):
    """The worker learns of its supervisor's death (PR_SET_PDEATHSIG: SIGTERM) and cleans up."""
    ev = tmp_path / "ev"
    proc, worker = _start_and_wait_for_band(["bench", "--threads", "1", "--runs", "1", "--warmup", "0",
                                             "--prompt", LONG_PROMPT, "--evidence", str(ev)])
    assert [p for p in tmp_path.iterdir() if p.name.startswith(".tmp-ev-")]  # the run is writing
    proc.kill()
    proc.communicate(timeout=60)
    deadline = time.monotonic() + 30
    while Path(f"/proc/{worker}").exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not Path(f"/proc/{worker}").exists(), "the worker outlived dflash"
    assert not ev.exists()
    _no_temp_left(tmp_path)
