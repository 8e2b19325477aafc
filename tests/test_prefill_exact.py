"""End to end on the tiny DeepSeek-V4 model: exact bands equal q1 bit for bit, and the stock build
is shown to differ (so these comparisons can fail)."""
import numpy as np
import pytest

from dflash.core import settings
from dflash.model import tiny_model
from dflash.run import engine, prefill

from .conftest import TEST_THREADS, run_dflash, run_json

N_PREDICT = 8


class ExactEngines(dict):
    """weights -> an exact-library engine in this process, opened on first use."""

    def __init__(self, models):
        super().__init__()
        self.models = models

    def __missing__(self, weights):
        s = settings.resolve({}, bands=True, chunk=4, lib="exact")
        self[weights] = engine.open_engine(s, str(self.models[weights]), threads=TEST_THREADS)
        return self[weights]


@pytest.fixture(scope="module")
def exact_engines(tiny_models):
    return ExactEngines(tiny_models)


def run(eng, tokens, cap, bands_on=True, resume_at=0, ctx=None):
    bands = eng.request_bands(len(tokens), resume_at, cap=cap, bands_on=bands_on)
    c = ctx or eng.context(len(tokens) + N_PREDICT, max(b.width for b in bands))
    return prefill.run(c, prefill.Request(tokens, bands, N_PREDICT, keep_logits=True))


def assert_bit_identical(a: prefill.RequestOutput, b: prefill.RequestOutput):
    rows = np.all(a.logits.view(np.uint32) == b.logits.view(np.uint32), axis=1)
    assert rows.all(), f"first differing position {int(np.argmin(rows))}"
    assert a.logits_sha256 == b.logits_sha256
    assert a.response_tokens == b.response_tokens and a.response_sha256 == b.response_sha256


@pytest.mark.parametrize("weights", tiny_model.WEIGHTS)
def test_bands_equal_q1_on_exact_build(exact_engines, weights):
    eng = exact_engines[weights]
    tokens = eng.tokenize(engine.DEFAULT_PROMPT)
    assert len(tokens) > 256  # crosses ratio-4, ratio-128 and the 64-token window
    q1 = run(eng, tokens, 1, bands_on=False)
    assert q1.widths == [1] * len(tokens) and len(q1.response_tokens) == N_PREDICT
    for cap in (2, 3, 4):
        r = run(eng, tokens, cap)
        assert max(r.widths) == cap and len(r.widths) < len(tokens)
        assert_bit_identical(q1, r)
    resumed = run(eng, tokens, 4, resume_at=131)  # 131 is unaligned for ratios 4 and 128
    first_after = next(b for b in eng.request_bands(len(tokens), 131) if b.start == 131)
    assert first_after.reason == "start" and first_after.width == 1
    assert_bit_identical(q1, resumed)


def test_repeated_requests_on_one_context_are_cache_cold(exact_engines):
    eng = exact_engines["q8_0"]
    tokens = eng.tokenize(engine.DEFAULT_PROMPT)[:150]
    c = eng.context(len(tokens) + N_PREDICT, 4)
    first = run(eng, tokens, 4, ctx=c)
    assert_bit_identical(first, run(eng, tokens, 4, ctx=c))
    assert_bit_identical(first, run(eng, tokens, 1, bands_on=False, ctx=c))


def test_different_input_changes_the_hashes(exact_engines):
    """The fingerprints see the model's output: a changed token changes logits and response."""
    eng = exact_engines["f16"]
    tokens = eng.tokenize(engine.DEFAULT_PROMPT)[:100]
    a = run(eng, tokens, 4)
    b = run(eng, tokens[:-1] + [(tokens[-1] + 1) % eng.model.n_vocab], 4)
    assert a.logits_sha256 != b.logits_sha256


@pytest.mark.parametrize("weights", tiny_model.WEIGHTS)
def test_stock_build_differs_from_q1(tiny_models, weights):
    """llamafile sgemm serves widths >= 2 on the stock build: the same check must fail there."""
    r = run_dflash("prefill", "--model", tiny_models[weights], "--lib", "stock", "--bands", "--chunk", "4",
                   "--n-predict", N_PREDICT, "--compare-q1", "--json", "--threads", TEST_THREADS)
    assert r.returncode == 4, r.stderr
    import json
    d = json.loads(r.stdout)
    assert d["identical_to_q1"] is False and d["q1"]["logits_sha256"] != d["logits_sha256"]
    assert "differ from q1" in r.stderr


def test_cli_bands_on_and_off_agree(tiny_models):
    on = run_json("prefill", "--model", tiny_models["mxfp4"], "--n-predict", N_PREDICT,
                  env={"DFLASH_DS4_EXACT_PREFILL_BANDS": "1"})
    off = run_json("prefill", "--model", tiny_models["mxfp4"], "--n-predict", N_PREDICT)
    assert max(on["widths"]) == 4 and set(off["widths"]) == {1}
    assert on["n_prompt_tokens"] == off["n_prompt_tokens"] == len(off["widths"])
    for k in ("logits_sha256", "response_sha256", "response_tokens"):
        assert on[k] == off[k]
    assert on["library"]["flavor"] == "exact" and on["prefill_tokens_per_second"] > 0


def test_resume_on_the_same_context(exact_engines):
    """A first request prefills [0, P) (no response), a second continues from P without clearing:
    every logits row from P on and the response equal the q1 run of the whole prompt."""
    eng = exact_engines["mxfp4"]
    tokens = eng.tokenize(engine.DEFAULT_PROMPT)
    q1 = run(eng, tokens, 1, bands_on=False)
    for p in (131, 200):  # unaligned, and aligned to ratio 4
        c = eng.context(len(tokens) + N_PREDICT, 4)
        prefill.run(c, prefill.Request(tokens[:p], eng.plan(p, 0), n_predict=0))
        second = prefill.run(c, prefill.Request(tokens, eng.plan(len(tokens) - p, p), N_PREDICT,
                                                keep_logits=True, start=p))
        assert second.n_prompt_tokens == len(tokens) - p and second.widths[0] == (1 if p == 131 else 4)
        assert np.array_equal(second.logits[p:].view(np.uint32), q1.logits[p:].view(np.uint32))
        assert second.response_tokens == q1.response_tokens
    # resuming on a context that was cleared is caught by the comparison: the state matters
    c.clear()
    lost = prefill.run(c, prefill.Request(tokens, eng.plan(len(tokens) - 200, 200), N_PREDICT,
                                          keep_logits=True, start=200))
    assert not np.array_equal(lost.logits[200:].view(np.uint32), q1.logits[200:].view(np.uint32))
