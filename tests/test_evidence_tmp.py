"""EvidenceWriter's temp directories: named after their owner's pid, removed by the next writer in
the same folder once that owner is gone (killed before it could clean up), never while it lives."""
import os
import re
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from dflash.proof import evidence as ev

ROOT = Path(__file__).resolve().parent.parent


def dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()  # reaped: os.kill(pid, 0) now raises ProcessLookupError
    with pytest.raises(ProcessLookupError):
        os.kill(p.pid, 0)
    return p.pid


def names(d: Path) -> list[str]:
    return sorted(p.name for p in d.iterdir())


def test_temp_dir_name_holds_the_owner_pid(tmp_path):
    with ev.EvidenceWriter(tmp_path / "bench-1", "bench") as w:
        assert re.fullmatch(rf"\.tmp-bench-1-{os.getpid()}-[0-9a-f]{{8}}", w.tmp_dir.name)
        assert w.tmp_dir.is_dir()


def test_writer_removes_only_temp_dirs_of_dead_owners(tmp_path):
    pid = dead_pid()
    stale = tmp_path / f".tmp-bench-20261129-120000-ab12-{pid}-0123abcd"
    live = tmp_path / f".tmp-bench-2-{os.getpid()}-0123abcd"
    keep = [live,
            tmp_path / ".tmp-bench-3-0123abcd",                  # the old name, no pid: not ours to judge
            tmp_path / f".tmp-bench-4-{pid}-xyz",                # does not parse
            tmp_path / f".tmp-bench-5-{pid}-0123abcd-more",      # does not parse
            tmp_path / f"bench-6-{pid}-0123abcd"]                # not a temp dir
    for d in (stale, *keep):
        (d / "logs").mkdir(parents=True)
        (d / "logs" / "run.log").write_text("x")
    plain = tmp_path / f".tmp-bench-7-{pid}-0123abcd"            # a file, not a directory
    plain.write_text("x")
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "precious").write_text("x")
    link = tmp_path / f".tmp-bench-8-{pid}-0123abcd"             # a symlink is never followed
    link.symlink_to(outside, target_is_directory=True)

    with ev.EvidenceWriter(tmp_path / "bench-9", "bench") as w:
        assert not stale.exists()
        assert all(d.is_dir() and (d / "logs" / "run.log").is_file() for d in keep)
        assert plain.is_file() and link.is_symlink() and (outside / "precious").is_file()
        w.commit()
    assert ev.verify(tmp_path / "bench-9").ok
    assert ev.clean_stale_temp(tmp_path) == []


def test_clean_stale_temp_returns_what_it_removed(tmp_path):
    stale = tmp_path / f".tmp-x-{dead_pid()}-deadbeef"
    stale.mkdir()
    assert ev.clean_stale_temp(tmp_path) == [stale]
    assert names(tmp_path) == []
    assert ev.clean_stale_temp(tmp_path / "missing") == []


def test_sigkilled_writer_is_cleaned_by_the_next(tmp_path):
    script = textwrap.dedent(f"""
        import sys, time
        from dflash.proof import evidence as ev
        w = ev.EvidenceWriter({str(tmp_path / "killed")!r}, "bench")
        w.write_text("notes.txt", "half a run")
        print(w.tmp_dir, flush=True)
        time.sleep(60)
    """)
    p = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True, cwd=ROOT)
    try:
        tmp = Path(p.stdout.readline().strip())
    finally:
        p.kill()  # SIGKILL: no cleanup runs
        p.wait()
        p.stdout.close()
    assert p.returncode == -signal.SIGKILL
    assert tmp.parent == tmp_path and (tmp / "notes.txt").is_file() and str(p.pid) in tmp.name
    with ev.EvidenceWriter(tmp_path / "next", "bench") as w:
        assert not tmp.exists()
        w.commit()
    assert names(tmp_path) == ["next"]


@pytest.mark.parametrize("exc", [SystemExit, KeyboardInterrupt, GeneratorExit])
def test_base_exceptions_remove_the_temp_dir(tmp_path, exc):
    with pytest.raises(exc):
        with ev.EvidenceWriter(tmp_path / "d", "bench") as w:
            w.write_text("a.txt", "a")
            raise exc()
    assert names(tmp_path) == []
