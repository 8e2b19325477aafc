"""The fixed mixed workload `dflash qualify --serve` and benchmarks/serve.py send to llama-server,
and what a response is, as dflash compares it.

A workload is a list of `Call`s in waves: in each wave the calls start at their own delays, so
prompts of different lengths arrive while others decode; up to one client thread per call. Wave 0
is cold: prompts that share a long prefix, unrelated short and long prompts, streaming and not,
completions and (with a chat template) chat. Wave 1 hits the prompt cache: repeats of wave-0
prompts, new prompts on the shared prefix, and the second turn of wave-0 conversations (built from
the reply wave 0 got). Every call is greedy (temperature 0) and asks for logprobs.
"""
from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from . import server as server_mod
from .errors import DflashError
from .results import Json

COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"
TOP_LOGPROBS = 2

_WORDS = ("band", "width", "token", "layer", "kernel", "prefix", "cache", "slot", "exact", "order", "sum", "row",
          "column", "block", "scale", "expert", "router", "window", "pool", "index", "query", "key", "value",
          "head", "model", "server", "client", "stream", "batch", "step", "prompt", "reply", "fast", "slow",
          "river", "stone", "green", "quiet", "north", "seven", "paper", "glass", "light", "music", "garden",
          "winter", "bridge", "market", "window", "silver", "forest", "engine", "signal", "number", "letter")


def words(n: int, seed: int) -> str:
    """n space-separated words, the same for the same seed."""
    rng = random.Random(seed)
    return " ".join(rng.choice(_WORDS) for _ in range(n))


@dataclass(frozen=True)
class Call:
    """One request of a workload: where, what (the body without `stream`), streamed or not, when
    (seconds after its wave starts) and in which wave."""
    name: str
    endpoint: str
    body: Mapping[str, Any]
    stream: bool = False
    delay: float = 0.0
    wave: int = 0

    def key(self) -> str:
        """What makes two calls the same request (streaming does not change the answer)."""
        import json
        return self.endpoint + " " + json.dumps(self.body, sort_keys=True)

    def to_json(self) -> Json:
        return {"name": self.name, "endpoint": self.endpoint, "body": dict(self.body), "stream": self.stream,
                "delay": self.delay, "wave": self.wave}


@dataclass(frozen=True)
class Response:
    """What a response said, as dflash compares it: the generated ids and their logprobs (and top
    logprobs), the fingerprints of the server's patch, the cache use and the timing."""
    call: str
    status: int
    tokens: tuple[int, ...] = ()
    logprobs: tuple[tuple[Any, ...], ...] = ()  # (id, logprob, ((id, logprob), ...)) per token
    text: str = ""
    logits_sha256: str = ""
    prompt_sha256: str = ""
    response_tokens_sha256: str = ""
    system_fingerprint: str = ""
    prompt_tokens: int = 0
    cached_tokens: int = 0
    finish_reason: str = ""
    seconds: float = 0.0
    first_token_seconds: float | None = None
    error: str = ""

    def same_as(self, other: Response) -> bool:
        """Bit for bit the same answer: ids, logprobs, logits and prompt fingerprints."""
        return self.status == 200 and other.status == 200 and (
            self.tokens, self.logprobs, self.logits_sha256, self.prompt_sha256, self.response_tokens_sha256) == (
            other.tokens, other.logprobs, other.logits_sha256, other.prompt_sha256, other.response_tokens_sha256)

    def to_json(self) -> Json:
        return {"call": self.call, "status": self.status, "tokens": list(self.tokens),
                "logprobs": [[i, lp, [list(t) for t in top]] for i, lp, top in self.logprobs], "text": self.text,
                "logits_sha256": self.logits_sha256, "prompt_sha256": self.prompt_sha256,
                "response_tokens_sha256": self.response_tokens_sha256, "system_fingerprint": self.system_fingerprint,
                "prompt_tokens": self.prompt_tokens, "cached_tokens": self.cached_tokens,
                "finish_reason": self.finish_reason, "seconds": self.seconds,
                "first_token_seconds": self.first_token_seconds, "error": self.error}


def _logprobs(entries: Sequence[Mapping[str, Any]]) -> list[tuple[Any, ...]]:
    return [(e.get("id"), e.get("logprob"), tuple((t.get("id"), t.get("logprob")) for t in e.get("top_logprobs", ())))
            for e in entries]


def _piece(choice: Mapping[str, Any]) -> str:
    if "text" in choice:
        return str(choice.get("text") or "")
    delta = choice.get("delta") or choice.get("message") or {}
    return str(delta.get("content") or "")


def _from_parts(call: Call, status: int, chunks: Sequence[Mapping[str, Any]], seconds: float,
                first: float | None) -> Response:
    text, lps, fp, usage, finish = "", [], None, None, ""
    system = ""
    for c in chunks:
        for choice in c.get("choices") or ():
            text += _piece(choice)
            lps += _logprobs(((choice.get("logprobs") or {}).get("content")) or ())
            finish = choice.get("finish_reason") or finish
        fp = c.get("dflash", fp)
        usage = c.get("usage", usage)
        system = c.get("system_fingerprint", system)
    if fp is None:
        return Response(call.name, status, seconds=seconds, error="the response carries no dflash fingerprints")
    usage = usage or {}
    details = usage.get("prompt_tokens_details") or {}
    return Response(call.name, status, tuple(fp["response_tokens"]), tuple(lps), text, fp["logits_sha256"],
                    fp["prompt_sha256"], fp["response_tokens_sha256"], system, int(usage.get("prompt_tokens", 0)),
                    int(details.get("cached_tokens", 0)), finish, seconds, first)


