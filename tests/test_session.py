"""dflash as a library: the Session facade, the README's example, typed errors, the worker.

In-process sessions here run the exact library with bands on (the flags other in-process tests
load it with: one process loads one library and flag set); other libraries run in a Worker."""
import json
import math
import os
import re
import signal
import subprocess
import sys

import numpy as np
import pytest

import dflash
from dflash.core import settings
from dflash.core.errors import LibraryNotBuilt, LlamaError, NotExactError, UsageError
from dflash.native import build
from dflash.run import engine, prefill
from dflash.run.bands import from_widths
from dflash.session import Session

from .conftest import CLEAN_ENV, ROOT, TEST_THREADS, run_dflash, run_json


@pytest.fixture(scope="module")
def model(tiny_models):
    return str(tiny_models["mxfp4"])


@pytest.fixture(scope="module")
def session(model):
    with Session(model, bands=True, chunk=4, threads=TEST_THREADS) as s:
        yield s


def _readme_example() -> str:
    text = (ROOT / "README.md").read_text()
    section = text.split("## Python API", 1)[1]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


def test_readme_python_example_runs_as_written():
    env = {k: v for k, v in os.environ.items() if k not in CLEAN_ENV}
    r = subprocess.run([sys.executable, "-c", _readme_example()], capture_output=True, text=True, cwd=ROOT,
                       env=env, timeout=600)
    assert r.returncode == 0, r.stderr
    lines = dict(line.split(None, 1) for line in r.stdout.splitlines())
    assert re.fullmatch(r"\[(\d+, )*4\]", lines["widths"])  # bands up to 4
    for key in ("logits", "response"):
        ours, q1 = re.fullmatch(r"([0-9a-f]{64}) q1 ([0-9a-f]{64})", lines[key]).groups()
        assert ours == q1


def test_public_names_are_exported():
    for name in dflash.__all__:
        assert getattr(dflash, name) is not None
    assert dflash.Session is Session and dflash.Settings is settings.Settings
    with pytest.raises(AttributeError):
        dflash.no_such_name  # noqa: B018


def test_prefill_equals_the_cli_bit_for_bit(session, model):
    r = session.prefill(n_predict=8, compare_q1=True)
    assert r.comparison is not None and r.comparison.identical and max(r.widths) == 4
    r.check_exact()
    cli = run_json("prefill", "--model", model, "--bands", "--chunk", "4", "--n-predict", "8",
                   "--threads", TEST_THREADS, "--compare-q1")
    assert set(cli) == set(r.to_json())
    for key in ("logits_sha256", "response_sha256", "response_tokens", "widths", "prompt_sha256"):
        assert cli[key] == r.to_json()[key], key
    ids = session.tokenize(engine.DEFAULT_PROMPT)
    assert session.prefill(ids, n_predict=8).logits_sha256 == r.logits_sha256  # token ids or text alike


def test_generate_streams_the_prefill_response(session):
    expected = session.prefill("A short prompt for streaming.", n_predict=6, logits="last")
    tokens = list(session.generate("A short prompt for streaming.", max_tokens=6))
    assert [t.id for t in tokens] == list(expected.response_tokens) and len(tokens) == 6
    assert "".join(t.text for t in tokens) == expected.response_text
    assert all(math.isfinite(t.logprob) and t.logprob <= 0 for t in tokens)
    assert b"".join(t.piece for t in tokens) == expected.response_text.encode()


def test_qualify_bench_and_memory_methods(session, model, tmp_path):
    q = session.qualify([2, 4], n_predict=4, evidence_dir=tmp_path / "qualify")
    assert q.report.all_exact and [x.width for x in q.report.results] == [1, 2, 4]
    assert (tmp_path / "qualify" / "qualification.json").is_file()
    b = session.bench(warmup=0, runs=1, n_predict=2, evidence_dir=tmp_path / "bench")
    assert b.summary.hashes_identical and b.summary.speedup > 0
    assert run_dflash("verify", tmp_path / "bench").returncode == 0
    measured = session.memory([1, 4], ctx=512)
    assert measured.measured and [x.width for x in measured.rows] == [1, 4]
    with Session(model, bands=True, chunk=4, threads=TEST_THREADS, no_alloc=True) as est:
        estimate = est.memory([1, 4], ctx=512)
        with pytest.raises(UsageError, match="no weights"):
            est.prefill()
    assert not estimate.measured
    # caches and compute are sized alike; weights differ by mapping (this session maps the file)
    assert [x.context_bytes for x in estimate.rows] == [x.context_bytes for x in measured.rows]


