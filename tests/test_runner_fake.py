"""prefill.run against a fake context (no llama.cpp): which logits it asks for, how it hashes them,
resume, the greedy decode's stops, and that a planted batch variance is caught.

The fake's logits row for a position is a pure function of (token, position), so every band
schedule must give the same rows, the same hashes and the same response. Its greedy choice after
token t is (t + 1) % N_VOCAB, so responses can be predicted independently."""
import hashlib
from collections import Counter

import numpy as np
import pytest

from dflash.core.errors import LlamaError
from dflash.run import prefill
from dflash.run.bands import NARROW, Band, from_widths, plan

N_VOCAB = 16
TOKENS = [(7 * i + 3) % N_VOCAB for i in range(37)]  # 37 tokens: crosses ratio 4 and 8 boundaries
RATIOS = (4, 8)


def row(token: int, pos: int, width: int = 1, variance: float = 0.0) -> np.ndarray:
    """The fake model's logits at `pos` after `token`: noise, a spike at (token + 1) % N_VOCAB and,
    with `variance`, a term that depends on the band width (a batch-variant kernel)."""
    r = np.random.default_rng([token, pos]).standard_normal(N_VOCAB).astype(np.float32)
    r[(token + 1) % N_VOCAB] += np.float32(100.0)
    if variance:
        r += np.float32(variance * (width - 1))
    return r


def rows(tokens, start=0) -> list[np.ndarray]:
    return [row(t, p) for p, t in enumerate(tokens) if p >= start]


def sha_rows(rs, dtype="<f4") -> str:
    """The documented logits fingerprint, computed without prefill.py."""
    h = hashlib.sha256()
    for r in rs:
        h.update(np.asarray(r, dtype=np.float32).astype(dtype).tobytes())
    return h.hexdigest()


class FakeModel:
    def __init__(self, eog=()):
        self.eog = set(eog)

    def is_eog(self, token: int) -> bool:
        return token in self.eog

    def detokenize(self, tokens) -> bytes:
        return b"".join(f"<{t}>".encode() for t in tokens)


class FakeContext:
    """What prefill.run uses of llama.Context. It keeps a fake KV cache (position -> token) and
    refuses a decode whose earlier positions are not in it, like a model that needs its history."""

    def __init__(self, n_ctx=64, max_band=8, eog=(), variance=0.0):
        self.n_vocab, self.n_ctx, self.max_band = N_VOCAB, n_ctx, max_band
        self.model = FakeModel(eog)
        self.variance = variance
        self.kv: dict[int, int] = {}
        self.calls: list[tuple[list[int], int, str]] = []
        self.clears = 0

    def clear(self) -> None:
        self.clears += 1
        self.kv.clear()

    def decode(self, tokens, pos: int, logits: str = "all"):
        tokens = list(tokens)
        w = len(tokens)
        if not 1 <= w <= self.max_band:  # as llama.Context.decode refuses them
            raise LlamaError(f"band width {w} outside 1..{self.max_band}")
        if pos + w > self.n_ctx:
            raise LlamaError(f"positions {pos}..{pos + w - 1} exceed the context of {self.n_ctx}")
        missing = [p for p in range(pos) if p not in self.kv]
        assert not missing, f"decode at {pos} without positions {missing[:3]}... in the cache"
        self.calls.append((tokens, pos, logits))
        for i, t in enumerate(tokens):
            self.kv[pos + i] = t
        out = np.stack([row(t, pos + i, w, self.variance) for i, t in enumerate(tokens)])
        if logits == "all":
            return out
        if logits == "last":
            return out[-1:].copy()
        if logits == "none":
            return None
        raise ValueError(f"unknown logits mode {logits!r}")


def q1(n, start=0):
    return plan(n, start, RATIOS, cap=4, bands_on=False)


def banded(n, start=0, cap=4):
    return plan(n, start, RATIOS, cap=cap, bands_on=True)


def irregular(n, start=0):
    ws, left, cycle = [], n, [3, 1, 5, 2, 8, 4]
    while left:
        ws.append(min(cycle[len(ws) % len(cycle)], left))
        left -= ws[-1]
    return from_widths(ws, start)