def send(url: str, call: Call, headers: Mapping[str, str] | None = None, timeout: float = 300.0,
         extra: Mapping[str, Any] | None = None) -> Response:
    """Send one call and read its answer (a failure is a Response with status 0 and the error)."""
    body = {**call.body, **(extra or {})}
    t0 = time.perf_counter()
    try:
        if not call.stream:
            reply = server_mod.post(url + call.endpoint, body, headers, timeout)
            seconds = time.perf_counter() - t0
            if reply.status != 200 or not isinstance(reply.body, dict):
                return Response(call.name, reply.status, seconds=seconds, error=reply.text[:300])
            return _from_parts(call, 200, [reply.body], seconds, None)
        chunks, first = [], None
        for at, event in server_mod.stream(url + call.endpoint, body, headers, timeout):
            chunks.append(event)
            if first is None and any(_piece(c) or (c.get("logprobs") or {}).get("content")
                                     for c in event.get("choices") or ()):
                first = at
        return _from_parts(call, 200, chunks, time.perf_counter() - t0, first)
    except (OSError, ValueError, DflashError) as e:
        return Response(call.name, 0, seconds=time.perf_counter() - t0, error=f"{type(e).__name__}: {e}")


def run_wave(url: str, calls: Sequence[Call], headers: Mapping[str, str] | None = None,
             extra: Mapping[str, Any] | None = None) -> list[Response]:
    """Every call of a wave on its own client thread, each started at its delay; answers in call order."""
    out: list[Response | None] = [None] * len(calls)
    t0 = time.monotonic()

    def one(i: int, c: Call) -> None:
        time.sleep(max(0.0, c.delay - (time.monotonic() - t0)))
        out[i] = send(url, c, headers, extra=extra)

    threads = [threading.Thread(target=one, args=(i, c), daemon=True) for i, c in enumerate(calls)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return [r for r in out if r is not None]


def _completion(prompt: str, max_tokens: int) -> dict[str, Any]:
    return {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "logprobs": TOP_LOGPROBS}


def _chat(messages: list[dict[str, str]], max_tokens: int) -> dict[str, Any]:
    return {"messages": messages, "max_tokens": max_tokens, "temperature": 0, "logprobs": True,
            "top_logprobs": TOP_LOGPROBS}


@dataclass(frozen=True)
class Shape:
    """The sizes of a workload: shared prefix and suffix lengths (words), tokens per response."""
    prefix_words: int = 300
    max_tokens: int = 16
    chat: bool = False
    seed: int = 1


def first_wave(shape: Shape) -> list[Call]:
    prefix = words(shape.prefix_words, shape.seed)
    calls = []
    for i, n in enumerate((6, 40, 15, 70)):  # shared prefix, suffixes of different lengths
        calls.append(Call(f"w0-shared-{i}", COMPLETIONS, _completion(f"{prefix} {words(n, 100 + i)}", shape.max_tokens),
                          stream=i % 2 == 1, delay=0.15 * i))
    calls.append(Call("w0-short", COMPLETIONS, _completion(words(5, 7), shape.max_tokens), delay=0.05))
    calls.append(Call("w0-long", COMPLETIONS, _completion(words(shape.prefix_words // 2, 8), shape.max_tokens),
                      stream=True, delay=0.3))
    if shape.chat:
        for i in range(2):
            msgs = [{"role": "system", "content": prefix}, {"role": "user", "content": words(12 + 9 * i, 200 + i)}]
            calls.append(Call(f"w0-chat-{i}", CHAT, _chat(msgs, shape.max_tokens), stream=i == 1, delay=0.2 + 0.2 * i))
    return calls


def second_wave(shape: Shape, first: Sequence[Call], replies: Mapping[str, Response]) -> list[Call]:
    """Cache hits: repeats, the shared prefix with new suffixes, second turns of the conversations."""
    prefix = words(shape.prefix_words, shape.seed)
    by = {c.name: c for c in first}
    calls = [replace(by["w0-shared-0"], name="w1-repeat-0", stream=True, delay=0.0, wave=1),
             replace(by["w0-shared-1"], name="w1-repeat-1", stream=False, delay=0.1, wave=1),
             replace(by["w0-short"], name="w1-repeat-short", delay=0.05, wave=1)]
    for i, n in enumerate((25, 3)):
        calls.append(Call(f"w1-shared-new-{i}", COMPLETIONS, _completion(f"{prefix} {words(n, 300 + i)}",
                                                                          shape.max_tokens),
                          stream=i == 0, delay=0.2 + 0.1 * i, wave=1))
    if shape.chat:
        for i in range(2):
            name = f"w0-chat-{i}"
            msgs = [*by[name].body["messages"], {"role": "assistant", "content": replies[name].text},
                    {"role": "user", "content": words(10, 400 + i)}]
            calls.append(Call(f"w1-chat-turn2-{i}", CHAT, _chat(msgs, shape.max_tokens), stream=i == 0,
                              delay=0.15 * i, wave=1))
    return calls


@dataclass
class Run:
    """A workload as run against one server: the calls and their answers, in order."""
    calls: list[Call] = field(default_factory=list)
    responses: list[Response] = field(default_factory=list)


def run_workload(url: str, shape: Shape, headers: Mapping[str, str] | None = None,
                 progress: Callable[[str], None] = lambda s: None) -> Run:
    run = Run()
    wave0 = first_wave(shape)
    progress(f"wave 0: {len(wave0)} requests, cold")
    r0 = run_wave(url, wave0, headers)
    run.calls += wave0
    run.responses += r0
    replies = {r.call: r for r in r0}
    wave1 = second_wave(shape, wave0, replies)
    progress(f"wave 1: {len(wave1)} requests, prompt-cache hits")
    run.calls += wave1
    run.responses += run_wave(url, wave1, headers)
    return run
