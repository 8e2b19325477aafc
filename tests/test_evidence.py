"""dflash.proof.evidence and `dflash verify`: atomic writes, strict reading, any changed byte is caught."""
import hashlib
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from dflash import cli as cli_mod
from dflash.cli import cli
from dflash.core.errors import DflashError
from dflash.core.fileio import sha256_file
from dflash.proof import evidence as ev
from dflash.proof import provenance

ROOT = Path(__file__).resolve().parent.parent
SHA_A, SHA_B = "a" * 64, "b" * 64


def requests_doc(values):
    return {"requests": [{"id": i, "response_sha256": v} for i, v in enumerate(values)]}


def seal(root: Path, name="bench-1", requests=(SHA_A,) * 4, extra=None) -> tuple[Path, str]:
    with ev.EvidenceWriter(root / name, "bench") as w:
        w.write_json("requests.json", requests_doc(list(requests)))
        w.write_text("notes.txt", "q1 reference A, candidate, q1 reference B\n")
        w.write_bytes("logs/run.log", bytes(range(256)) * 3)
        w.write_json("machine.json", provenance.machine_facts())
        for rel, text in (extra or {}).items():
            w.write_text(rel, text)
        w.add_hash_check("requests.json", "requests", "response_sha256")
        return w.commit()


@pytest.fixture
def sealed(tmp_path):
    return seal(tmp_path / "evidence")


def all_files(d: Path) -> list[str]:
    return sorted(p.relative_to(d).as_posix() for p in d.rglob("*") if p.is_file())


def leftovers(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir()) if root.exists() else []


# --- writer round trip ---------------------------------------------------------------------

def test_round_trip(sealed):
    d, sha = sealed
    assert sha == hashlib.sha256((d / "manifest.json").read_bytes()).hexdigest()
    r = ev.verify(d)
    assert r.ok and r.problems == []
    assert r.manifest_sha256 == sha and r.n_files == 4 and r.n_hash_checks == 1
    assert any("response_sha256" in line for line in r.checks)
    assert ev.verify(d, sha).ok and ev.verify(d, sha.upper()).ok
    m = ev.read_manifest(d)
    assert (m["schema"], m["schema_version"], m["kind"]) == ("dflash.evidence", 1, "bench")
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ", m["created_utc"])
    assert set(m["files"]) == {"requests.json", "notes.txt", "logs/run.log", "machine.json"}
    assert m["files"]["logs/run.log"] == {"sha256": sha256_file(d / "logs/run.log"), "bytes": 768}
    assert m["hash_checks"] == [{"file": "requests.json", "pointer": "requests",
                                 "field": "response_sha256", "expect": "identical"}]
    body = {k: v for k, v in m.items() if k != "self_sha256"}
    canon = json.dumps(body, sort_keys=True, separators=(",", ":")).encode()
    assert m["self_sha256"] == hashlib.sha256(canon).hexdigest()
    assert leftovers(d.parent) == [d.name]


def test_expected_manifest_sha_mismatch(sealed):
    d, sha = sealed
    r = ev.verify(d, "0" * 64)
    assert not r.ok and r.problems[0].startswith("manifest.json:")


# --- atomicity -----------------------------------------------------------------------------

@pytest.mark.parametrize("exc", [RuntimeError, KeyboardInterrupt])
def test_interrupted_run_leaves_nothing(tmp_path, exc):
    final = tmp_path / "bench-x"
    with pytest.raises(exc):
        with ev.EvidenceWriter(final, "bench") as w:
            w.write_json("requests.json", requests_doc([SHA_A]))
            assert w.tmp_dir.parent == tmp_path and w.tmp_dir.name.startswith(".tmp-bench-x-")
            raise exc()
    assert leftovers(tmp_path) == []


def test_uncommitted_writer_leaves_nothing(tmp_path):
    with ev.EvidenceWriter(tmp_path / "d", "bench") as w:
        w.write_text("a.txt", "a")
    assert leftovers(tmp_path) == []
    with pytest.raises(RuntimeError):
        w.write_text("b.txt", "b")


def test_existing_final_dir_refused(sealed):
    d, _ = sealed
    with pytest.raises(DflashError, match=re.escape(str(d))):
        ev.EvidenceWriter(d, "bench")
    assert leftovers(d.parent) == [d.name]