def prefill_calls(ctx, n):
    """The calls of the prompt part (positions < n)."""
    return [c for c in ctx.calls if c[1] < n]


SCHEDULES = {"q1": q1, "bands": banded, "irregular": irregular}


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_every_position_asked_once_with_all(schedule):
    ctx = FakeContext()
    n = len(TOKENS)
    bands = SCHEDULES[schedule](n)
    res = prefill.run(ctx, prefill.Request(TOKENS, bands, n_predict=0, keep_logits=True))
    calls = prefill_calls(ctx, n)
    assert len(calls) == len(bands) and all(mode == "all" for _, _, mode in calls)
    assert [(pos, len(toks)) for toks, pos, _ in calls] == [(b.start, b.width) for b in bands]
    seen = Counter(pos + i for toks, pos, _ in calls for i in range(len(toks)))
    assert seen == Counter(range(n))  # every position exactly once
    for toks, pos, _ in calls:
        assert toks == TOKENS[pos:pos + len(toks)]
    assert ctx.clears == 1
    assert res.widths == [b.width for b in bands] and res.n_prompt_tokens == n
    assert np.array_equal(res.logits, np.stack(rows(TOKENS)))


def test_logits_hash_is_le_float32_rows_in_position_order():
    ctx = FakeContext()
    res = prefill.run(ctx, prefill.Request(TOKENS, banded(len(TOKENS)), n_predict=0))
    expected = sha_rows(rows(TOKENS))
    assert res.logits_sha256 == expected
    # the independent hash tells order and byte order apart: a wrong fingerprint would be caught
    assert sha_rows(rows(TOKENS)[::-1]) != expected
    assert sha_rows(rows(TOKENS), dtype=">f4") != expected
    assert res.prompt_sha256 == hashlib.sha256(np.asarray(TOKENS, dtype="<i4").tobytes()).hexdigest()


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_logits_last_asks_only_the_last_band(schedule):
    ctx = FakeContext()
    n = len(TOKENS)
    bands = SCHEDULES[schedule](n)
    res = prefill.run(ctx, prefill.Request(TOKENS, bands, n_predict=0, logits="last"))
    modes = [mode for _, _, mode in prefill_calls(ctx, n)]
    assert modes == ["none"] * (len(bands) - 1) + ["last"]
    assert res.logits_sha256 == sha_rows([row(TOKENS[-1], n - 1)])
    assert res.logits_sha256 != sha_rows(rows(TOKENS))  # not the all-positions hash


def test_logits_last_response_equals_all():
    n = len(TOKENS)
    a = prefill.run(FakeContext(), prefill.Request(TOKENS, banded(n), n_predict=5))
    b = prefill.run(FakeContext(), prefill.Request(TOKENS, q1(n), n_predict=5, logits="last"))
    assert a.response_tokens == b.response_tokens and a.response_sha256 == b.response_sha256


def test_schedules_give_identical_fingerprints():
    n = len(TOKENS)
    results = {name: prefill.run(FakeContext(), prefill.Request(TOKENS, f(n), n_predict=6, keep_logits=True))
               for name, f in SCHEDULES.items()}
    ref = results["q1"]
    assert ref.widths == [1] * n and max(results["bands"].widths) == 4
    for name, r in results.items():
        assert r.logits_sha256 == ref.logits_sha256, name
        assert r.response_tokens == ref.response_tokens and r.response_sha256 == ref.response_sha256, name
        assert r.response_tokens_sha256 == ref.response_tokens_sha256, name
        assert np.array_equal(r.logits.view(np.uint32), ref.logits.view(np.uint32)), name


