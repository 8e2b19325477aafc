"""`dflash records` (list, show, remove) over a cache of its own, and `dflash --version`."""
import json

from dflash.core.paths import LLAMA_CPP_COMMIT, VERSION
from dflash.native import build
from dflash.proof import records
from dflash.serving import serve_config, serve_record

from .conftest import run_dflash

V = records.Verdict


def _write(cache):
    folder = cache / "dflash" / "qualifications"
    ident = records.Identity("exact", "build", "0123456789abcdef", "ab" * 32, "cpu")
    q = records.Record(ident, "/models/m.gguf", "2025-01-02T03:04:05Z",
                       (V(1, True, 1, True, 1, None, 389), V(8, True, 4, True, 8, None, 389),
                        V(16, False, 4, False, 16, None, 389)))
    qpath = records.write(folder / f"{ident.key}.json", q)
    sident = serve_record.Identity("exact", "fedcba9876543210", "cd" * 32, "cpu")
    entry = serve_record.Entry(serve_config.ServeConfig(4, 64, 1024, 2), 12, 12, 12, 3, True, None)
    s = serve_record.Record(sident, "/models/m.gguf", "2025-01-02T03:04:05Z", (entry,))
    spath = folder / f"serve-{sident.key}.json"
    spath.write_text(json.dumps(s.to_json()))
    (folder / "0000aaaa.json").write_text("{not json")
    return ident.key, sident.key, qpath, spath


def test_list_show_and_remove(tmp_path):
    env = {"XDG_CACHE_HOME": str(tmp_path)}
    qkey, skey, qpath, spath = _write(tmp_path)
    listed = json.loads(run_dflash("records", "list", "--json", env=env, check=True).stdout)["records"]
    by_key = {r["key"]: r for r in listed}
    assert set(by_key) == {qkey, f"serve-{skey}", "0000aaaa"}
    assert by_key[qkey]["exact_widths"] == [1, 8] and by_key[qkey]["inexact_widths"] == [16]
    assert by_key[f"serve-{skey}"]["exact_parallel"] == [4]
    assert by_key["0000aaaa"]["error"] and by_key["0000aaaa"]["device"] is None
    people = run_dflash("records", "list", env=env, check=True).stdout
    assert qkey in people and "unreadable" in people

    shown = json.loads(run_dflash("records", "show", qkey[:8], "--json", env=env, check=True).stdout)
    assert shown == json.loads(qpath.read_text())
    assert json.loads(run_dflash("records", "show", skey[:6], "--json", env=env, check=True).stdout)["key"] == skey

    for bad in (("show", "zz"), ("show", "ffffffff"), ("remove",), ("remove", qkey, "--all"), ("show", "0000aaaa")):
        r = run_dflash("records", *bad, env=env)
        assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1 and "Traceback" not in r.stderr, bad

    gone = json.loads(run_dflash("records", "remove", qkey[:10], "--json", env=env, check=True).stdout)
    assert gone == {"removed": [str(qpath)]} and not qpath.exists() and spath.exists()
    run_dflash("records", "remove", "--all", env=env, check=True)
    assert json.loads(run_dflash("records", "list", "--json", env=env, check=True).stdout)["records"] == []


def test_version_names_the_llama_cpp_commit_and_the_build_keys():
    r = run_dflash("--version", check=True)
    lines = r.stdout.splitlines()
    assert lines[0] == f"dflash {VERSION}" and LLAMA_CPP_COMMIT in lines[1]
    assert any(line.split()[:3] == ["exact", "cpu", build.build_key("exact")] for line in lines), r.stdout
    assert any(line.split()[:2] == ["llama-server", build.server_key()] for line in lines), r.stdout