def test_writes_after_commit_refused(tmp_path):
    w = ev.EvidenceWriter(tmp_path / "d", "bench")
    w.commit()
    with pytest.raises(RuntimeError):
        w.write_text("late.txt", "x")
    with pytest.raises(RuntimeError):
        w.commit()
    assert ev.verify(tmp_path / "d").ok


@pytest.mark.parametrize("rel", ["", "/abs.json", "../up.json", "a/../b.json", "./a.json", "a//b.json",
                                 "a/b/c.json", "a/", "manifest.json", "a\\b.json", ".", ".."])
def test_bad_relative_paths_refused(tmp_path, rel):
    with ev.EvidenceWriter(tmp_path / "d", "bench") as w:
        with pytest.raises(ValueError):
            w.write_text(rel, "x")


def test_duplicate_and_clashing_paths_refused(tmp_path):
    with ev.EvidenceWriter(tmp_path / "d", "bench") as w:
        w.write_text("a.txt", "1")
        w.write_text("sub/manifest.json", "not the manifest")  # only the top-level name is reserved
        for rel in ("a.txt", "a.txt/b", "sub"):
            with pytest.raises(ValueError):
                w.write_text(rel, "2")
        with pytest.raises(ValueError):
            w.add_hash_check("x.json", "requests", "response_sha256", expect="similar")
        w.add_hash_check("never.json", "requests", "response_sha256")
        with pytest.raises(ValueError, match="never.json"):
            w.commit()


def test_nan_is_not_json(tmp_path):
    with ev.EvidenceWriter(tmp_path / "d", "bench") as w:
        with pytest.raises(ValueError):
            w.write_json("x.json", {"t": float("nan")})
        w.commit()
    assert all_files(tmp_path / "d") == ["manifest.json"]


# --- tampering -----------------------------------------------------------------------------

