"""`dflash qualify --serve`: prove llama-server configurations exact for one build, model and device.

For each configuration (`--parallel` 1 and N by default) a server runs the mixed workload of
dflash/serving/serve_workload.py. Then a reference server (one slot, prompt cache off for every request)
answers each distinct request alone and cold, and `dflash prefill` (q1, in this process, the same
library flavor) computes each prompt's last-position logits and greedy response. A response is
identical when its token ids, logprobs (and top logprobs) and fingerprints equal its solo cold run
bit for bit, and its prompt, last-position logits and response tokens equal the prefill's. A
configuration is exact when every response is. Servers run one at a time; the prefill runs after
the last one stopped. With speculation (`--spec`) the configurations speculate and the reference
does not: a response with drafts is judged against the same request decoded without any.
"""
from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dflash.core.errors import DflashError
from dflash.core.results import Json
from dflash.core.sha_cache import file_sha256
from dflash.proof.evidence import EvidenceWriter
from dflash.serving import client, serve_config, serve_record, server
from dflash.serving import serve_workload as wl

Say = Callable[[str], None]


@dataclass(frozen=True)
class Target:
    """What the servers run: the llama-server binary, the flavor's library folder it loads, the
    model, and the extra llama-server options."""
    binary: str
    lib_dir: str
    model: str
    flavor: str
    library_key: str
    server_key: str
    model_sha256: str
    device: str = "cpu"
    extra: tuple[str, ...] = ()
    device_label: str = "cpu"  # the device and, for a GPU, its name and driver (what records and fingerprints key)
    checkpoints: bool = True   # False: llama-server restores no saved state (no checkpoints, no RAM cache; last)

    @property
    def fingerprint(self) -> str:
        return serve_config.fingerprint(self.flavor, self.library_key, self.server_key, self.model_sha256,
                                   self.device_label)

    def fingerprint_for(self, config: serve_config.ServeConfig) -> str:
        """The system_fingerprint of a server running `config`: the target's, and its speculation."""
        spec = config.spec
        draft = file_sha256(spec[len("draft:"):]) if spec.startswith("draft:") else None
        return serve_config.fingerprint(self.flavor, self.library_key, self.server_key, self.model_sha256,
                                        self.device_label, serve_config.spec_label(spec, draft))

    @property
    def build_id(self) -> str:
        """The library and server builds, as serve records name them."""
        return f"{self.library_key}+{self.server_key}"

    def argv(self, config: serve_config.ServeConfig, host: str, port: int) -> list[str]:
        return [self.binary, "-m", self.model, "--host", host, "--port", str(port), "--alias", Path(self.model).stem,
                "--no-webui", "--metrics", *config.args(),
                *serve_config.device_args(self.device, self.flavor), *self.extra,
                *([] if self.checkpoints else ["--ctx-checkpoints", "0", "--cache-ram", "0"])]

    def make_server(self, config: serve_config.ServeConfig, env: Mapping[str, str], host: str = "127.0.0.1",
               port: int | None = None, api_key: str | None = None, log_line: Say = lambda s: None) -> server.Server:
        """A llama-server for `config` (not started), on a free port unless one is given."""
        port = server.free_port(host) if port is None else port
        env = {**env, "DFLASH_SYSTEM_FINGERPRINT": self.fingerprint_for(config)}
        return server.Server(self.argv(config, host, port), host, port, env=env, log_line=log_line,
                             api_key=api_key, lib_dir=self.lib_dir)

    def start(self, config: serve_config.ServeConfig, env: Mapping[str, str], log_line: Say) -> server.Server:
        """A started llama-server for `config` on a free loopback port."""
        s = self.make_server(config, env, log_line=log_line)
        s.start()
        return s


@dataclass(frozen=True)
class Verdict:
    """One response against its references."""
    call: str
    wave: int
    stream: bool
    solo: bool
    prefill: bool
    cached_tokens: int
    why: str
    draft_tokens: int = 0
    draft_accepted: int = 0

    def to_json(self) -> Json:
        return {"call": self.call, "wave": self.wave, "stream": self.stream, "identical_to_solo": self.solo,
                "identical_to_prefill": self.prefill, "cached_tokens": self.cached_tokens, "why": self.why,
                "draft_tokens": self.draft_tokens, "draft_accepted": self.draft_accepted}


