"""Speculative decoding that never changes a bit: n-gram drafting (pure), the library's own
speculative greedy decoding against plain decoding (the exact library in process; the stock one,
whose verification batches differ, in a subprocess as the twin), and the options that turn
llama-server's speculation on. The servers themselves run in tests/test_serve.py."""
import json

import numpy as np
import pytest

from dflash.core.errors import UsageError
from dflash.run import speculate
from dflash.serving import serve_config, serve_record
from dflash.serving import serve_workload as wl
from dflash.session import Session

from .conftest import TEST_THREADS, run_dflash

# in-process sessions load the exact library with the flags tests/test_session.py's do (one process
# loads one library and flag set): bands on, cap 4
IN_PROCESS = {"bands": True, "chunk": 4, "threads": TEST_THREADS}
# a prompt whose continuation repeats it: what n-gram drafts predict
CODE = "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\n" * 2 + "Repeat the code above:\n"
TINY_PROMPT = " ".join([wl.words(8, 505)] * 8)


# ---- n-gram drafts (pure) ------------------------------------------------------------------------

@pytest.mark.parametrize("tokens, n, m, draft", [
    ([1, 2, 3, 4, 1, 2], 2, 5, [3, 4, 1, 2]),    # the tokens after the earlier "1 2", up to the end
    ([1, 2, 3, 4, 1, 2], 2, 1, [3]),             # at most m
    ([1, 2, 9, 1, 2, 7, 1, 2], 2, 3, [7, 1, 2]),  # the most recent earlier occurrence wins
    ([1, 2, 3], 2, 4, []),                        # no earlier occurrence
    ([5, 5], 1, 4, [5]),                          # n = 1
    ([1], 1, 4, []),                              # too short to look up
])
def test_ngram_draft_proposes_what_followed_the_last_ngram(tokens, n, m, draft):
    assert speculate.ngram_draft(tokens, n, m) == draft


def test_the_incremental_index_drafts_what_a_backward_scan_finds():
    """NgramIndex, built once and appended to token by token, against a scan from the end."""
    def scan(tokens, n, m):
        for start in range(len(tokens) - n - 1, -1, -1):
            if tokens[start:start + n] == tokens[-n:]:
                return tokens[start + n:start + n + m]
        return []

    rng = np.random.default_rng(7)
    for n in (1, 2, 4):
        tokens = [int(t) for t in rng.integers(0, 3, 300)]
        index = speculate.NgramIndex(tokens[:5], n)
        for i in range(5, len(tokens)):
            assert index.draft(6) == (scan(index.tokens, n, 6) if len(index.tokens) > n else []), (n, i)
            index.append(tokens[i])


@pytest.mark.parametrize("spec, n", [("ngram", speculate.NGRAM_N), ("ngram:1", 1), ("ngram:16", 16), ("none", None),
                                     ("mtp", None)])
def test_ngram_size(spec, n):
    assert speculate.ngram_size(spec) == n


@pytest.mark.parametrize("spec", ["ngram:0", "ngram:17", "ngram:x", "ngram:"])
def test_a_bad_ngram_length_is_one_usage_error(spec):
    with pytest.raises(UsageError, match="1..16"):
        speculate.ngram_size(spec)


def test_the_library_refuses_model_based_drafters_with_a_pointer_to_the_server():
    with pytest.raises(UsageError, match="dflash serve --spec"):
        speculate.check_spec("mtp")


# ---- llama-server's options -------------------------------------------------------------------

def test_spec_values_and_the_server_options_they_turn_on(tmp_path):
    assert serve_config.spec_args("none") == []
    assert serve_config.spec_args("ngram") == ["--spec-type", "ngram-simple", "--spec-ngram-simple-size-n", "4",
                                               "--spec-ngram-simple-size-m", "16"]
    assert serve_config.spec_args("ngram:1")[3] == "1"
    assert serve_config.spec_args("mtp") == ["--spec-type", "draft-mtp"]
    assert serve_config.spec_args(" draft:/m/d.gguf ") == ["--spec-type", "draft-simple", "--spec-draft-model",
                                                           "/m/d.gguf"]
    for bad in ("eagle", "draft:", "ngram:0", ""):
        with pytest.raises(UsageError, match="spec"):
            serve_config.parse_spec(bad)
    assert serve_config.spec_label("ngram:1") == "spec-ngram1"
    assert serve_config.spec_label("draft:x", "ab" * 32) == "spec-draft-" + "ab" * 8
    assert serve_config.fingerprint("exact", "k", "s" * 16, "m" * 64, spec="spec-mtp").endswith("-spec-mtp")


