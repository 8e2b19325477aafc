"""dflash as a library: a Session owns one llama.cpp model (and its context) and runs requests.

    import dflash

    with dflash.Session(chunk=4, bands=True) as s:     # the built-in tiny DeepSeek-V4 model
        r = s.prefill("The band scheduler", compare_q1=True)
        print(r.logits_sha256, r.comparison.identical)

Everything the CLI runs goes through here: the CLI parses flags, opens a Session and renders the
typed result. A Session
  * reads no environment and writes none after the library is loaded: the flags come from
    `settings` (Settings.from_env() reads them, as the CLI does; default: none set). Only the
    qualification records look at the process environment: the kernel switches llama.cpp itself
    reads there (GGML_CPU_TILED_MM, ...; dflash/native/graph_switches.py) are part of a record's key;
  * builds nothing unless asked: a library that is not built raises LibraryNotBuilt naming
    `dflash build` (build=True builds it, as the CLI does);
  * chooses the width in one place (dflash/proof/choice.py): chunk 1..4, or N > 4 and "auto" from the
    qualification record of this library, model and device, within `memory_budget`; a request
    whose prompt is longer than the record covers falls back, or is refused (records.for_prompt);
  * reports warnings through `warn` (and keeps them in `warnings`), notes through `log`;
  * raises typed errors (dflash.core.errors) that speak of its arguments.

One process loads one llama.cpp library, and the flags it reads once (settings.library_env): a
second Session in the same process must use the same library and flags. To compare libraries,
run a Session in a worker process (dflash.worker.Worker).
"""
from __future__ import annotations

import codecs
import contextlib
import math
import os
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from dflash.core.errors import UsageError, arg
from dflash.core.results import BenchResult, Json, Library, MemoryResult, PrefillResult, QualifyResult
from dflash.core.settings import ENV_BANDS, ENV_TILE, MAX_CHUNK, Chunk, Settings
from dflash.model import tiny_model
from dflash.native import devices, llama
from dflash.native import rpc as rpc_mod
from dflash.proof import bench as bench_mod
from dflash.proof import choice, evidence, provenance, qualify, records
from dflash.run import bands as bands_mod
from dflash.run import engine, memory, prefill, speculate

Say = Callable[[str], None]
Progress = Callable[[int, int], None]
Prompt = str | Sequence[int] | None  # text, token ids, or None for the built-in prompt


def _quiet(msg: str) -> None:
    pass


def _no_progress(done: int, total: int) -> None:
    pass


@dataclass(frozen=True)
class Token:
    """One generated token: its id, its text piece (bytes decoded as UTF-8 across pieces; a piece
    that ends inside a character yields "" and the rest comes with the next) and its log-probability
    under the logits it was chosen from (float64 log-softmax)."""
    id: int
    text: str
    piece: bytes
    logprob: float

    def to_json(self) -> Json:
        return {"id": self.id, "text": self.text, "piece_hex": self.piece.hex(), "logprob": self.logprob}


def logprob(logits: np.ndarray, token: int) -> float:
    """log softmax(logits)[token] in float64."""
    x = logits.astype(np.float64)
    m = float(x.max())
    return float(x[token] - m - math.log(float(np.exp(x - m).sum())))


