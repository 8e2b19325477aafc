"""`dflash serve` and `dflash qualify --serve` against real llama-server processes (loopback only,
one server at a time, every request loop bounded): exactness under concurrency and cache hits with
the stock build as the twin that must differ, the official openai client, and the faults a server
must survive."""
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from dflash.core.sha_cache import file_sha256
from dflash.native import build
from dflash.serving import client, server
from dflash.serving import serve_workload as wl

from .conftest import CLEAN_ENV, ROOT, run_dflash

THREADS = ["--threads", "2"]
CHATML = ["--chat-template", "chatml"]  # the tiny model has no chat template of its own
START_TIMEOUT = 120


@pytest.fixture(scope="module", autouse=True)
def server_built():
    if not build.server_built():  # scripts/setup builds it; a bare checkout builds it here (minutes)
        run_dflash("build", "--server", check=True)


@pytest.fixture(scope="module")
def qualified():
    """`dflash qualify --serve` of the built-in tiny model: --parallel 1 and 4, chat through chatml."""
    r = run_dflash("qualify", "--serve", "--parallel", "4", "--max-tokens", "12", "--prefix-words", "200",
                   *THREADS, "--json", "--", *CHATML)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


class Serve:
    """`dflash serve ... --json` as a user runs it; the first stdout line is its JSON."""

    def __init__(self, *args, env=None):
        self.port = server.free_port()
        full_env = {k: v for k, v in os.environ.items() if k not in CLEAN_ENV}
        full_env.update(env or {})
        self.proc = subprocess.Popen([sys.executable, "-m", "dflash", "serve", "--port", str(self.port), *THREADS,
                                      "--json", *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                     env=full_env, cwd=ROOT)
        self.err: list[str] = []
        threading.Thread(target=self._drain, daemon=True).start()
        line = self._line(START_TIMEOUT)
        assert line, f"dflash serve printed nothing; rc={self.proc.poll()} stderr: {''.join(self.err[-20:])}"
        self.info = json.loads(line)
        self.url = self.info["url"]

    def _drain(self):
        for line in self.proc.stderr:
            self.err.append(line)

    def _line(self, timeout):
        out = []
        t = threading.Thread(target=lambda: out.append(self.proc.stdout.readline()), daemon=True)
        t.start()
        t.join(timeout)
        return out[0] if out else ""

    def post(self, path, payload, **kw):
        return client.post(self.url + path, payload, **kw)

    def llama_server_pid(self):
        kids = Path(f"/proc/{self.proc.pid}/task/{self.proc.pid}/children").read_text().split()
        assert len(kids) == 1, kids
        return int(kids[0])

    def stop(self, sig=signal.SIGTERM, timeout=30):
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        return self.proc.wait(timeout)


@pytest.fixture(scope="module")
def serving(qualified):
    s = Serve()
    yield s
    assert s.stop() == 0, "".join(s.err[-20:])


def completion(prompt, max_tokens=8, **kw):
    return {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "logprobs": 2, **kw}


# ---- exactness ---------------------------------------------------------------------------------

def test_qualify_serve_tiny_is_exact_under_concurrency_and_cache_hits(qualified):
    assert qualified["exact"] is True
    by = {c["config"]["parallel"]: c for c in qualified["configs"]}
    assert set(by) == {1, 4}
    for c in by.values():
        assert c["responses"] == c["identical_to_solo"] == c["identical_to_prefill"] == 15
        assert all(v["why"] == "" for v in c["verdicts"])
    for c in by.values():  # the follow-ups really hit the prompt cache
        assert c["cache_hits"] >= 2, c
    assert {v["stream"] for v in by[4]["verdicts"]} == {True, False}
    assert qualified["system_fingerprint"].startswith("dflash-exact-")
    v = run_dflash("verify", qualified["evidence_dir"], "--manifest-sha256", qualified["manifest_sha256"])
    assert v.returncode == 0, v.stdout + v.stderr
    assert Path(qualified["record"]).is_file()


def test_qualify_serve_stock_twin_differs():
    """The stock build under the same workload and configuration: not identical (exit 4)."""
    r = run_dflash("qualify", "--serve", "--lib", "stock", "--parallel", "4", "--max-tokens", "12",
                   "--prefix-words", "200", *THREADS, "--json", "--", *CHATML)
    assert r.returncode == 4, r.stderr
    out = json.loads(r.stdout)
    assert out["exact"] is False and out["system_fingerprint"].startswith("dflash-stock-")
    four = next(c for c in out["configs"] if c["config"]["parallel"] == 4)
    assert four["identical_to_prefill"] < four["responses"]
    assert any("differ" in v["why"] for v in four["verdicts"])


def test_serve_runs_the_vouched_configuration(serving, qualified):
    assert serving.info["vouched"] is True and serving.info["config"]["parallel"] == 4
    assert serving.info["record"] == qualified["record"]
    assert serving.info["system_fingerprint"] == qualified["system_fingerprint"]


def test_response_matches_dflash_prefill_bit_for_bit(serving):
    prompt = "The band scheduler keeps every compressor emission at the end of its band."
    r = serving.post("/v1/completions", completion(prompt, 10))
    assert r.status == 200, r.text
    p = json.loads(run_dflash("prefill", "--prompt", prompt, "--logits", "last", "--n-predict", "10", "--no-bands",
                              *THREADS, "--json", check=True).stdout)
    fp = r.body["dflash"]
    assert fp["prompt_sha256"] == p["prompt_sha256"]
    assert fp["logits_sha256"] == p["logits_sha256"]
    assert fp["response_tokens"] == p["response_tokens"]
    assert fp["response_tokens_sha256"] == p["response_tokens_sha256"]
    assert r.body["system_fingerprint"] == serving.info["system_fingerprint"]


def test_serve_without_any_record_starts_and_answers_what_q1_computes(tmp_path):
    """A fresh machine: no qualification or serve record. `dflash serve` falls back to one slot and
    one-token ubatches (-b 2 -ub 1: llama-server decodes a 2-token batch while it starts, so -b 1
    would abort it) and answers with what `dflash prefill`'s q1 computes."""
    from dflash.core.paths import cache_root
    cache = tmp_path / "cache"
    (cache / "dflash").mkdir(parents=True)
    for entry in ("llama", "llama-server", "models", "sdist", "src"):
        (cache / "dflash" / entry).symlink_to(cache_root() / entry, target_is_directory=True)
    env = {"XDG_CACHE_HOME": str(cache)}
    s = Serve(env=env)
    try:
        assert s.info["vouched"] is False, s.info
        assert (s.info["config"]["parallel"], s.info["config"]["ubatch"]) == (1, 1)
        prompt = "A fresh machine serves its first completion one token per step."
        r = s.post("/v1/completions", completion(prompt, 8))
        assert r.status == 200, r.text
    finally:
        assert s.stop() == 0, "".join(s.err[-20:])
    p = json.loads(run_dflash("prefill", "--prompt", prompt, "--logits", "last", "--n-predict", "8", "--no-bands",
                              *THREADS, "--json", env=env, check=True).stdout)
    fp = r.body["dflash"]
    assert (fp["prompt_sha256"], fp["logits_sha256"], fp["response_tokens"]) == \
        (p["prompt_sha256"], p["logits_sha256"], p["response_tokens"])
    assert not list((cache / "dflash").glob("qualifications/serve-*.json")), "serve wrote a record"


def _tokens(serving, text):
    r = serving.post("/tokenize", {"content": text})
    assert r.status == 200, r.text
    return r.body["tokens"]


def _prefix_hits(srv, every=128):
    """A ~1,000-token prompt evaluated cold, then again (a repeat) and with a new suffix (a sibling)
    on the same server; returns (tokens of the first, shared tokens, repeat, sibling, their cold
    runs with the cache off, the two prompts)."""
    prefix = wl.words(800, 4242)
    first, second = f"{prefix} {wl.words(10, 1)}", f"{prefix} {wl.words(10, 2)}"
    a, b = _tokens(srv, first), _tokens(srv, second)
    common = next(i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y)
    assert common > 3 * every, (common, len(a))
    calls = {k: wl.Call(k, wl.COMPLETIONS, completion(p, 6)) for k, p in (("first", first), ("second", second))}
    wl.send(srv.url, calls["first"])                           # evaluated cold; leaves its checkpoints
    repeat = wl.send(srv.url, calls["first"])
    sibling = wl.send(srv.url, calls["second"])
    assert (repeat.status, sibling.status) == (200, 200)
    colds = [wl.send(srv.url, calls[k], extra={"cache_prompt": False}) for k in ("first", "second")]
    return a, common, repeat, sibling, colds, (first, second)


def test_a_shared_prefix_restarts_from_its_last_aligned_position_and_stays_exact(serving):
    """DeepSeek-V4's cache cannot be cut to a prefix: with server patch 0003 llama-server also
    checkpoints every multiple of the compress ratios' lcm (128 on the tiny model), so a new suffix
    on a ~1,000-token prefix is served from the last such position at or below the shared part
    (stock llama-server: from 4 + n_ubatch tokens before the old prompt's end), the repeat from one
    token before the end (patch 0005); each identical to the same request alone and cold."""
    every = 128
    a, common, repeat, sibling, colds, prompts = _prefix_hits(serving, every)
    # the old prompt's own checkpoints sit 4 and 4 + n_ubatch tokens before its end
    ub = serving.info["config"]["ubatch"]
    old_end = [len(a) - 4, len(a) - 4 - ub]
    assert repeat.cached_tokens == len(a) - 1  # server patch 0005: a checkpoint one token before the end
    want = max([c for c in old_end if 0 < c <= common] + [common // every * every])
    assert want == common // every * every, (want, old_end, common)
    assert sibling.cached_tokens == want, (sibling.cached_tokens, want, common, len(a))
    for name, got, cold in (("first", repeat, colds[0]), ("second", sibling, colds[1])):
        assert cold.cached_tokens == 0 and got.same_as(cold), name
    for prompt, got in zip(prompts, (repeat, sibling), strict=True):  # and what dflash prefill's q1 computes
        p = json.loads(run_dflash("prefill", "--prompt", prompt, "--logits", "last", "--n-predict", "6",
                                  "--no-bands", *THREADS, "--json", check=True).stdout)
        assert list(got.tokens) == p["response_tokens"]


def _turns(srv, words_seed=11):
    """A ~70-token prompt (token ids) cold, the same again, then a second turn that extends the
    finished conversation (prompt, response, a new question); the last two also alone and cold."""
    ids = _tokens(srv, wl.words(60, words_seed))
    first = wl.send(srv.url, wl.Call("first", wl.COMPLETIONS, completion(ids, 8)))
    assert first.status == 200, first.error
    call = wl.Call("repeat", wl.COMPLETIONS, completion(ids, 8))
    turn2 = wl.Call("turn-2", wl.COMPLETIONS, completion(
        [*ids, *first.tokens, *_tokens(srv, wl.words(12, words_seed + 1))], 8))
    repeat, second = wl.send(srv.url, call), wl.send(srv.url, turn2)
    colds = [wl.send(srv.url, c, extra={"cache_prompt": False}) for c in (call, turn2)]
    return ids, first, repeat, second, colds


def test_a_repeated_prompt_and_a_next_turn_reuse_the_cache_to_the_last_token(serving):
    """DeepSeek-V4 at --parallel 4: with server patch 0005's checkpoint one token before each
    prompt's end an exact repeat evaluates one token; a next turn that extends the finished
    conversation continues the slot's cache from the previous response's last token (sampled,
    never decoded; no cut, so no checkpoint is needed); each identical to the same request alone
    and cold."""
    assert serving.info["config"]["parallel"] == 4
    ids, first, repeat, second, colds = _turns(serving)
    assert len(ids) >= 60 and len(first.tokens) == 8
    assert repeat.cached_tokens == len(ids) - 1, (repeat.cached_tokens, len(ids))
    assert second.cached_tokens == len(ids) + len(first.tokens) - 1, (second.cached_tokens, len(ids))
    assert repeat.same_as(first)
    for got, cold in zip((repeat, second), colds, strict=True):
        assert cold.cached_tokens == 0 and got.same_as(cold)
    print(f"repeat of {len(ids)} tokens: {repeat.cached_tokens} cached, first token after "
          f"{repeat.first_token_seconds or repeat.seconds:.3f} s vs {colds[0].seconds:.3f} s cold; next turn of "
          f"{second.prompt_tokens} tokens: {second.cached_tokens} cached")


def test_the_stock_twin_of_the_prefix_hits_differs_from_its_cold_runs():
    """The same hits on the stock library (same server binary and checkpoints, 64-token ubatches
    that no record vouches for): the comparison with the cold runs must catch them differing."""
    s = Serve("--lib", "stock", "--parallel", "1", "--ubatch", "64", "--allow-inexact")
    try:
        _, _, repeat, sibling, colds, _ = _prefix_hits(s)
        assert sibling.cached_tokens > 0, "no shared-prefix hit: nothing was compared"
        assert not (repeat.same_as(colds[0]) and sibling.same_as(colds[1]))
        _, _, repeat, second, colds = _turns(s)  # and the hits at the ends of a prompt and a response
        assert repeat.cached_tokens > 0 and second.cached_tokens > 0
        assert not (repeat.same_as(colds[0]) and second.same_as(colds[1]))
    finally:
        assert s.stop() == 0, "".join(s.err[-20:])


# ---- the official openai client --------------------------------------------------------------

def test_openai_client_completions_chat_and_streaming(serving):
    import openai
    client = openai.OpenAI(base_url=serving.url + "/v1", api_key="unused", max_retries=0, timeout=60)
    model = client.models.list().data[0].id
    c = client.completions.create(model=model, prompt="one two three", max_tokens=6, temperature=0)
    assert c.system_fingerprint == serving.info["system_fingerprint"] and c.usage.completion_tokens >= 1
    parts = list(client.completions.create(model=model, prompt="one two three", max_tokens=6, temperature=0,
                                           stream=True))
    assert "".join(p.choices[0].text for p in parts if p.choices) == c.choices[0].text
    assert c.model_extra["dflash"]["response_tokens_sha256"] == parts[-1].model_extra["dflash"][
        "response_tokens_sha256"]
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="no-such-model", prompt="x", max_tokens=2)


def test_openai_chat_with_a_template():
    """Chat on a model with a chat template (the tiny model has none: llama-server's chatml)."""
    import openai
    s = Serve("--parallel", "1", "--", *CHATML)
    try:
        client = openai.OpenAI(base_url=s.url + "/v1", api_key="unused", max_retries=0, timeout=60)
        msgs = [{"role": "system", "content": "band width token"}, {"role": "user", "content": "cache slot"}]
        a = client.chat.completions.create(model=client.models.list().data[0].id, messages=msgs, max_tokens=6,
                                           temperature=0, logprobs=True, top_logprobs=2)
        b = list(client.chat.completions.create(model=client.models.list().data[0].id, messages=msgs, max_tokens=6,
                                                temperature=0, stream=True))
        assert a.choices[0].message.role == "assistant" and a.choices[0].logprobs.content
        assert "".join(p.choices[0].delta.content or "" for p in b if p.choices) == a.choices[0].message.content
        assert a.model_extra["dflash"]["response_tokens"] == b[-1].model_extra["dflash"]["response_tokens"]
    finally:
        assert s.stop() == 0


# ---- bad input ---------------------------------------------------------------------------------

LEAKS = ("json.exception", "std::", "terminate", "what()", "Traceback", "parse_error", "type_error")


def _clean_error(r, status):
    assert r.status == status, (r.status, r.text)
    assert isinstance(r.body, dict) and "error" in r.body, r.text
    assert not any(x in r.text for x in LEAKS), r.text


def test_bad_requests_get_4xx_json_and_the_server_goes_on(serving):
    url = serving.url
    _clean_error(client.request(url + "/v1/completions", b"{not json"), 400)
    _clean_error(client.request(url + "/v1/chat/completions", b'{"messages": [}'), 400)
    _clean_error(serving.post("/v1/completions", {"prompt": "x", "max_tokens": "many"}), 400)
    _clean_error(serving.post("/v1/completions", {"prompt": 12.5, "max_tokens": 2}), 400)
    _clean_error(serving.post("/v1/chat/completions", {"messages": "hello", "max_tokens": 2}), 400)
    _clean_error(serving.post("/v1/completions", {"prompt": "x", "max_tokens": -5}), 400)
    huge = serving.post("/v1/completions", {"prompt": "x", "max_tokens": 10**12})
    _clean_error(huge, 400)
    assert "1000000000000" in huge.body["error"]["message"]  # named as sent, not wrapped to an int
    unknown = serving.post("/v1/completions", {"prompt": "x", "max_tokens": 2, "model": "gpt-nothing"})
    _clean_error(unknown, 404)
    assert "gpt-nothing" in unknown.body["error"]["message"]
    _clean_error(serving.post("/v1/completions", {"prompt": "x", "max_tokens": 2, "model": 7}), 400)
    _clean_error(serving.post("/v1/completions", {"prompt": wl.words(6000, 3), "max_tokens": 2}), 400)  # > ctx
    _clean_error(client.request(url + "/v1/completions", b'{"prompt": "' + b"a" * (17 << 20) + b'"}'), 413)
    zero = serving.post("/v1/completions", {"prompt": "x", "max_tokens": 0})  # llama-server samples one
    assert zero.status == 200 and len(zero.body["dflash"]["response_tokens"]) <= 1, zero.text
    missing = serving.post("/v1/completions", {"max_tokens": 2})
    _clean_error(missing, 400)
    assert "prompt" in missing.body["error"]["message"]
    _clean_error(serving.post("/v1/completions", [1, 2]), 400)
    empty = serving.post("/v1/completions", {"prompt": "", "max_tokens": 2})
    assert empty.status in (200, 400) and not any(x in empty.text for x in LEAKS), empty.text
    ok = serving.post("/v1/completions", completion("still here", 4))
    assert ok.status == 200 and ok.body["dflash"]["response_tokens"]


def test_more_requests_than_slots_are_queued_and_exact(serving):
    calls = [wl.Call(f"q{i}", wl.COMPLETIONS, completion(wl.words(20 + 7 * i, 50 + i), 6), stream=i % 2 == 0)
             for i in range(12)]
    got = wl.run_wave(serving.url, calls)
    solo = [wl.send(serving.url, wl.Call(c.name, c.endpoint, c.body), extra={"cache_prompt": False}) for c in calls]
    assert [r.status for r in got] == [200] * 12
    assert all(a.same_as(b) for a, b in zip(got, solo, strict=True))


def test_a_client_that_disconnects_mid_stream_leaves_the_others_exact(serving):
    body = completion(wl.words(40, 9), 60)
    conn, path = client._connection(serving.url + "/v1/completions", 30)
    conn.request("POST", path, body=json.dumps({**body, "stream": True}).encode(),
                 headers={"Content-Type": "application/json"})
    resp = conn.getresponse()
    assert resp.status == 200
    resp.fp.readline()  # one event, then hang up
    conn.sock.shutdown(socket.SHUT_RDWR)
    conn.close()
    others = [wl.Call(f"o{i}", wl.COMPLETIONS, completion(wl.words(30, 70 + i), 8)) for i in range(3)]
    got = wl.run_wave(serving.url, others)
    solo = [wl.send(serving.url, c, extra={"cache_prompt": False}) for c in others]
    assert all(a.same_as(b) for a, b in zip(got, solo, strict=True))


# ---- the process: crash, restart, signals, refusals ------------------------------------------

def test_a_killed_llama_server_is_restarted_and_still_exact():
    s = Serve("--parallel", "1")
    try:
        body = completion(wl.words(60, 11), 8)
        before = wl.send(s.url, wl.Call("b", wl.COMPLETIONS, body))
        assert before.status == 200
        victim = s.llama_server_pid()
        os.kill(victim, signal.SIGKILL)
        deadline = time.monotonic() + START_TIMEOUT
        while time.monotonic() < deadline and not any("restarted" in e for e in s.err):
            time.sleep(0.2)
        assert any("killed by SIGKILL" in e for e in s.err), "".join(s.err[-10:])
        assert any("restarted" in e for e in s.err), "".join(s.err[-10:])
        assert s.llama_server_pid() != victim
        after = wl.send(s.url, wl.Call("a", wl.COMPLETIONS, body))
        assert after.same_as(before)
    finally:
        assert s.stop() == 0


def test_sigterm_during_requests_stops_cleanly():
    s = Serve("--parallel", "1")
    calls = [wl.Call(f"t{i}", wl.COMPLETIONS, completion(wl.words(30, i), 400), stream=True) for i in range(2)]
    results = []
    t = threading.Thread(target=lambda: results.extend(wl.run_wave(s.url, calls)), daemon=True)
    t.start()
    time.sleep(1.0)
    t0 = time.monotonic()
    assert s.stop(signal.SIGTERM) == 0
    assert time.monotonic() - t0 < 15
    t.join(30)
    assert not t.is_alive() and len(results) == 2  # in-flight requests ended (answered or failed), none hang
    with pytest.raises(OSError):
        client.request(s.url + "/health", method="GET", timeout=2)


@pytest.mark.parametrize("args, word", [
    (["--host", "10.1.2.3"], "--allow-remote and --api-key"),
    (["--host", "0.0.0.0", "--allow-remote"], "--api-key"),
    (["--", "--cache-reuse", "256"], "breaks exactness"),
    (["--", "-np", "8"], "use --parallel"),
    (["--parallel", "3"], "no serve record vouches for 3 slots"),
    (["--ubatch", "64", "--weights", "f16"], "no serve record or qualification record proves width 64"),
    (["--spec", "eagle"], "is not one of"),
    (["--spec", "mtp"], "has no next-n"),
    (["--spec", "draft:/nonexistent.gguf"], "nonexistent.gguf"),
    (["--spec", "ngram:2", "--weights", "f16"], "no serve record vouches for speculation"),
    (["--", "--spec-type", "ngram-simple"], "use --spec"),
])
def test_serve_refuses_before_it_binds(args, word):
    r = run_dflash("serve", "--port", str(server.free_port()), *args)
    assert r.returncode == 2, r.stderr
    assert word in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr


def test_api_key_is_required_when_set():
    s = Serve("--parallel", "1", "--api-key", "sesame")
    try:
        assert s.post("/v1/completions", completion("x", 2)).status == 401
        ok = s.post("/v1/completions", completion("x", 2), headers={"Authorization": "Bearer sesame"})
        assert ok.status == 200
        assert "sesame" not in " ".join(Path(f"/proc/{s.llama_server_pid()}/cmdline").read_text().split("\0"))
    finally:
        assert s.stop() == 0


# ---- speculative decoding ------------------------------------------------------------------------

SPEC_QUALIFY = ["--parallel", "4", "--max-tokens", "24", "--prefix-words", "200", *THREADS]


def _speculated(config):
    """A configuration's speculation, with drafts both accepted and rejected (quoted in the log)."""
    s = config["speculation"]
    assert s["draft_accepted"] > 0 and s["draft_rejected"] > 0, s
    print(f"--parallel {config['config']['parallel']} --spec {s['spec']}: {s['draft_accepted']} of "
          f"{s['draft_tokens']} drafted tokens accepted ({s['acceptance_rate']:.1%})")
    return s


def _spec_qualify(*args, extra=CHATML):
    """`dflash qualify --serve` with speculation on the exact library: exit 0, and every
    configuration's 17 responses identical to their solo cold runs without speculation and to
    dflash prefill."""
    r = run_dflash("qualify", "--serve", *args, "--json", "--", *extra)
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout)
    assert out["exact"] is True
    for c in out["configs"]:
        assert c["responses"] == c["identical_to_solo"] == c["identical_to_prefill"] == 17
    return out


def _stock_twin(*args):
    """The same on the stock library: exit 4, and at --parallel 1 a cold first request with drafts
    (prefilled exactly as its solo cold run is, so the verification batches are what differ)
    differs from its solo cold run. Returns that configuration."""
    r = run_dflash("qualify", "--serve", "--lib", "stock", *args, "--json", "--", *CHATML)
    assert r.returncode == 4, r.stderr
    one = next(c for c in json.loads(r.stdout)["configs"] if c["config"]["parallel"] == 1)
    cold = [v for v in one["verdicts"] if v["wave"] == 0 and v["draft_tokens"] > 0]
    assert any(not v["identical_to_solo"] for v in cold), one["verdicts"]
    return one


@pytest.fixture(scope="module")
def spec_qualified():
    """`dflash qualify --serve --spec ngram:1` of the tiny DeepSeek-V4 model (a one-token lookup: this
    random model's text repeats little; every rejected draft restores a checkpoint and replays)."""
    return _spec_qualify("--spec", "ngram:1", *SPEC_QUALIFY)


def test_ngram_speculation_on_the_tiny_deepseek_v4_is_identical_to_plain_solo_cold_runs(spec_qualified):
    """Every response with drafts equals the same request decoded without speculation, alone and
    cold (token ids, logprobs from the verification rows, fingerprints), at --parallel 1 and 4 with
    cache hits."""
    out = spec_qualified  # exact, 17 of 17 identical at each --parallel (_spec_qualify)
    assert out["system_fingerprint"].startswith("dflash-exact-")
    by = {c["config"]["parallel"]: c for c in out["configs"]}
    assert set(by) == {1, 4}
    for c in by.values():
        assert c["config"]["spec"] == "ngram:1"
        assert c["cache_hits"] >= 2
        _speculated(c)
        assert any(v["draft_accepted"] > 0 for v in c["verdicts"] if v["wave"] == 1)  # on cache hits too
    v = run_dflash("verify", out["evidence_dir"], "--manifest-sha256", out["manifest_sha256"])
    assert v.returncode == 0, v.stdout + v.stderr


def test_the_stock_twin_of_ngram_speculation_differs_from_its_solo_cold_runs():
    """Stock llama.cpp under the same speculation: at --parallel 1 a cold first request prefills
    exactly as its solo cold run does, so what differs there is the verification batches."""
    _speculated(_stock_twin("--spec", "ngram:1", *SPEC_QUALIFY))


def test_serve_spec_runs_the_vouched_speculation_and_says_so(spec_qualified):
    s = Serve("--spec", "ngram:1")
    try:
        assert s.info["vouched"] is True and s.info["spec"] == "ngram:1"
        assert s.info["config"]["parallel"] == 4 and s.info["config"]["spec"] == "ngram:1"
        assert s.info["system_fingerprint"].endswith("-spec-ngram1")
        models = client.request(s.url + "/v1/models", method="GET")
        assert models.status == 200
        assert {m["system_fingerprint"] for m in models.body["data"]} == {s.info["system_fingerprint"]}
        r = s.post("/v1/completions", completion(TINY_REPEAT, 24))
        assert r.status == 200 and r.body["system_fingerprint"] == s.info["system_fingerprint"]
        assert r.body["timings"]["draft_n"] > 0
    finally:
        assert s.stop() == 0, "".join(s.err[-20:])


TINY_REPEAT = " ".join([wl.words(8, 500)] * 8)


@pytest.fixture(scope="module")
def tiny_drafters(tmp_path_factory):
    """The built-in tiny model's weights in f32 (a draft model: the same seed, so it mostly agrees
    with the MXFP4 target) and the tiny model with a next-n block (`dflash tiny-model --mtp`)."""
    d = tmp_path_factory.mktemp("drafters")
    run_dflash("tiny-model", "--weights", "f32", "--out", d / "tiny-f32.gguf", check=True)
    run_dflash("tiny-model", "--mtp", "--out", d / "tiny-mtp.gguf", check=True)
    return {"f32": str(d / "tiny-f32.gguf"), "mtp": str(d / "tiny-mtp.gguf")}


def test_draft_model_speculation_is_identical_to_plain_solo_cold_runs(tiny_drafters):
    """A model-based drafter: the tiny model's f32 weights drafting for its MXFP4 weights (the same
    vocabulary; they disagree where quantization moves an argmax, so drafts are accepted and
    rejected), on DeepSeek-V4's checkpoint restores, at --parallel 1 and 4 with cache hits."""
    out = _spec_qualify("--spec", f"draft:{tiny_drafters['f32']}", *SPEC_QUALIFY)
    assert out["system_fingerprint"].endswith("-spec-draft-" + file_sha256(tiny_drafters["f32"])[:16])
    for c in out["configs"]:
        _speculated(c)


@pytest.mark.long
def test_the_stock_twin_of_draft_model_speculation_differs(tiny_drafters):
    """Stock llama.cpp with the same drafter: cold first requests at --parallel 1 (prefilled as
    their solo cold runs are) differ from those runs. (Long job: CI's job keeps the n-gram twin,
    the same comparison.)"""
    _speculated(_stock_twin("--spec", f"draft:{tiny_drafters['f32']}", *SPEC_QUALIFY))


def test_mtp_speculation_on_a_next_n_block_is_identical_to_plain_solo_cold_runs(tiny_drafters):
    """`--spec mtp` on the tiny model with a next-n block (its main blocks are the built-in tiny
    model's): llama-server drafts with the block and rolls DeepSeek-V4's cache back by up to
    n_rs_seq positions. The block's weights are random, so it almost never agrees with the model
    (about 1 draft in 1,000 accepted): the test proves verification and rollback exact, not a good
    drafter."""
    out = _spec_qualify("--model", tiny_drafters["mtp"], "--spec", "mtp", *SPEC_QUALIFY)
    assert out["system_fingerprint"].endswith("-spec-mtp")
    for c in out["configs"]:
        s = c["speculation"]
        assert s["draft_tokens"] > 0 and s["draft_rejected"] > 0, s
        print(f"--parallel {c['config']['parallel']} --spec mtp: {s['draft_accepted']} of {s['draft_tokens']} "
              f"drafted tokens accepted")


@pytest.mark.long
def test_the_stock_twin_of_mtp_speculation_differs(tiny_drafters):
    """Stock llama.cpp drafting with the same next-n block. (Long job, as the draft twin.)"""
    assert _stock_twin("--model", tiny_drafters["mtp"], "--spec", "mtp", *SPEC_QUALIFY)["speculation"][
        "draft_tokens"] > 0


def test_qualify_serve_real_gguf_with_ngram_speculation(gemma):
    """Gemma 3 270M, n-gram speculation with llama-server's default lookup of dflash serve (4 tokens),
    identical to plain solo cold runs at --parallel 1 and 4; the repeating prompt's drafts are accepted."""
    out = _spec_qualify("--model", gemma, "--spec", "ngram", "--parallel", "4", "--max-tokens", "24",
                        "--prefix-words", "120", "--ctx", "2048", *THREADS, extra=["--chat-template", "gemma"])
    for c in out["configs"]:
        _speculated(c)
        repeat = next(v for v in c["verdicts"] if v["call"] == "repeat")
        assert repeat["draft_accepted"] > 0


# ---- a real GGUF ---------------------------------------------------------------------------------



@pytest.mark.long
def test_qualify_serve_real_gguf_with_a_chat_template(gemma):
    """Gemma 3 (sliding-window attention; this GGUF carries no template, llama.cpp's built-in gemma
    one has special turn tokens): --parallel 1 and 4 exact. (Long job: CI's job runs the same
    workload with n-gram speculation, test_qualify_serve_real_gguf_with_ngram_speculation, whose
    servers run this configuration and speculate.)"""
    r = run_dflash("qualify", "--serve", "--model", gemma, "--parallel", "4", "--max-tokens", "8",
                   "--prefix-words", "120", "--ctx", "2048", *THREADS, "--json", "--", "--chat-template", "gemma")
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout)
    assert out["exact"] is True
    for c in out["configs"]:
        assert c["responses"] == c["identical_to_solo"] == c["identical_to_prefill"] == 15
        assert any(v["call"].startswith("chat") for v in c["verdicts"])


def test_the_library_check_names_a_libllama_from_elsewhere(tmp_path):
    """check_libraries reads /proc/PID/maps: a process that mapped the exact library passes for its
    folder and fails for another (here the stock library's), naming the file."""
    exact, stock = build.library_dir("exact"), build.library_dir("stock")
    lib = str(exact / "libllama.so")
    code = f"import ctypes, time; ctypes.CDLL({lib!r}); print('up', flush=True); time.sleep(60)"
    p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True,
                         env={**os.environ, "LD_LIBRARY_PATH": str(exact)})
    try:
        assert p.stdout.readline().strip() == "up"
        server.check_libraries(p.pid, str(exact))
        with pytest.raises(Exception, match=r"libllama\.so.* from .*exact-"):
            server.check_libraries(p.pid, str(stock))
    finally:
        p.kill()
        p.wait()
    bare = subprocess.Popen(["sleep", "60"])  # maps no llama.cpp (this test process may have loaded one)
    try:
        with pytest.raises(Exception, match="no libllama mapped"):
            server.check_libraries(bare.pid, str(exact))
    finally:
        bare.kill()
        bare.wait()