@dataclass(frozen=True)
class ConfigResult:
    config: serve_config.ServeConfig
    verdicts: tuple[Verdict, ...]

    @property
    def exact(self) -> bool:
        return bool(self.verdicts) and all(v.solo and v.prefill for v in self.verdicts)

    @property
    def drafts(self) -> tuple[int, int]:
        """Speculative decoding over the workload: (tokens drafted, tokens accepted)."""
        return sum(v.draft_tokens for v in self.verdicts), sum(v.draft_accepted for v in self.verdicts)

    def speculation_json(self) -> Json:
        drafted, accepted = self.drafts
        return {"spec": self.config.spec, "draft_tokens": drafted, "draft_accepted": accepted,
                "draft_rejected": drafted - accepted, "acceptance_rate": accepted / drafted if drafted else None}

    def entry(self, evidence_dir: str | None) -> serve_record.Entry:
        v = self.verdicts
        return serve_record.Entry(self.config, len(v), sum(x.solo for x in v), sum(x.prefill for x in v),
                                  sum(x.cached_tokens > 0 for x in v), self.exact, evidence_dir)

    def to_json(self) -> Json:
        return {"config": self.config.to_json(), "exact": self.exact, **self.entry(None).to_json(),
                "speculation": self.speculation_json(), "verdicts": [v.to_json() for v in self.verdicts]}


@dataclass(frozen=True)
class ServeQualifyResult:
    """`dflash qualify --serve`: every configuration's verdicts, the record and the evidence."""
    flavor: str
    model: str
    fingerprint: str
    configs: tuple[ConfigResult, ...]
    record_path: str
    evidence_dir: str
    manifest_sha256: str

    @property
    def exact(self) -> bool:
        return all(c.exact for c in self.configs)

    def to_json(self) -> Json:
        return {"flavor": self.flavor, "model": self.model, "system_fingerprint": self.fingerprint,
                "exact": self.exact, "configs": [c.to_json() for c in self.configs],
                "record": self.record_path, "evidence_dir": self.evidence_dir,
                "manifest_sha256": self.manifest_sha256}


def _prompt_ids(url: str, call: wl.Call) -> list[int]:
    """The token ids llama-server evaluates for a call (its chat template applied)."""
    if call.endpoint == wl.CHAT:
        r = client.post(url + "/apply-template", {"messages": call.body["messages"]})
        if r.status != 200:
            raise DflashError(f"llama-server /apply-template answered HTTP {r.status}: {r.text[:200]}")
        text = r.body["prompt"]
    else:
        text = call.body["prompt"]
    r = client.post(url + "/tokenize", {"content": text, "add_special": True, "parse_special": True})
    if r.status != 200:
        raise DflashError(f"llama-server /tokenize answered HTTP {r.status}: {r.text[:200]}")
    return [int(t) for t in r.body["tokens"]]


@dataclass(frozen=True)
class Prefilled:
    prompt_sha256: str
    logits_sha256: str
    tokens: tuple[int, ...]


def compare(run_calls: Sequence[wl.Call], responses: Sequence[wl.Response], solo: dict[str, wl.Response],
            prefilled: dict[str, Prefilled]) -> tuple[Verdict, ...]:
    """Each response against its solo cold run and dflash prefill (pure)."""
    out = []
    for call, r in zip(run_calls, responses, strict=True):
        ref, pre = solo.get(call.key()), prefilled.get(call.key())
        why = []
        if r.status != 200:
            why.append(f"HTTP {r.status}: {r.error[:120]}")
        is_solo = ref is not None and r.same_as(ref)
        if not is_solo and r.status == 200:
            if ref is None or ref.status != 200:
                why.append("no solo cold answer")
            else:
                why += [f"{name} differ from the solo cold run" for name, a, b in (
                    ("token ids", r.tokens, ref.tokens), ("logprobs", r.logprobs, ref.logprobs),
                    ("last-position logits", r.logits_sha256, ref.logits_sha256)) if a != b]
        is_pre = pre is not None and r.status == 200 and (r.prompt_sha256, r.logits_sha256, r.tokens) == (
            pre.prompt_sha256, pre.logits_sha256, pre.tokens)
        if not is_pre and r.status == 200 and pre is not None:
            why += [f"{name} differ from dflash prefill" for name, a, b in (
                ("prompt tokens", r.prompt_sha256, pre.prompt_sha256), ("last-position logits", r.logits_sha256,
                                                                         pre.logits_sha256),
                ("response tokens", r.tokens, pre.tokens)) if a != b]
        out.append(Verdict(call.name, call.wave, call.stream, is_solo, is_pre, r.cached_tokens, "; ".join(why),
                           r.draft_tokens, r.draft_accepted))
    return tuple(out)


