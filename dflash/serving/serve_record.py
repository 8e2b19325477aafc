"""Serve records: which llama-server configurations `dflash qualify --serve` proved exact for one
server build, model and device. One file per identity, <cache_root()>/qualifications/serve-<key>.json:

    {"schema": "dflash.serve-qualification", "schema_version": 1, "key": "<24 hex>",
     "server": {"flavor": "exact", "key": "<server build key>"}, "model": {"sha256": "<64 hex>", "path": "..."},
     "device": "cpu", "updated_utc": "...Z",        (a GPU: "vulkan:0 <its name> / <its driver>")
     "configs": [{"config": {"parallel": 4, "ubatch": 512, "ctx": 4096, "threads": 2, "flash_attn": "auto",
                             "kv_unified": false, "spec": "none"},
                  "responses": 13, "identical_to_solo": 13, "identical_to_prefill": 13, "cache_hits": 5,
                  "exact": true, "evidence_dir": "..."}, ...]}

A configuration is vouched for when an entry with `exact` true was made with a configuration that
`ServeConfig.vouched_by` accepts. One writer (`save`) and one strict reader (`parse`).
"""
from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn

from dflash.core import paths
from dflash.core.errors import DflashError
from dflash.core.fileio import write_atomic
from dflash.core.results import Json
from dflash.proof.records import TIME_FORMAT, RecordError, now_utc, records_dir
from dflash.serving.serve_config import ServeConfig

SCHEMA, SCHEMA_VERSION = "dflash.serve-qualification", 1
_KEYS = {"schema", "schema_version", "key", "server", "model", "device", "updated_utc", "configs"}
_ENTRY_KEYS = {"config", "responses", "identical_to_solo", "identical_to_prefill", "cache_hits", "exact",
               "evidence_dir"}
# a configuration's keys; "spec" too since speculation (a record without it: none)
_CONFIG_KEYS = {"parallel", "ubatch", "ctx", "threads", "flash_attn", "kv_unified"}
_HEX64 = re.compile(r"[0-9a-f]{64}")

__all__ = ["Entry", "Identity", "Record", "RecordError", "TIME_FORMAT", "find", "load", "now_utc", "parse",
           "record_path", "save"]


@dataclass(frozen=True)
class Identity:
    flavor: str
    server_key: str
    model_sha256: str
    device: str

    @property
    def key(self) -> str:
        text = "|".join(("serve", self.flavor, self.server_key, self.model_sha256, self.device))
        return hashlib.sha256(text.encode()).hexdigest()[:24]


@dataclass(frozen=True)
class Entry:
    config: ServeConfig
    responses: int
    identical_to_solo: int
    identical_to_prefill: int
    cache_hits: int
    exact: bool
    evidence_dir: str | None

    def to_json(self) -> Json:
        return {"config": self.config.to_json(), "responses": self.responses,
                "identical_to_solo": self.identical_to_solo, "identical_to_prefill": self.identical_to_prefill,
                "cache_hits": self.cache_hits, "exact": self.exact, "evidence_dir": self.evidence_dir}


@dataclass(frozen=True)
class Record:
    identity: Identity
    model_path: str
    updated_utc: str
    configs: tuple[Entry, ...]

    def to_json(self) -> Json:
        i = self.identity
        return {"schema": SCHEMA, "schema_version": SCHEMA_VERSION, "key": i.key,
                "server": {"flavor": i.flavor, "key": i.server_key},
                "model": {"sha256": i.model_sha256, "path": self.model_path}, "device": i.device,
                "updated_utc": self.updated_utc, "configs": [e.to_json() for e in self.configs]}


def _need(ok: bool, msg: str) -> None:
    if not ok:
        raise RecordError(msg)


def _count(d: dict[str, Any], name: str) -> int:
    v = d[name]
    _need(type(v) is int and v >= 0, f"{name} {v!r} is not a count")
    return int(v)


