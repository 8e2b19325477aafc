"""Run one prompt across configurations and compare their fingerprints.

Each configuration runs Session.prefill(compare_q1=True) in a worker process of its own
(dflash.worker; one llama.cpp library per process), which answers a PrefillResult: CPU with 1 and 2 threads on
the exact and stock libraries, each HIP device, and a layer split across two HIP devices when
two are present; with RPC servers (--rpc), every layer on the first server's device, the CPU and
that device in a split, and two servers' devices in a split, with the local exact library on
plain CPU buffers (--no-repack) as their reference: an RPC server's CPU runs those kernels (see
engine.repack_for). Rows that cannot run here are listed with the reason.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from dflash.core.errors import DflashError
from dflash.core.results import Library, MatrixResult, MatrixRow, PrefillResult, Skipped
from dflash.core.settings import Settings
from dflash.native import devices
from dflash.native.rpc import Remote
from dflash.worker import Worker


@dataclass(frozen=True)
class Config:
    name: str
    device: str
    threads: int
    lib: str
    repack: bool = True            # False: --no-repack (and every row with RPC devices)
    rpc: tuple[str, ...] = ()      # --rpc endpoints
    allow_mixed_builds: bool = False


@dataclass(frozen=True)
class Row:
    """One configuration's process: its prefill result (with the q1 comparison), or why it has none."""
    config: Config
    result: PrefillResult | None = None
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.result is not None


def configurations(threads: tuple[int, ...] = (1, 2), libs: tuple[str, ...] = ("exact", "stock"),
                   remote: Remote | None = None) -> tuple[list[Config], list[Skipped]]:
    """(configs to run, skipped rows with reasons)."""
    cfgs = [Config(f"cpu t{t} {lib}", "cpu", t, lib) for lib in libs for t in threads]
    skipped = []
    if remote is not None:
        cfgs += rpc_configurations(remote, threads[0])
        if len(remote.devices) < 2:
            skipped.append(Skipped("rpc:0+rpc:1 two servers",
                                   f"needs two RPC devices, --rpc offers {len(remote.devices)}"))
    else:
        skipped.append(Skipped("rpc:N (RPC servers)", "no --rpc servers given"))
    hip, reason = devices.hip_devices()
    if hip:
        cfgs += [Config(f"{d.id} {d.arch}", d.id, threads[0], "exact") for d in hip]
    else:
        skipped.append(Skipped("hip:N (each GPU)", reason or ""))
    if len(hip) >= 2:
        cfgs.append(Config(f"hip:0+hip:1 layer split ({hip[0].arch}+{hip[1].arch})", "hip:0,hip:1",
                           threads[0], "exact"))
    else:
        skipped.append(Skipped("hip:0+hip:1 layer split",
                               f"needs two HIP devices, {len(hip)} present" + (f" ({reason})" if reason else "")))
    cuda, cuda_reason = devices.cuda_devices()  # the CUDA flavor (built on first use of cuda:N)
    if cuda:
        cfgs += [Config(f"{d.id} {d.arch}", d.id, threads[0], "exact") for d in cuda]
    else:
        skipped.append(Skipped("cuda:N (each GPU)", cuda_reason or ""))
    return cfgs, skipped


def rpc_configurations(remote: Remote, threads: int) -> list[Config]:
    """The local reference on plain CPU buffers, then the RPC rows: all layers remote, the CPU and
    a remote device in a split, two remote devices in a split (when there are two)."""
    eps, mixed = tuple(remote.endpoints), remote.allow_mixed_builds
    first = remote.devices[0]
    cfgs = [Config(f"cpu t{threads} exact no-repack", "cpu", threads, "exact", repack=False),
            Config(f"rpc:0 all layers ({first.server.endpoint})", "rpc:0", threads, "exact", False, eps, mixed),
            Config(f"cpu+rpc:0 split ({first.server.endpoint})", "cpu,rpc:0", threads, "exact", False, eps, mixed)]
    if len(remote.devices) >= 2:
        second = remote.devices[1]
        cfgs.append(Config(f"rpc:0+rpc:1 split ({first.server.endpoint} + {second.server.endpoint})",
                           "rpc:0,rpc:1", threads, "exact", False, eps, mixed))
    return cfgs


def run_config(cfg: Config, *, chunk: int | str, n_predict: int, model: str | None, prompt: str | None,
               settings: Settings | None = None) -> Row:
    """The configuration's prefill with its q1 comparison, in a worker process of its own."""
    try:
        with Worker(settings=settings, lib=cfg.lib, threads=cfg.threads, device=cfg.device, model=model,
                    repack=cfg.repack, rpc=list(cfg.rpc) or None, allow_mixed_builds=cfg.allow_mixed_builds,
                    bands=True, chunk=chunk) as w:
            return Row(cfg, w.prefill(prompt, n_predict=n_predict, compare_q1=True))
    except DflashError as e:
        return Row(cfg, error=e.render())


def compare(rows: Sequence[Row], skipped: Sequence[Skipped] = ()) -> MatrixResult:
    """Equality of every row's q1 and band hashes against the q1 run of the first exact row with
    the same weight buffers (repacked, or plain: --no-repack and every RPC row): those two run
    other kernels, so each has its own reference."""
    ran = [r for r in rows if r.result is not None]
    ref = next((r for r in ran if r.config.lib == "exact"), ran[0] if ran else None)
    if ref is None or ref.result is None or ref.result.comparison is None:
        first = next((r.error for r in rows if r.error), None)
        raise DflashError("no configuration ran" + (f": {first}" if first else ""))
    refs: dict[bool, Row] = {}
    for r in ran:
        if r.config.lib == "exact" and r.config.repack not in refs:
            refs[r.config.repack] = r
    out = []
    for r in rows:
        c = r.config
        res = r.result
        own = refs.get(c.repack, ref)
        if res is None or res.comparison is None or own.result is None or own.result.comparison is None:
            out.append(MatrixRow(c.name, c.device, c.threads, c.lib, Library(c.lib, None),
                                 error=r.error or "no result", reference=own.config.name))
            continue
        ref_q1 = own.result.comparison.q1
        q1 = res.comparison.q1
        out.append(MatrixRow(
            c.name, c.device, c.threads, c.lib, res.library,
            q1_logits_sha256=q1.logits_sha256, q1_response_sha256=q1.response_sha256,
            logits_sha256=res.logits_sha256, response_sha256=res.response_sha256,
            q1_equals_bands=res.comparison.identical,
            logits_equal_reference=q1.logits_sha256 == ref_q1.logits_sha256 == res.logits_sha256,
            response_equal_reference=q1.response_sha256 == ref_q1.response_sha256 == res.response_sha256,
            reference=own.config.name, devices=res.devices))
    return MatrixResult(ref.config.name, tuple(out), tuple(skipped))


def run(n_predict: int, chunk: int | str, model: str | None = None, prompt: str | None = None,
        progress: Callable[[int, int], None] = lambda done, total: None,
        remote: Remote | None = None, settings: Settings | None = None) -> MatrixResult:
    """Every configuration that can run here, one worker process each, on the same prompt
    (`prompt`, or the built-in one) and model, with the environment flags of `settings`, compared
    (see compare)."""
    cfgs, skipped = configurations(remote=remote)
    rows = []
    for i, cfg in enumerate(cfgs):
        rows.append(run_config(cfg, chunk=chunk, n_predict=n_predict, model=model, prompt=prompt,
                               settings=settings))
        progress(i + 1, len(cfgs))
    return compare(rows, skipped)