def test_errors_name_arguments_and_the_cli_names_flags(model):
    with pytest.raises(UsageError) as e:
        Session(model, chunk=9)
    assert str(e.value).startswith("chunk 9: no qualification record") and "--chunk" not in str(e.value)
    assert e.value.render().startswith("--chunk 9: no qualification record")
    with pytest.raises(UsageError, match=r"^threads 0 is outside"):
        Session(model, bands=True, chunk=4, threads=0)
    r = run_dflash("prefill", "--model", model, "--chunk", "9")
    assert r.returncode == 2 and "--chunk 9: no qualification record" in r.stderr


def test_a_library_that_is_not_built_is_a_typed_error_not_a_build(model, monkeypatch):
    monkeypatch.setattr(build, "is_built", lambda flavor, gpu="none", cpu="native": False)
    called = []
    monkeypatch.setattr(build, "build_library", lambda *a, **k: called.append(a))
    with pytest.raises(LibraryNotBuilt, match=r"`dflash build --lib exact`") as e:
        Session(model, bands=True, chunk=4)
    assert e.value.exit_code == 1 and not called  # nothing was built behind the caller's back


def test_the_session_frees_model_and_context_after_an_exception(model):
    with pytest.raises(RuntimeError, match="planted"):
        with Session(model, bands=True, chunk=4, threads=TEST_THREADS) as s:
            s.prefill("free me", n_predict=1)
            held_model, held_context = s.engine.model, s._context
            assert held_model.ptr and held_context is not None and held_context.ptr
            raise RuntimeError("planted")
    assert held_model.ptr is None and held_context.ptr is None
    with pytest.raises(UsageError, match="closed"):
        s.prefill()


class _NanContext:
    """A context whose logits hold a NaN at one position (a planted broken library)."""
    n_vocab, n_ctx = 8, 64

    def __init__(self, bad_position, value=np.nan):
        self.bad, self.value = bad_position, value

    def clear(self):
        pass

    def decode(self, tokens, pos, logits="all"):
        out = np.zeros((len(tokens), self.n_vocab), dtype=np.float32)
        if pos <= self.bad < pos + len(tokens):
            out[self.bad - pos, 3] = self.value
        return out if logits == "all" else (out[-1:] if logits == "last" else None)


@pytest.mark.parametrize("value, kind", [(np.nan, "NaN"), (np.inf, "an infinity"), (-np.inf, "an infinity")])
def test_non_finite_logits_fail_naming_the_first_position_and_library(value, kind):
    req = prefill.Request(list(range(12)), from_widths([4, 4, 4]), n_predict=0)
    with pytest.raises(LlamaError, match=rf"position 6 hold {kind}: the llama.cpp library /planted/lib"):
        prefill.prefill(_NanContext(6, value), req, library="/planted/lib")
    prefill.prefill(_NanContext(99), req, library="/planted/lib")  # all finite: no error


def test_compare_q1_that_differs_exits_4_and_check_exact_raises(model):
    r = run_dflash("prefill", "--model", model, "--lib", "stock", "--bands", "--chunk", "4", "--compare-q1",
                   "--threads", TEST_THREADS, "--json")
    assert r.returncode == 4, r.stderr
    assert "differ from q1" in r.stderr and json.loads(r.stdout)["identical_to_q1"] is False
    result = dflash.PrefillResult.from_json(r.stdout)
    with pytest.raises(NotExactError):
        result.check_exact()


def test_worker_runs_another_library_and_returns_typed_results_and_errors(model, session):
    with dflash.Worker(lib="stock", model=model, threads=TEST_THREADS, bands=True, chunk=4) as w:
        stock = w.prefill(n_predict=8, compare_q1=True)
        assert stock.library.flavor == "stock" and stock.comparison is not None
        assert not stock.comparison.identical  # the stock twin differs from its own q1
        ours = session.prefill(n_predict=8)
        assert stock.comparison.q1.logits_sha256 != ours.logits_sha256 or stock.logits_sha256 != ours.logits_sha256
        with pytest.raises(UsageError) as e:  # an error in the child is the same type and text here
            w.prefill(n_predict=-1)
        assert e.value.render().startswith("--n-predict -1")
        assert w.tokenize("abc") == session.tokenize("abc")
    with pytest.raises(UsageError) as e:
        dflash.Worker(model=model, chunk=9)
    assert e.value.render().startswith("--chunk 9")


def test_a_worker_that_dies_is_a_llama_error_naming_the_signal(model):
    w = dflash.Worker(model=model, threads=TEST_THREADS, bands=True, chunk=4)
    try:
        w._child.proc.send_signal(signal.SIGKILL)
        w._child.proc.wait()
        with pytest.raises(LlamaError, match="killed by SIGKILL"):
            w.prefill()
    finally:
        w.close()