def _entry(i: int, d: Any) -> Entry:
    _need(isinstance(d, dict) and set(d) == _ENTRY_KEYS,
          f"configs[{i}] must have exactly the keys {sorted(_ENTRY_KEYS)}")
    c = d["config"]
    _need(isinstance(c, dict) and set(c) - {"spec"} == _CONFIG_KEYS,
          f"configs[{i}].config is not a serve configuration")
    try:
        _need(all(type(c[k]) is int for k in ("parallel", "ubatch", "ctx", "threads"))
              and type(c["kv_unified"]) is bool and isinstance(c["flash_attn"], str)
              and isinstance(c.get("spec", ""), str), "wrong types")
        config = ServeConfig(**c)
    except DflashError as e:
        raise RecordError(f"configs[{i}].config: {e}") from None
    _need(type(d["exact"]) is bool, f"configs[{i}].exact is not true or false")
    _need(d["evidence_dir"] is None or isinstance(d["evidence_dir"], str), f"configs[{i}].evidence_dir is not a string")
    n, solo, pre, hits = (_count(d, k) for k in ("responses", "identical_to_solo", "identical_to_prefill",
                                                  "cache_hits"))
    _need(max(solo, pre, hits) <= n, f"configs[{i}]: a count exceeds responses")
    _need(not d["exact"] or n == solo == pre > 0, f"configs[{i}] is marked exact but not every response was identical")
    return Entry(config, n, solo, pre, hits, d["exact"], d["evidence_dir"])


def parse(raw: bytes) -> Record:
    def no_constant(name: str) -> NoReturn:
        raise ValueError(f"{name} is not JSON")
    try:
        d = json.loads(raw.decode("utf-8"), parse_constant=no_constant)
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        raise RecordError(f"not valid JSON ({e})") from None
    _need(isinstance(d, dict) and d.get("schema") == SCHEMA and d.get("schema_version") == SCHEMA_VERSION,
          f"not a {SCHEMA} record of version {SCHEMA_VERSION}")
    _need(set(d) == _KEYS, f"keys missing {sorted(_KEYS - set(d))} or unknown {sorted(set(d) - _KEYS)}")
    srv, model = d["server"], d["model"]
    _need(isinstance(srv, dict) and set(srv) == {"flavor", "key"} and srv["flavor"] in paths.FLAVORS
          and isinstance(srv["key"], str), "server is not {\"flavor\": exact|stock, \"key\": <hex>}")
    _need(isinstance(model, dict) and set(model) == {"sha256", "path"} and isinstance(model["sha256"], str)
          and _HEX64.fullmatch(model["sha256"]) is not None and isinstance(model["path"], str),
          "model is not {\"sha256\": <64 hex>, \"path\": <string>}")
    _need(isinstance(d["device"], str) and isinstance(d["updated_utc"], str), "device or updated_utc is not a string")
    _need(isinstance(d["configs"], list) and len(d["configs"]) > 0, "configs is not a non-empty list")
    ident = Identity(srv["flavor"], srv["key"], model["sha256"], d["device"])
    _need(d["key"] == ident.key, "key does not match the server, model and device it names")
    return Record(ident, model["path"], d["updated_utc"], tuple(_entry(i, e) for i, e in enumerate(d["configs"])))


def record_path(identity: Identity) -> Path:
    return records_dir() / f"serve-{identity.key}.json"


def load(identity: Identity) -> Record | None:
    """The stored record, None when there is none; RecordError when it is corrupt or names another
    identity."""
    path = record_path(identity)
    if not path.exists():
        return None
    try:
        r = parse(path.read_bytes())
    except RecordError as e:
        raise RecordError(f"{path}: {e}") from None
    except OSError as e:
        raise RecordError(f"{path}: cannot read ({e.strerror})") from None
    if r.identity != identity:
        raise RecordError(f"{path}: names another server build, model or device")
    return r


def save(identity: Identity, model_path: str, entries: list[Entry]) -> Record:
    """Merge `entries` into the stored record (an entry for the same configuration replaces the old one)."""
    try:
        old = load(identity)
    except RecordError:
        old = None  # a corrupt record is replaced by this run's
    kept = [e for e in (old.configs if old else ()) if not any(e.config == n.config for n in entries)]
    record = Record(identity, model_path, now_utc(), tuple(kept + entries))
    try:
        write_atomic(record_path(identity), (json.dumps(record.to_json(), indent=2) + "\n").encode())
    except OSError as e:
        raise DflashError(f"cannot write serve record {record_path(identity)}: {e.strerror}") from None
    return record


def find(record: Record | None, config: ServeConfig) -> Entry | None:
    """The exact entry that vouches for `config`, if any."""
    for e in (record.configs if record else ()):
        if e.exact and config.vouched_by(e.config):
            return e
    return None

