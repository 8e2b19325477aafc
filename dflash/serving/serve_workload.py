"""The fixed mixed workload `dflash qualify --serve` and benchmarks/serve.py send to llama-server,
and what a response is, as dflash compares it.

A workload is a set of clients, one thread each, starting at their own delays so that prompts of
different lengths arrive while others decode. A client's first call is cold: prompts that share a
long prefix, unrelated short and long prompts, streaming and not, completions and (with a chat
template) chat. Its follow-ups (wave 1) go out as soon as its answer arrived and are what a prompt
cache serves: a repeat, a sibling on the shared prefix, a conversation's second turn (built from
the reply it got), a new question under the same system prompt. Every call is greedy
(temperature 0) and asks for logprobs. `run_wave` sends a plain list of calls at their delays.
"""
from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from dflash.core.errors import DflashError
from dflash.core.results import Json
from dflash.serving import client

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
    draft_tokens: int = 0     # speculative decoding: tokens drafted for this response (llama-server's timings)
    draft_accepted: int = 0   # of those, accepted by the target

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
                "first_token_seconds": self.first_token_seconds, "error": self.error,
                "draft_tokens": self.draft_tokens, "draft_accepted": self.draft_accepted}


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
    system, timings = "", dict[str, Any]()
    for c in chunks:
        for choice in c.get("choices") or ():
            text += _piece(choice)
            lps += _logprobs(((choice.get("logprobs") or {}).get("content")) or ())
            finish = choice.get("finish_reason") or finish
        fp = c.get("dflash", fp)
        usage = c.get("usage", usage)
        system = c.get("system_fingerprint", system)
        timings = c.get("timings") or timings
    if fp is None:
        return Response(call.name, status, seconds=seconds, error="the response carries no dflash fingerprints")
    usage = usage or {}
    details = usage.get("prompt_tokens_details") or {}
    return Response(call.name, status, tuple(fp["response_tokens"]), tuple(lps), text, fp["logits_sha256"],
                    fp["prompt_sha256"], fp["response_tokens_sha256"], system, int(usage.get("prompt_tokens", 0)),
                    int(details.get("cached_tokens", 0)), finish, seconds, first,
                    draft_tokens=int(timings.get("draft_n", 0)), draft_accepted=int(timings.get("draft_n_accepted", 0)))


def send(url: str, call: Call, headers: Mapping[str, str] | None = None, timeout: float = 300.0,
         extra: Mapping[str, Any] | None = None) -> Response:
    """Send one call and read its answer (a failure is a Response with status 0 and the error)."""
    body = {**call.body, **(extra or {})}
    t0 = time.perf_counter()
    try:
        if not call.stream:
            reply = client.post(url + call.endpoint, body, headers, timeout)
            seconds = time.perf_counter() - t0
            if reply.status != 200 or not isinstance(reply.body, dict):
                return Response(call.name, reply.status, seconds=seconds, error=reply.text[:300])
            return _from_parts(call, 200, [reply.body], seconds, None)
        chunks, first = [], None
        for at, event in client.stream(url + call.endpoint, body, headers, timeout):
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
    """The sizes of a workload: shared prefix (words), tokens per response, chat or not."""
    prefix_words: int = 300
    max_tokens: int = 16
    chat: bool = False
    seed: int = 1
    repeat: bool = False  # also a prompt whose continuation repeats its own text (what n-gram drafts predict)


Next = Callable[[Call, Response], Call]  # a client's next call, made from its previous call and answer


@dataclass(frozen=True)
class Client:
    """One client: its first call at `delay`, then each follow-up as soon as the previous answer
    arrived (a repeat, a sibling on the same prefix, a conversation's next turn)."""
    delay: float
    first: Call
    then: tuple[Next, ...] = ()


def _again(name: str, stream: bool) -> Next:
    return lambda prev, r: replace(prev, name=name, stream=stream, wave=1)


def clients(shape: Shape) -> list[Client]:
    """The fixed mixed workload: clients sharing a long prefix, unrelated short and long prompts,
    streaming and not; each follows up with a repeat (a full-prompt cache hit), a sibling on the
    shared prefix, or (chat) a second turn and a new question under the same system prompt."""
    prefix, n = words(shape.prefix_words, shape.seed), shape.max_tokens

    def comp(name: str, prompt: str, stream: bool = False) -> Call:
        return Call(name, COMPLETIONS, _completion(prompt, n), stream=stream)

    def sibling(name: str, k: int, stream: bool) -> Next:
        return lambda prev, r: replace(comp(name, f"{prefix} {words(k, 300 + k)}", stream), wave=1)

    out = [Client(0.0, comp("shared-0", f"{prefix} {words(6, 100)}", True), (_again("shared-0-again", False),)),
           Client(0.1, comp("shared-1", f"{prefix} {words(40, 101)}"), (sibling("shared-1-sibling", 25, True),)),
           Client(0.05, comp("short", words(5, 7)), (_again("short-again", True),)),
           Client(0.3, comp("long", words(shape.prefix_words // 2, 8), True)),
           Client(0.35, comp("medium", words(60, 9)), (_again("medium-again", True),)),
           Client(0.2, comp("shared-2", f"{prefix} {words(15, 102)}"), (sibling("shared-2-sibling", 70, False),))]
    if shape.repeat:
        out.append(Client(0.4, comp("repeat", " ".join([words(8, 500)] * 8)), (_again("repeat-again", True),)))
    if shape.chat:
        def chat(name: str, user: str, stream: bool, history: tuple[dict[str, str], ...] = ()) -> Call:
            msgs = [{"role": "system", "content": prefix}, *history, {"role": "user", "content": user}]
            return Call(name, CHAT, _chat(msgs, n), stream=stream)

        def turn2(prev: Call, r: Response) -> Call:
            history = ({"role": "user", "content": prev.body["messages"][-1]["content"]},
                       {"role": "assistant", "content": r.text})
            return replace(chat("chat-0-turn-2", words(10, 400), True, history), wave=1)

        out += [Client(0.15, chat("chat-0", words(12, 200), False), (turn2,)),
                Client(0.25, chat("chat-1", words(21, 201), True),
                       (lambda prev, r: replace(chat("chat-1-new-question", words(9, 401), False), wave=1),))]
    return out


@dataclass
class Run:
    """A workload as run against one server: the calls and their answers, in the order sent."""
    calls: list[Call] = field(default_factory=list)
    responses: list[Response] = field(default_factory=list)


def run_workload(url: str, shape: Shape, headers: Mapping[str, str] | None = None,
                 progress: Callable[[str], None] = lambda s: None) -> Run:
    """Every client on its own thread, each starting at its delay; follow-ups right after answers."""
    cs = clients(shape)
    progress(f"{len(cs)} clients, {sum(1 + len(c.then) for c in cs)} requests")
    run, lock, t0 = Run(), threading.Lock(), time.monotonic()

    def one(c: Client) -> None:
        time.sleep(max(0.0, c.delay - (time.monotonic() - t0)))
        call, answer = c.first, send(url, c.first, headers)
        for step in (None, *c.then):
            if step is not None:
                call = step(call, answer)
                answer = send(url, call, headers)
            with lock:
                run.calls.append(call)
                run.responses.append(answer)

    threads = [threading.Thread(target=one, args=(c,), daemon=True) for c in cs]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    return run