def qualify_serve(target: Target, configs: Sequence[serve_config.ServeConfig], shape: wl.Shape,
                  prefill: Callable[[list[int], int], Prefilled], evidence_dir: Path,
                  argv: list[str] | None = None, log: Say = lambda s: None,
                  log_line: Say = lambda s: None, env: Mapping[str, str] | None = None) -> ServeQualifyResult:
    """Run the workload on each configuration, then the solo cold references, then prefill; write
    the evidence and the record."""
    env = dict(os.environ if env is None else env)
    runs: list[tuple[serve_config.ServeConfig, wl.Run]] = []
    for config in configs:
        spec = f" --spec {config.spec}" if config.spec != serve_config.NO_SPEC else ""
        log(f"llama-server --parallel {config.parallel} --ubatch {config.ubatch}{spec}: the mixed workload")
        s = target.start(config, env, log_line)
        try:
            runs.append((config, wl.run_workload(s.url, shape, progress=log)))
        finally:
            s.close()
    distinct: dict[str, wl.Call] = {}
    for _, run in runs:
        for c in run.calls:
            distinct.setdefault(c.key(), c)
    first = configs[0]
    reference = serve_config.ServeConfig(1, first.ubatch, first.ctx, first.threads, first.flash_attn)
    log(f"reference: {len(distinct)} distinct requests, each alone on a one-slot server with the prompt cache off"
        + (" and no speculation" if any(c.spec != serve_config.NO_SPEC for c in configs) else ""))
    s = target.start(reference, env, log_line)
    try:
        solo = {k: wl.send(s.url, wl.Call(c.name, c.endpoint, c.body), extra={"cache_prompt": False})
                for k, c in distinct.items()}
        ids = {k: _prompt_ids(s.url, c) for k, c in distinct.items()}
    finally:
        s.close()
    log(f"dflash prefill (q1) of {len(ids)} prompts")
    prefilled = {k: prefill(ids[k], int(distinct[k].body["max_tokens"])) for k in distinct}
    results = tuple(ConfigResult(config, compare(run.calls, run.responses, solo, prefilled)) for config, run in runs)
    with EvidenceWriter(evidence_dir, "serve-qualify") as ev:
        ev.write_json("target.json", {"binary": target.binary, "lib_dir": target.lib_dir, "model": target.model,
                                      "flavor": target.flavor, "library_key": target.library_key,
                                      "server_key": target.server_key, "model_sha256": target.model_sha256,
                                      "device": target.device, "device_label": target.device_label,
                                      "extra": list(target.extra),
                                      "system_fingerprint": target.fingerprint, "argv": argv})
        ev.write_json("solo.json", {k: r.to_json() for k, r in solo.items()})
        ev.write_json("prefill.json", {k: {"prompt_tokens": ids[k], "prompt_sha256": p.prompt_sha256,
                                           "logits_sha256": p.logits_sha256, "response_tokens": list(p.tokens)}
                                       for k, p in prefilled.items()})
        for i, (config, run) in enumerate(runs):
            ev.write_json(f"run-{i}-parallel-{config.parallel}.json", {
                "config": config.to_json(), "calls": [c.to_json() for c in run.calls],
                "responses": [r.to_json() for r in run.responses]})
        ev.write_json("verdicts.json", [c.to_json() for c in results])
        final, manifest = ev.commit()
    identity = serve_record.Identity(target.flavor, target.build_id, target.model_sha256, target.device_label)
    record = serve_record.save(identity, target.model, [c.entry(str(final)) for c in results])
    return ServeQualifyResult(target.flavor, target.model, target.fingerprint_for(first), results,
                              str(serve_record.record_path(record.identity)), str(final), manifest)


def prefill_with(session: Any) -> Callable[[list[int], int], Prefilled]:
    """dflash prefill (q1, last-position logits) through a dflash.Session."""
    def run(ids: list[int], n_predict: int) -> Prefilled:
        r = session.prefill(ids, n_predict=n_predict, logits="last")
        return Prefilled(r.prompt_sha256, r.logits_sha256, tuple(r.response_tokens))
    return run