def test_a_speculating_configuration_batches_every_slots_drafts_and_is_vouched_for_only_by_itself():
    plain = serve_config.ServeConfig(4, 1, 4096, 2)
    spec = serve_config.ServeConfig(4, 1, 4096, 2, spec="ngram")
    a = spec.args()
    assert a[a.index("-ub") + 1] == "1"  # ubatches stay as wide as proven
    assert int(a[a.index("-b") + 1]) >= 4 * (1 + serve_config.MAX_DRAFT)
    assert a[-6:] == serve_config.spec_args("ngram")
    assert plain.args()[plain.args().index("-b") + 1] == "2"
    assert not spec.vouched_by(plain) and not plain.vouched_by(spec) and spec.vouched_by(spec)
    with pytest.raises(UsageError):
        serve_config.ServeConfig(1, 1, 4096, 2, spec="eagle")


@pytest.mark.parametrize("option", ["--spec-type", "-md", "--spec-draft-model", "--model-draft", "--spec-default"])
def test_speculation_options_are_dflash_serves_own(option):
    with pytest.raises(UsageError, match="use --spec"):
        serve_config.check_extra([option, "x"], allow_inexact=True)


def test_synthetic_acceptance_is_inexact_and_tuning_passes_through():
    with pytest.raises(UsageError, match="synthetic acceptance"):
        serve_config.check_extra(["--spec-synth-len", "3"], allow_inexact=False)
    assert serve_config.check_extra(["--spec-ngram-simple-size-n", "4", "--spec-draft-n-max", "2"],
                                    allow_inexact=False) == []


def test_a_serve_record_made_before_speculation_reads_as_none():
    entry = {"config": {"parallel": 1, "ubatch": 4, "ctx": 64, "threads": 1, "flash_attn": "auto",
                        "kv_unified": False}, "responses": 1, "identical_to_solo": 1, "identical_to_prefill": 1,
             "cache_hits": 0, "exact": True, "evidence_dir": None}
    ident = serve_record.Identity("exact", "k", "a" * 64, "cpu")
    record = {"schema": serve_record.SCHEMA, "schema_version": 1, "key": ident.key,
              "server": {"flavor": "exact", "key": "k"}, "model": {"sha256": "a" * 64, "path": "m"}, "device": "cpu",
              "updated_utc": "2026-12-07T00:00:00Z", "configs": [entry]}
    got = serve_record.parse(json.dumps(record).encode())
    assert got.configs[0].config.spec == "none"
    entry["config"]["spec"] = "ngram"
    assert serve_record.parse(json.dumps(record).encode()).configs[0].config.spec == "ngram"
    entry["config"]["spec"] = "eagle"
    with pytest.raises(serve_record.RecordError):
        serve_record.parse(json.dumps(record).encode())


# ---- the library: Session.generate(spec=...) equals Session.generate() ---------------------------

def _both(s, prompt, spec, max_tokens):
    plain = list(s.generate(prompt, max_tokens=max_tokens))
    stats = speculate.SpecStats()
    fast = list(s.generate(prompt, max_tokens=max_tokens, spec=spec, spec_stats=stats))
    return plain, fast, stats


def test_generate_with_ngram_speculation_equals_plain_on_the_tiny_deepseek_v4(tiny_models):
    """DeepSeek-V4's compressors cannot drop a suffix: every rejected draft restores the state saved
    before its batch and decodes the kept tokens again."""
    with Session(str(tiny_models["mxfp4"]), **IN_PROCESS) as s:
        plain, fast, stats = _both(s, TINY_PROMPT, "ngram:1", 48)
    assert [(t.id, t.logprob) for t in fast] == [(t.id, t.logprob) for t in plain]
    assert len(plain) == 48
    assert stats.accepted > 0 and stats.rejected > 0, stats
    assert stats.restores > 0 and stats.truncations == 0
    print(f"tiny DeepSeek-V4: {stats.accepted} of {stats.drafted} drafted tokens accepted")


def test_generate_with_ngram_speculation_equals_plain_on_gemma(gemma):
    with Session(gemma, **IN_PROCESS) as s:
        plain, fast, stats = _both(s, CODE, "ngram", 64)
    assert [(t.id, t.logprob) for t in fast] == [(t.id, t.logprob) for t in plain]
    assert stats.accepted > 0 and stats.rejected > 0, stats
    assert stats.truncations > 0 and stats.restores == 0  # a KV cache drops a suffix
    assert stats.batches < len(plain) - stats.accepted  # fewer llama_decode calls than tokens
    print(f"Gemma 3 270M: {stats.accepted} of {stats.drafted} drafted tokens accepted "
          f"({stats.acceptance_rate:.0%})")