@pytest.mark.parametrize("mask", [0x01, 0x20, 0xFF])
def test_every_flipped_byte_is_caught(sealed, tmp_path, mask):
    d, sha = sealed
    files = all_files(d)
    assert "manifest.json" in files and "logs/run.log" in files
    for rel in files:
        size = (d / rel).stat().st_size
        for offset in sorted({0, size // 2, size - 1}):
            copy = tmp_path / f"copy-{mask}"
            shutil.copytree(d, copy)
            data = bytearray((copy / rel).read_bytes())
            data[offset] ^= mask
            (copy / rel).write_bytes(bytes(data))
            r = ev.verify(copy)
            assert not r.ok, (rel, offset)
            assert r.problems[0].startswith(f"{rel}:"), (rel, offset, r.problems)
            shutil.rmtree(copy)


@pytest.mark.parametrize("edit", [
    lambda t: t.replace('  "files"', '\t"files"', 1),                 # whitespace only
    lambda t: t.replace('"kind": "bench"', '"kind": "\\u0062ench"'),  # same value, other spelling
    lambda t: t.replace('"kind": "bench"', '"kind": "bench", "kind": "bench"'),
    lambda t: t.rstrip("\n"),
])
def test_manifest_edits_that_keep_its_meaning_are_caught(sealed, edit):
    d, _ = sealed
    p = d / "manifest.json"
    text = p.read_text()
    assert edit(text) != text
    p.write_text(edit(text))
    r = ev.verify(d)
    assert not r.ok and r.problems[0].startswith("manifest.json:")


@pytest.mark.parametrize("extra", ["extra.txt", "logs/extra.txt", ".hidden"])
def test_unlisted_file_is_caught(sealed, extra):
    d, _ = sealed
    (d / extra).write_text("x")
    r = ev.verify(d)
    assert not r.ok and r.problems == [f"{extra}: not listed in the manifest"]


def test_unlisted_directory_is_caught(sealed):
    d, _ = sealed
    (d / "empty").mkdir()
    assert ev.verify(d).problems == ["empty: not listed in the manifest"]


@pytest.mark.parametrize("rel", ["notes.txt", "logs/run.log", "manifest.json"])
def test_deleted_file_is_caught(sealed, rel):
    d, _ = sealed
    (d / rel).unlink()
    r = ev.verify(d)
    assert not r.ok and r.problems[0].startswith(f"{rel}:")


def test_symlink_is_caught(sealed):
    d, _ = sealed
    target = d.parent / "outside.txt"
    shutil.copy(d / "notes.txt", target)
    (d / "notes.txt").unlink()
    (d / "notes.txt").symlink_to(target)
    assert ev.verify(d).problems[0] == "notes.txt: not a regular file (a symlink)"


def test_missing_or_plain_file_dir(tmp_path):
    assert ev.verify(tmp_path / "nope").problems == [f"{tmp_path / 'nope'}: not found"]
    (tmp_path / "f").write_text("x")
    assert not ev.verify(tmp_path / "f").ok
    assert ev.verify(tmp_path).problems == ["manifest.json: not found"]


# --- hash checks ---------------------------------------------------------------------------

def test_one_differing_response_names_its_index(tmp_path):
    d, _ = seal(tmp_path, requests=[SHA_A, SHA_A, SHA_B, SHA_A])
    r = ev.verify(d)
    assert not r.ok and len(r.problems) == 1
    assert r.problems[0].startswith("requests.json: requests[2]: response_sha256")


@pytest.mark.parametrize("values, needle", [([], "empty list"), ([SHA_A, ""], "requests[1]: has no"),
                                            ([None], "requests[0]: has no")])
def test_empty_or_missing_values_fail(tmp_path, values, needle):
    d, _ = seal(tmp_path, requests=values)
    r = ev.verify(d)
    assert not r.ok and needle in r.problems[0] and r.problems[0].startswith("requests.json:")


def test_nested_pointer_and_bad_pointers(tmp_path):
    with ev.EvidenceWriter(tmp_path / "d", "qualify") as w:
        w.write_json("runs.json", {"data": {"runs": [{"logits_sha256": "x"}, {"logits_sha256": "x"}]},
                                   "flat": {"logits_sha256": "x"}})
        w.add_hash_check("runs.json", "data.runs", "logits_sha256")
        w.add_hash_check("runs.json", "data.missing", "logits_sha256")
        w.add_hash_check("runs.json", "flat", "logits_sha256")
        d, _ = w.commit()
    r = ev.verify(d)
    assert r.problems == ["runs.json: data.missing: no key 'missing' on the path",
                          "runs.json: flat: is dict, expected a list"]
    assert any("data.runs" in line for line in r.checks)


# --- strict reader -------------------------------------------------------------------------

def forge(d: Path, **changes) -> None:
    """Rewrite manifest.json with changes, keeping self_sha256 and the rendering consistent."""
    m = json.loads((d / "manifest.json").read_text())
    m.update(changes)
    m.pop("self_sha256")
    m["self_sha256"] = ev.canonical_sha256(m)
    (d / "manifest.json").write_bytes(ev.render_manifest(m))


@pytest.mark.parametrize("changes, needle", [
    ({"schema": "other"}, "schema"), ({"schema_version": 2}, "schema_version"),
    ({"schema_version": True}, "schema_version"), ({"extra": 1}, "unknown"),
    ({"kind": "a b"}, "kind"), ({"created_utc": "yesterday"}, "created_utc"),
    ({"files": {"../x": {"sha256": SHA_A, "bytes": 1}}}, "../x"),
    ({"files": {"x": {"sha256": "A" * 64, "bytes": 1}}}, "files['x']"),
    ({"files": {"x": {"sha256": SHA_A, "bytes": -1}}}, "files['x']"),
    ({"hash_checks": [{"file": "nope.json", "pointer": "", "field": "f", "expect": "identical"}]}, "hash_checks[0]"),
])
def test_read_manifest_is_strict(sealed, changes, needle):
    d, _ = sealed
    forge(d, **changes)
    with pytest.raises(ev.EvidenceError) as e:
        ev.read_manifest(d)
    assert isinstance(e.value, DflashError) and isinstance(e.value, ValueError)
    assert str(d / "manifest.json") in str(e.value) and needle in str(e.value)
    assert ev.verify(d).problems[0].startswith("manifest.json:")


def test_forged_but_consistent_manifest_still_fails_on_content(sealed):
    d, _ = sealed
    forge(d, kind="qualify")  # a rewritten manifest is valid on its own...
    assert ev.verify(d).ok
    assert not ev.verify(d, sealed[1]).ok  # ...which is why the quoted SHA-256 matters


# --- helpers -------------------------------------------------------------------------------

def test_helpers(tmp_path):
    assert re.fullmatch(r"bench-\d{8}-\d{6}-[0-9a-f]{4}", ev.default_dir(tmp_path, "bench").name)
    assert ev.default_dir(tmp_path, "bench").parent == tmp_path
    with pytest.raises(ValueError):
        ev.default_dir(tmp_path, "../x")
    f = provenance.machine_facts()
    assert set(f) == {"cpu_model", "logical_cores", "platform", "python"} and f["python"].count(".") == 2
    json.dumps(f)


def test_git_revision(tmp_path):
    assert provenance.git_revision(tmp_path / "missing") is None
    assert provenance.git_revision(tmp_path) is None  # not a checkout (tmp_path is outside any repo)
    if not shutil.which("git"):
        pytest.skip("git is not installed")
    git = ["git", "-C", str(tmp_path), "-c", "user.name=t", "-c", "user.email=t@t", "-c", "commit.gpgsign=false"]
    subprocess.run([*git, "init", "-q"], check=True)
    assert provenance.git_revision(tmp_path) is None  # no commit yet
    (tmp_path / "f").write_text("1")
    subprocess.run([*git, "add", "f"], check=True)
    subprocess.run([*git, "commit", "-qm", "x"], check=True)
    assert re.fullmatch(r"[0-9a-f]{40}", provenance.git_revision(tmp_path))
    (tmp_path / "f").write_text("2")
    assert provenance.git_revision(tmp_path).endswith("-dirty")


# --- CLI -----------------------------------------------------------------------------------

def run_main(args, capsys) -> tuple[int, str, str]:
    with pytest.raises(SystemExit) as e:
        cli_mod.main(args)
    out, err = capsys.readouterr()
    return e.value.code, out, err


def test_cli_ok(sealed):
    d, sha = sealed
    r = CliRunner().invoke(cli, ["verify", str(d), "--manifest-sha256", sha])
    assert r.exit_code == 0, r.output
    assert "verified" in r.output and sha in r.output and "4 files" in r.output
    r = CliRunner().invoke(cli, ["verify", str(d), "--json"])
    assert r.exit_code == 0
    assert json.loads(r.output) | {"checks": []} == {"ok": True, "problems": [], "manifest_sha256": sha,
                                                     "n_files": 4, "n_hash_checks": 1, "checks": []}


def test_cli_tampered_is_one_line(sealed, capsys):
    d, _ = sealed
    (d / "logs/run.log").write_bytes(b"\xff" + (d / "logs/run.log").read_bytes()[1:])
    code, out, err = run_main(["verify", str(d)], capsys)
    assert code == 1 and out == ""
    assert err.count("\n") == 1 and "logs/run.log" in err and "Traceback" not in err
    code, out, err = run_main(["verify", str(d), "--json"], capsys)
    assert code == 1 and json.loads(out)["ok"] is False
    assert json.loads(out)["problems"][0].startswith("logs/run.log:")


def test_cli_errors(tmp_path, sealed, capsys):
    code, _, err = run_main(["verify", str(tmp_path / "missing")], capsys)
    assert code == 2 and err.count("\n") == 1 and "not found" in err and "usage error" in err
    code, _, err = run_main(["verify", str(sealed[0]), "--manifest-sha256", "xyz"], capsys)
    assert code == 2 and "--manifest-sha256" in err
    code, _, err = run_main(["verify", str(sealed[0]), "--manifest-sha256", "0" * 64], capsys)
    assert code == 1 and "manifest.json" in err


def test_cli_subprocess(sealed):
    d, _ = sealed
    (d / "notes.txt").write_text("edited\n")
    r = subprocess.run([sys.executable, "-m", "dflash", "verify", str(d)], capture_output=True,
                       text=True, cwd=ROOT, timeout=120)
    assert r.returncode == 1 and r.stdout == ""
    assert r.stderr.startswith("dflash: error:") and r.stderr.count("\n") == 1 and "notes.txt" in r.stderr
