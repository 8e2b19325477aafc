"""The small HTTP client dflash speaks to llama-server with: plain http.client on loopback, no
retries, a timeout on every call, and the response's JSON (or its error) as it came."""
from __future__ import annotations

import http.client
import json
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from dflash.core.errors import DflashError


@dataclass(frozen=True)
class Reply:
    """One HTTP answer: status and the parsed JSON body (None when it was not JSON), raw text."""
    status: int
    body: Any
    text: str


def _connection(url: str, timeout: float) -> tuple[http.client.HTTPConnection, str]:
    rest = url.split("://", 1)[-1]
    hostport, _, path = rest.partition("/")
    host, _, port = hostport.rpartition(":")
    return http.client.HTTPConnection(host, int(port), timeout=timeout), "/" + path


def request(url: str, body: bytes | None = None, method: str = "POST", headers: Mapping[str, str] | None = None,
            timeout: float = 120.0) -> Reply:
    """One request; the reply as it came (no retries)."""
    conn, path = _connection(url, timeout)
    try:
        hdrs = {"Content-Type": "application/json", **(headers or {})}
        conn.request(method, path, body=body, headers=hdrs)
        r = conn.getresponse()
        text = r.read().decode("utf-8", errors="replace")
    finally:
        conn.close()
    try:
        parsed = json.loads(text) if text else None
    except ValueError:
        parsed = None
    return Reply(r.status, parsed, text)


def post(url: str, payload: Any, headers: Mapping[str, str] | None = None, timeout: float = 120.0) -> Reply:
    return request(url, json.dumps(payload).encode(), "POST", headers, timeout)


def stream(url: str, payload: Any, headers: Mapping[str, str] | None = None,
           timeout: float = 120.0) -> Iterator[tuple[float, Any]]:
    """A streamed request: (seconds since sent, parsed event) per server-sent event until [DONE].
    A non-200 answer raises DflashError with its status and body."""
    conn, path = _connection(url, timeout)
    t0 = time.perf_counter()
    try:
        body = {**payload, "stream": True, "stream_options": {"include_usage": True}}  # usage in the last event
        conn.request("POST", path, body=json.dumps(body).encode(),
                     headers={"Content-Type": "application/json", **(headers or {})})
        r = conn.getresponse()
        if r.status != 200:
            raise DflashError(f"HTTP {r.status}: {r.read().decode('utf-8', errors='replace')[:300]}")
        for raw in r:
            line = raw.decode("utf-8", errors="replace").strip()
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            if data == "[DONE]":
                return
            yield time.perf_counter() - t0, json.loads(data)
    finally:
        conn.close()