class Session:
    """One llama.cpp model on one device with one library, and the width choice for its requests.

    model:         a GGUF path, or None for the built-in tiny DeepSeek-V4 model (`weights` preset)
    lib:           "exact" (batch-invariant) or "stock" (llama.cpp's defaults)
    device:        "cpu", "hip:N", "cuda:N", "vulkan:N", "rpc:N", or several joined by commas
    threads:       CPU threads (default: min(cores, 8))
    chunk:         1..4, or 5..4096 / "auto" with a qualification record (implies bands)
    bands:         True opts in to bands (q1 otherwise, unless the settings' flags opt in)
    memory_budget: bytes (or "96GiB") the run may allocate; `ctx` (or `budget_prompt`) sizes it
    rpc:           RPC servers ("HOST:PORT,..." or a sequence) whose devices rpc:N names
    settings:      the environment flags (Settings.from_env()); default: none set
    build:         build a library that is not built yet (else LibraryNotBuilt)
    no_alloc:      load metadata and shapes only (llama.cpp's no_alloc): for memory() estimates
    max_band:      the widest band a context is made for (default: each request's widest band)
    indexer_tile:  DeepSeek-V4's indexer scores and top-k over N query rows at a time (0: the whole
                   ubatch; default: the settings' DFLASH_DS4_INDEXER_TILE); bit-identical, smaller scratch
    """

    def __init__(self, model: str | os.PathLike[str] | None = None, *, weights: str = tiny_model.DEFAULT_WEIGHTS,
                 lib: str = "exact", device: str = "cpu", threads: int | None = None, ctx: int | None = None,
                 chunk: Chunk | None = None, bands: bool | None = None, memory_budget: int | str | None = None,
                 budget_prompt: Prompt = None, budget_n_predict: int = 16,
                 rpc: str | Sequence[str] | None = None, allow_mixed_builds: bool = False, repack: bool = True,
                 settings: Settings | None = None, build: bool = False, no_alloc: bool = False, mmap: bool = True,
                 max_band: int | None = None, indexer_tile: int | None = None, log: Say = _quiet,
                 warn: Say = _quiet):
        self._engine: engine.Engine | None = None
        self._context: llama.Context | None = None
        model_path = None if model is None else os.fspath(model)
        if weights not in tiny_model.WEIGHTS:
            raise UsageError(f"{arg('weights')} {weights!r} is unknown (use one of {', '.join(tiny_model.WEIGHTS)})")
        if max_band is not None and not 1 <= max_band <= MAX_CHUNK:
            raise UsageError(f"{arg('max_band')} {max_band} is outside 1..{MAX_CHUNK}")
        env = settings.env if settings is not None else {}
        if indexer_tile is not None:
            if isinstance(indexer_tile, bool) or not isinstance(indexer_tile, int):
                raise UsageError(f"{arg('indexer_tile')} {indexer_tile!r} is not an integer")
            env = {**env, ENV_TILE: str(indexer_tile)}  # checked with the other flags (settings.resolve)
        self.log, self.warn, self.ctx, self.max_band = log, warn, ctx, max_band
        self.remote = rpc_mod.connect(_endpoints(rpc), devices.parse_spec(device).rpc_ids, allow_mixed_builds)
        budget = None
        if memory_budget is not None:
            limit = memory_budget if isinstance(memory_budget, int) else memory.parse_size(memory_budget)
            if isinstance(limit, bool) or limit <= 0:
                raise UsageError(f"{arg('memory_budget')} {memory_budget!r} must be more than 0 bytes")
            budget = choice.open_budget(env, choice.BudgetRequest(limit, ctx, budget_prompt, budget_n_predict),
                                        bands=bands, chunk=chunk, lib=lib, model=model_path, weights=weights,
                                        device=device, remote=self.remote, repack=repack, threads=threads,
                                        build=build, log=log)
        try:
            self.settings = choice.choose(env, bands=bands, chunk=chunk, lib=lib, model=model_path, weights=weights,
                                          device=device, remote=self.remote, repack=repack, budget=budget,
                                          warn=warn, note=log)
            self.memory_budget: Json | None = budget.to_json(self.settings.cap) if budget is not None else None
        finally:
            if budget is not None:
                budget.close()  # the estimate's model is freed before the run loads its own
        self.warnings: list[str] = []
        self._warn_all(self.settings.warnings())
        self._engine = engine.open_engine(self.settings, model_path, threads=threads, weights=weights, device=device,
                                          remote=self.remote, repack=repack, no_alloc=no_alloc, mmap=mmap,
                                          build_missing=build, log=log)
        self.no_alloc = no_alloc
        self._warn_all(self._engine.narrow_warnings())

    def _warn_all(self, msgs: Iterable[str]) -> None:
        for w in msgs:
            self.warnings.append(w)
            self.warn(w)

    # -- ownership --------------------------------------------------------------------------

    @property
    def engine(self) -> engine.Engine:
        """The loaded library, model and placement (open until close())."""
        if self._engine is None:
            raise UsageError("this Session is closed")
        return self._engine

    def close(self) -> None:
        """Free the context and the model (idempotent)."""
        try:
            if self._context is not None:
                self._context.close()
        finally:
            self._context = None
            if self._engine is not None:
                self._engine.close()
                self._engine = None

    def __enter__(self) -> Session:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # noqa: BLE001 -- nothing to report to at interpreter exit
            pass

    def context(self, n_ctx: int, max_band: int) -> llama.Context:
        """The session's context for a request: reused while it has this size and band width
        (prefill clears it), else replaced."""
        band = max(max_band, self.max_band or 1)
        c = self._context
        if c is not None and (c.n_ctx, c.max_band) == (n_ctx, band):
            return c
        if c is not None:
            self._context = None
            c.close()
        if self.no_alloc:
            raise UsageError(f"this Session loaded no weights ({arg('no_alloc')}=True): it can only size memory")
        self._context = self.engine.context(n_ctx, band)
        return self._context

    # -- facts ------------------------------------------------------------------------------

    @property
    def library(self) -> Library:
        return Library(self.settings.lib, str(self.engine.lib_dir), self.settings.cpu)

    @property
    def threads(self) -> int:
        return self.engine.threads

    @property
    def model_path(self) -> Path:
        return Path(self.engine.info.path)

    def info(self) -> Json:
        """What the session runs on: model, library, device, threads, context limits."""
        e = self.engine
        return {"model": str(e.info.path), "architecture": e.info.architecture, "library": self.library.to_json(),
                "device": e.device, "devices": [dict(d) for d in e.placement], "threads": e.threads,
                "n_ctx_train": e.model.n_ctx_train, "context_length": e.info.context_length,
                "bands_on": self.settings.bands, "chunk": self.settings.chunk, "warnings": list(self.warnings)}

    def tokenize(self, prompt: Prompt = None) -> list[int]:
        """Token ids of a prompt (text; ids pass through checked; None: the built-in prompt)."""
        if prompt is None or isinstance(prompt, str):
            return self.engine.tokenize(engine.check_prompt(prompt))
        tokens = [int(t) for t in prompt]
        if not tokens:
            raise UsageError("the prompt has no tokens")
        n_vocab = self.engine.model.n_vocab
        bad = [t for t in tokens if not 0 <= t < n_vocab]
        if bad:
            raise UsageError(f"token id {bad[0]} is outside the vocabulary (0..{n_vocab - 1})")
        return tokens

    def plan(self, n_tokens: int, start: int = 0) -> list[bands_mod.Band]:
        """The bands this session's settings run for n_tokens from `start`."""
        return self.engine.plan(n_tokens, start)

    @contextlib.contextmanager
    def _within_record(self, n_tokens: int) -> Iterator[str | None]:
        """The engine runs a prompt of n_tokens with the settings records.for_prompt gives: the
        session's, or (a prompt longer than the qualification record covers) a fallback, whose
        warning line is reported and yielded."""
        eng = self.engine
        s, msg = records.for_prompt(self.settings, n_tokens)
        if msg:
            self.warn(msg)
        eng.settings = s
        try:
            yield msg
        finally:
            eng.settings = self.settings

    # -- requests ---------------------------------------------------------------------------

    def prefill(self, prompt: Prompt = None, *, n_predict: int = 16, logits: str = "all", compare_q1: bool = False,
                resume_at: int = 0, ctx: int | None = None, schedule: str | None = None,
                progress: Progress = _no_progress, spec: str = "none") -> PrefillResult:
        """Prefill the prompt with the session's band schedule (or an explicit `schedule`, see
        bands.SCHEDULE_HELP: a measurement, not a qualified width), then greedy-decode n_predict
        tokens; fingerprints and timings in a PrefillResult. `compare_q1` also runs q1 on the same
        request (PrefillResult.comparison; NotExactError is the caller's call: see check_exact).
        `spec="ngram"` also runs the request with n-gram speculation (dflash/run/speculate.py) and
        compares its response and decode time with the plain one (PrefillResult.speculation)."""
        _check_request(n_predict, logits)
        speculate.check_spec(spec)
        if compare_q1 and not self.settings.bands and schedule is None:
            raise UsageError(f"{arg('compare_q1')} compares a band schedule with q1, but bands are off "
                             f"(pass {arg('bands')}=True, or set {ENV_BANDS}=1)")
        tokens = self.tokenize(prompt)
        explicit = None
        if schedule is not None:
            explicit = bands_mod.from_widths(bands_mod.parse_schedule(schedule, len(tokens),
                                                                      self.engine.info.compress_ratios))
        with self._within_record(len(tokens) if explicit is None else 0) as beyond:
            result = prefill.run_request(self.engine, tokens, self.context, n_predict=n_predict, resume_at=resume_at,
                                         logits=logits, ctx=self.ctx if ctx is None else ctx, compare=compare_q1,
                                         bands=explicit, progress=progress, spec=spec)
        if beyond:
            result = replace(result, warnings=(*result.warnings, beyond))
        return replace(result, memory_budget=self.memory_budget)

    def generate(self, prompt: Prompt = None, *, max_tokens: int = 16, ctx: int | None = None, spec: str = "none",
                 spec_stats: speculate.SpecStats | None = None) -> Iterator[Token]:
        """Prefill the prompt with the session's bands, then yield the greedy response token by
        token (the same tokens prefill(n_predict=max_tokens) returns). `spec="ngram"` (or "ngram:N",
        an N-token lookup) drafts from n-grams of the context and verifies each draft in one batch
        (dflash/run/speculate.py): the same tokens, fewer llama_decode calls where the response
        repeats the context; `spec_stats` (a speculate.SpecStats) collects the drafted and accepted
        counts."""
        _check_request(max_tokens, "last")
        speculate.check_spec(spec)
        tokens = self.tokenize(prompt)
        eng = self.engine
        n_ctx = eng.context_size(len(tokens), max_tokens, self.ctx if ctx is None else ctx)
        with self._within_record(len(tokens)):
            plan = eng.request_bands(len(tokens))
        verify = 1 + speculate.NGRAM_M if spec != "none" else 1
        c = self.context(n_ctx, max(verify, *(b.width for b in plan)))
        lib = str(eng.lib_dir)
        p = prefill.prefill(c, prefill.Request(tokens, plan, max_tokens, "last"), library=lib)
        utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
        pairs = (prefill.greedy(c, p.last, len(tokens), max_tokens, lib) if spec == "none"
                 else speculate.greedy(c, tokens, p.last, max_tokens, spec_stats,
                                       n=speculate.ngram_size(spec) or speculate.NGRAM_N))
        for tok, logits in pairs:
            piece = eng.model.piece(tok)
            yield Token(tok, utf8.decode(piece), piece, logprob(logits, tok))

    def qualify(self, widths: Iterable[int] = qualify.DEFAULT_WIDTHS, *, prompt: str | None = None,
                resume_at: int | None = None, n_predict: int = 8, evidence_dir: str | os.PathLike[str] | None = None,
                progress: Progress = _no_progress) -> QualifyResult:
        """Which band widths are bit-identical to q1 on this library, model and device: runs q1 and
        every width, writes an evidence directory (default: evidence/runs/qualify-...) and stores
        the verdicts as the qualification record that chunk N > 4 and "auto" run from. Without a
        prompt the built-in one is repeated until a band of the widest width is really decoded."""
        ws = _widths(widths)
        if prompt is None:
            text, tokens = qualify.long_prompt(engine.DEFAULT_PROMPT, self.engine.tokenize, max(ws))
        else:
            text = engine.check_prompt(prompt)
            tokens = self.engine.tokenize(text)
        target = Path(evidence_dir) if evidence_dir else provenance.default_evidence_dir("qualify")
        with evidence.EvidenceWriter(target, "qualify") as writer:  # a bad directory fails before the runs
            return qualify.qualify_and_record(self.engine, text, tokens, writer, ws, resume_at, n_predict,
                                              self.engine.device, progress, self.warn)

    def bench(self, prompt: str | None = None, *, warmup: int = 2, runs: int = 5, interleave: bool = False,
              n_predict: int = 8, logits: str = "all", evidence_dir: str | os.PathLike[str] | None = None,
              progress: Progress = _no_progress) -> BenchResult:
        """A/B/A: q1, the session's band schedule, q1 again; medians, MAD, gain, drift and hash
        equality, written as an evidence directory (default: evidence/runs/bench-...)."""
        if not self.settings.bands:
            raise UsageError(f"bench compares a band schedule with q1, but bands are off (pass {arg('bands')}=True)")
        if warmup < 0 or runs < 1:
            raise UsageError(f"{arg('warmup')} must be >= 0 and {arg('runs')} >= 1")
        _check_request(n_predict, logits)
        text = engine.check_prompt(prompt)
        tokens = self.engine.tokenize(text)
        dest = Path(evidence_dir) if evidence_dir else provenance.default_evidence_dir("bench")
        with evidence.EvidenceWriter(dest, "bench") as writer, self._within_record(len(tokens)):
            return bench_mod.bench(self.engine, text, tokens, writer, warmup=warmup, runs=runs, interleave=interleave,
                                   n_predict=n_predict, logits=logits, device=self.engine.device, progress=progress,
                                   memory_budget=self.memory_budget)

    def memory(self, widths: Iterable[int] = (1, 4, 64, 512), *, ctx: int,
               progress: Progress = _no_progress) -> MemoryResult:
        """Bytes llama.cpp allocates for a context of `ctx` tokens at each band width: an estimate
        on a no_alloc session (nothing is read or allocated), a measurement otherwise."""
        ws = _widths(widths)
        eng = self.engine
        n_ctx = eng.context_size(0, 0, ctx)  # checked against the model's context length
        rows = memory.estimate(eng, n_ctx, ws, progress)
        return MemoryResult(str(eng.info.path), eng.info.architecture, n_ctx, not self.no_alloc, self.library,
                            eng.device, memory.indexer_rows(eng.info.compress_ratios, n_ctx), tuple(rows),
                            eng.indexer_tile)

    def provenance(self, text: str, tokens: Sequence[int]) -> dict[str, dict[str, Any]]:
        """The provenance records of a run on this session (command, library, model, prompt, machine)."""
        return provenance.provenance(self.engine, None, text, list(tokens))


def _endpoints(rpc: str | Sequence[str] | None) -> str | None:
    if rpc is None or isinstance(rpc, str):
        return rpc
    return ",".join(rpc)


def _widths(widths: Iterable[int]) -> list[int]:
    """Distinct band widths in 1..MAX_CHUNK, sorted."""
    ws = sorted(set(widths))
    if not ws or ws[0] < 1 or ws[-1] > MAX_CHUNK:
        raise UsageError(f"{arg('widths')} must be in 1..{MAX_CHUNK}")
    return ws


def _check_request(n_predict: int, logits: str) -> None:
    if isinstance(n_predict, bool) or not isinstance(n_predict, int) or n_predict < 0:
        raise UsageError(f"{arg('n_predict')} {n_predict!r} must be an integer >= 0")
    if logits not in ("all", "last"):
        raise UsageError(f"{arg('logits')} {logits!r} must be 'all' or 'last'")