@pytest.mark.parametrize("model, spec, text", [("tiny", "ngram:1", TINY_PROMPT), ("gemma", "ngram", CODE)])
def test_prefill_spec_reports_identical_on_the_exact_library_and_catches_the_stock_one(model, spec, text, request,
                                                                                       tmp_path):
    """The twin: stock llama.cpp computes a verification batch's rows with other bits than one
    token at a time (on Gemma the tokens agree and the logits they were chosen from do not; on the
    tiny DeepSeek-V4 model every rejection restores a saved state, on both libraries)."""
    prompt = tmp_path / "prompt.txt"
    prompt.write_text(text)
    given = [] if model == "tiny" else ["--model", request.getfixturevalue("gemma")]
    out = {}
    for lib in ("exact", "stock"):
        r = run_dflash("prefill", *given, "--lib", lib, "--prompt-file", prompt, "--n-predict", "48",
                       "--spec", spec, "--threads", TEST_THREADS, "--json")
        assert r.returncode == (0 if lib == "exact" else 4), r.stderr
        out[lib] = json.loads(r.stdout)
        assert out[lib]["speculation"]["accepted"] > 0 and out[lib]["speculation"]["rejected"] > 0
    exact, stock = out["exact"]["speculation"], out["stock"]["speculation"]
    assert exact["identical_to_plain"] is True
    assert exact["response_tokens_sha256"] == out["exact"]["response_tokens_sha256"]
    assert stock["identical_to_plain"] is False
    assert "differs from plain greedy decoding" in r.stderr
    if model == "tiny":
        assert exact["restores"] > 0 and stock["restores"] > 0


def test_speculative_greedy_stops_where_plain_greedy_stops():
    """n_predict, end-of-generation inside an accepted draft, and the end of the context, on a
    stand-in context whose logits depend only on the position (so every draft is checked)."""
    class Model:
        def is_eog(self, tok):
            return tok == 0

    class Ctx:
        model, n_ctx, max_band = Model(), 40, 17

        def __init__(self, seq):
            self.seq = seq

        def _row(self, pos):
            row = np.zeros(8, np.float32)
            row[self.seq[pos + 1] if pos + 1 < len(self.seq) else 0] = 1
            return row

        def decode(self, tokens, pos, logits="all"):
            rows = np.stack([self._row(pos + i) for i in range(len(tokens))])
            return rows if logits == "all" else rows[-1:]

        def truncate(self, pos):
            return True

        def save_state(self):
            return b""

    def plain(ctx, history, n_predict):
        out, pos, last = [], len(history), ctx._row(len(history) - 1)
        while len(out) < n_predict:
            tok = int(np.argmax(last))
            if tok == 0:
                break
            out.append(tok)
            if len(out) == n_predict or pos >= ctx.n_ctx:
                break
            last = ctx.decode([tok], pos)[0]
            pos += 1
        return out

    seq = [1, 2, 3, 1, 2, 3, 1, 2, 3, 4, 1, 2, 3, 1, 2, 5] * 3
    for cut, n_predict in ((3, 20), (3, 7), (20, 30), (3, 60)):
        ctx = Ctx(seq[:30] + [0] if n_predict == 30 else seq)
        history = ctx.seq[:cut]
        want = plain(ctx, history, n_predict)
        got = [t for t, _ in speculate.greedy(ctx, history, ctx._row(cut - 1), n_predict, n=1)]
        assert got == want, (cut, n_predict)


# ---- the tiny model's next-n block -------------------------------------------------------------------

def test_the_next_n_block_adds_one_block_and_leaves_the_main_model_as_it_was(tmp_path):
    from gguf import GGUFReader

    from dflash.model import gguf_meta, tiny_model

    plain = tiny_model.write(tmp_path / "plain.gguf", tiny_model.TinyConfig(weights="f32"))
    mtp = tiny_model.write(tmp_path / "mtp.gguf", tiny_model.TinyConfig(weights="f32", mtp=True))
    a = {t.name: np.array(t.data) for t in GGUFReader(plain).tensors}
    b = {t.name: np.array(t.data) for t in GGUFReader(mtp).tensors}
    n = len(tiny_model.TinyConfig().ratios)
    assert set(a) < set(b) and all(name.startswith(f"blk.{n}.") for name in set(b) - set(a))
    assert {f"blk.{n}.nextn.eh_proj.weight", f"blk.{n}.nextn.enorm.weight", f"blk.{n}.nextn.hnorm.weight"} <= set(b)
    assert all(np.array_equal(a[name], b[name]) for name in a)
    info = gguf_meta.read(mtp)
    assert (info.nextn_layers, info.n_layers, info.compress_ratios) == (1, n + 1, (*tiny_model.TinyConfig().ratios, 0))
    assert gguf_meta.read(plain).nextn_layers == 0


def test_llama_cpp_runs_the_main_blocks_of_a_model_with_a_next_n_block_as_without(tmp_path):
    """Its prefill logits and response equal the built-in tiny model's (the same main blocks)."""
    run_dflash("tiny-model", "--mtp", "--out", tmp_path / "mtp.gguf", check=True)
    got = [json.loads(run_dflash("prefill", *model, "--logits", "last", "--n-predict", "8", "--threads", TEST_THREADS,
                                 "--json", check=True).stdout)
           for model in (["--model", tmp_path / "mtp.gguf"], [])]
    assert (got[0]["logits_sha256"], got[0]["response_tokens"]) == (got[1]["logits_sha256"], got[1]["response_tokens"])