def test_planted_batch_variance_is_caught():
    """A context whose rows depend on the band width (like the stock build's sgemm): q1 and bands
    must then differ, else the comparisons above could never fail."""
    n = len(TOKENS)
    a = prefill.run(FakeContext(variance=1e-3), prefill.Request(TOKENS, q1(n), n_predict=4, keep_logits=True))
    b = prefill.run(FakeContext(variance=1e-3), prefill.Request(TOKENS, banded(n), n_predict=4, keep_logits=True))
    assert a.logits_sha256 != b.logits_sha256
    assert a.logits_sha256 == sha_rows(rows(TOKENS))  # width 1 is the reference row
    assert b.response_tokens == a.response_tokens  # the spike wins: only the logits show it
    # logits="last" sees it when the last band is wider than 1
    last_q1 = prefill.run(FakeContext(variance=1e-3), prefill.Request(TOKENS, q1(n), n_predict=0, logits="last"))
    wide_end = from_widths([1] * (n - 3) + [3])
    last_b = prefill.run(FakeContext(variance=1e-3), prefill.Request(TOKENS, wide_end, n_predict=0, logits="last"))
    assert last_b.widths[-1] > 1 and last_q1.logits_sha256 != last_b.logits_sha256


@pytest.mark.parametrize("p", [13, 16])  # unaligned and aligned to both ratios
def test_resume_keeps_the_context_and_hashes_only_the_rest(p):
    n = len(TOKENS)
    ctx = FakeContext()
    first = prefill.run(ctx, prefill.Request(TOKENS[:p], banded(p), n_predict=0))
    assert ctx.clears == 1 and first.response_tokens == []
    calls_before = len(ctx.calls)
    second = prefill.run(ctx, prefill.Request(TOKENS, banded(n - p, p), n_predict=4, keep_logits=True, start=p))
    assert ctx.clears == 1  # not cleared
    resumed = ctx.calls[calls_before:]
    assert min(pos for _, pos, _ in resumed) == p  # nothing before start is decoded again
    assert second.n_prompt_tokens == n - p and second.widths[0] <= 4
    assert second.logits_sha256 == sha_rows(rows(TOKENS, start=p))
    assert second.logits_sha256 != sha_rows(rows(TOKENS))
    assert np.isnan(second.logits[:p]).all()
    assert np.array_equal(second.logits[p:], np.stack(rows(TOKENS, start=p)))
    whole = prefill.run(FakeContext(), prefill.Request(TOKENS, q1(n), n_predict=4))
    assert second.response_tokens == whole.response_tokens
    # the fake needs its history: a resume on a cleared context is refused, so clear() matters
    ctx.clear()
    with pytest.raises(AssertionError, match="without positions"):
        prefill.run(ctx, prefill.Request(TOKENS, banded(n - p, p), n_predict=4, start=p))


def test_decode_is_greedy_and_stops_at_n_predict():
    n = len(TOKENS)
    ctx = FakeContext()
    res = prefill.run(ctx, prefill.Request(TOKENS, banded(n), n_predict=5))
    expect = [(TOKENS[-1] + 1 + k) % N_VOCAB for k in range(5)]
    assert res.response_tokens == expect
    assert res.response_text == FakeModel().detokenize(expect)
    assert res.response_sha256 == hashlib.sha256(res.response_text).hexdigest()
    assert res.response_tokens_sha256 == hashlib.sha256(np.asarray(expect, "<i4").tobytes()).hexdigest()
    gen = ctx.calls[len(banded(n)):]
    # one decode per response token but the last (its logits are never needed), at n, n+1, ...
    assert [(toks, pos, mode) for toks, pos, mode in gen] == [([t], n + i, "last") for i, t in enumerate(expect[:-1])]


def test_decode_stops_at_end_of_generation():
    n = len(TOKENS)
    eog = (TOKENS[-1] + 3) % N_VOCAB  # the third greedy token
    ctx = FakeContext(eog={eog})
    res = prefill.run(ctx, prefill.Request(TOKENS, banded(n), n_predict=10))
    assert res.response_tokens == [(TOKENS[-1] + 1) % N_VOCAB, (TOKENS[-1] + 2) % N_VOCAB]
    assert eog not in res.response_tokens
    # the first greedy token is end-of-generation: an empty response, no decode after the prompt
    ctx = FakeContext(eog={(TOKENS[-1] + 1) % N_VOCAB})
    res = prefill.run(ctx, prefill.Request(TOKENS, banded(n), n_predict=10))
    assert res.response_tokens == [] and len(ctx.calls) == len(banded(n))


