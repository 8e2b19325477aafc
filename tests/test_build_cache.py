"""How builds share work (dflash/native/build.py): the one locked build folder and ccache's settings.
Nothing is compiled here; the measured effect (the second flavor's build 1 min 44 s -> 21 s on
2 cores) is in the README."""
import subprocess
import sys
import time

import pytest

from dflash.core.errors import UsageError
from dflash.native import build


def test_ccache_is_pointed_at_a_folder_per_host_or_disabled(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setattr(build, "compiler_cache", lambda: "/usr/bin/ccache")
    env = build._with_ccache({"PATH": "/usr/bin"}, tmp_path / "stats.log")
    assert env["CCACHE_DIR"] == str(build.ccache_dir()) and env["CCACHE_STATSLOG"] == str(tmp_path / "stats.log")
    assert build.ccache_dir().parent == build.cache_root() / "ccache"  # keyed by the host's CPU flags and compiler
    monkeypatch.setattr(build, "_host_fingerprint", lambda: "x86_64|flags : other cpu|cc 1")
    assert build.ccache_dir() != env["CCACHE_DIR"]
    monkeypatch.setattr(build, "compiler_cache", lambda: None)
    off = build._with_ccache({"PATH": "/usr/bin"}, tmp_path / "stats.log")
    assert off["CCACHE_DISABLE"] == "1" and "CCACHE_DIR" not in off


def test_dflash_ccache_0_turns_it_off(monkeypatch):
    monkeypatch.setattr(build.shutil, "which", lambda name: f"/usr/bin/{name}")
    monkeypatch.delenv(build.CCACHE_ENV, raising=False)
    assert build.compiler_cache() == "/usr/bin/ccache"
    for value in ("0", "off", "false", "no"):
        monkeypatch.setenv(build.CCACHE_ENV, value)
        assert build.compiler_cache() is None
    monkeypatch.setenv(build.CCACHE_ENV, "maybe")
    with pytest.raises(UsageError, match=build.CCACHE_ENV):  # a malformed boolean, as for every flag
        build.compiler_cache()


def test_the_summary_counts_hits_and_misses_per_compile(tmp_path):
    log = tmp_path / "s.log"
    log.write_text("# a.c\ncache_miss\ndirect_cache_miss\nlocal_storage_miss\npreprocessed_cache_miss\n"
                   "# b.c\ndirect_cache_hit\nlocal_storage_hit\nlocal_storage_read_hit\n"
                   "# c.c\npreprocessed_cache_hit\nlocal_storage_hit\n")
    assert build._ccache_summary(log) == "ccache: 2 of 3 objects reused from earlier builds"
    assert build._ccache_summary(tmp_path / "none.log") == ""


HOLD = """
import sys, time
from dflash.native import build
with build._work_tree(print) as w:
    print("in", w, flush=True)
    time.sleep(float(sys.argv[1]))
"""


def test_a_second_build_waits_for_the_first_and_the_folder_is_emptied(tmp_path):
    env = {"XDG_CACHE_HOME": str(tmp_path), "PATH": "/usr/bin:/bin"}
    first = subprocess.Popen([sys.executable, "-c", HOLD, "2"], stdout=subprocess.PIPE, text=True, env=env)
    assert first.stdout is not None and first.stdout.readline().startswith("in ")
    t0 = time.monotonic()
    second = subprocess.run([sys.executable, "-c", HOLD, "0"], capture_output=True, text=True, env=env, timeout=60)
    waited = time.monotonic() - t0
    assert first.wait(30) == 0 and second.returncode == 0, second.stderr
    assert "another dflash build is running" in second.stdout and waited > 1.0
    assert not (tmp_path / "dflash" / build.BUILD_TREE).exists()