@pytest.mark.parametrize("room", [0, 1, 3])
def test_decode_stops_at_the_end_of_the_context(room):
    n = len(TOKENS)
    ctx = FakeContext(n_ctx=n + room)  # the fake refuses any position >= n_ctx
    res = prefill.run(ctx, prefill.Request(TOKENS, banded(n), n_predict=20))
    # every free position is decoded, and the token after the last one is still returned
    assert len(res.response_tokens) == room + 1
    assert max(pos for _, pos, _ in ctx.calls) == n + room - 1


def test_n_predict_zero_decodes_nothing():
    n = len(TOKENS)
    for mode in ("all", "last"):
        ctx = FakeContext()
        res = prefill.run(ctx, prefill.Request(TOKENS, banded(n), n_predict=0, logits=mode))
        assert res.response_tokens == [] and res.response_text == b""
        assert len(ctx.calls) == len(banded(n)) and max(pos for _, pos, _ in ctx.calls) < n
        assert res.response_sha256 == hashlib.sha256(b"").hexdigest()
        assert res.response_tokens_sha256 == hashlib.sha256(b"").hexdigest()
    # n_predict=1: the token comes from the prompt's last logits, with no decode after it
    ctx = FakeContext()
    res = prefill.run(ctx, prefill.Request(TOKENS, banded(n), n_predict=1))
    assert res.response_tokens == [(TOKENS[-1] + 1) % N_VOCAB] and len(ctx.calls) == len(banded(n))


def test_progress_and_on_band():
    n = len(TOKENS)
    bands = irregular(n)
    done, seen = [], []
    prefill.run(FakeContext(), prefill.Request(TOKENS, bands, n_predict=0), progress=lambda d, t: done.append((d, t)),
                on_band=seen.append)
    assert done == [(b.end, n) for b in bands] and seen == bands


@pytest.mark.parametrize("widths,start,n", [
    ([2, 2], 0, 5),  # too few
    ([4, 2], 0, 5),  # too many
    ([], 0, 3),      # none
    ([3], 1, 3),     # resuming at 1: only 2 tokens left to cover
])
def test_request_rejects_bands_that_do_not_cover(widths, start, n):
    with pytest.raises(ValueError, match="cover"):
        prefill.Request(TOKENS[:n], from_widths(widths, start), start=start)
    prefill.Request(TOKENS[:n], from_widths([n - start], start), start=start)  # the right cover is accepted


def test_request_rejects_bands_that_start_elsewhere():
    with pytest.raises(ValueError, match="start"):
        prefill.Request(TOKENS[:3], from_widths([2], 0), start=1)  # width right, start wrong
    prefill.Request(TOKENS[:3], from_widths([2], 1), start=1)


@pytest.mark.parametrize("bands", [
    [Band(0, 2, NARROW, "given"), Band(3, 2, NARROW, "given")],  # skips position 2, runs past the end
    [Band(0, 3, NARROW, "given"), Band(1, 1, NARROW, "given")],  # overlaps, never reaches 3
])
def test_request_rejects_bands_that_do_not_tile(bands):
    with pytest.raises(ValueError, match="does not start where the previous one ends"):
        prefill.Request(TOKENS[:4], bands)


def test_request_rejects_an_unknown_logits_mode():
    with pytest.raises(ValueError, match="logits"):
        prefill.Request(TOKENS[:4], from_widths([4]), logits="ALL")


def test_a_band_the_context_cannot_hold_is_an_error_not_a_truncation():
    """The runner hands each band to one decode whole: a band wider than the context's batch, or
    past its end, fails with llama.Context's error instead of being cut or dropped."""
    with pytest.raises(LlamaError, match="band width 9 outside 1..8"):
        prefill.run(FakeContext(max_band=8), prefill.Request(TOKENS[:9], from_widths([9]), n_predict=0))
    with pytest.raises(LlamaError, match="exceed the context of 8"):
        prefill.run(FakeContext(n_ctx=8), prefill.Request(TOKENS[:9], from_widths([4, 4, 1]), n_predict=0))
