"""The documentation (README.md, docs/, mkdocs.yml): the site builds with warnings as errors; every
`dflash` command the README and the pages show in a code block names a command the CLI has and only
flags that command accepts (parsed against the click objects, never run); the generated CLI
reference (scripts/docs_reference.py, a MkDocs hook) lists every command and every flag; and the
checker catches a planted wrong flag, so it can fail."""
from __future__ import annotations

import importlib.util
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import click
import pytest

from dflash.cli import cli

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
SHELL_FENCES = {"", "bash", "sh", "shell", "console", "text"}
# where a shell command starts: the line's start, or after a separator the tokenizer splits off
SEPARATORS = {"&&", "||", ";", "|", "&", "(", ")", "$(", ";;", "|&"}
ASSIGNMENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*=")
INVOCATION = re.compile(r"(?:^|[\s;&|(])(?:\S*/)?dflash(?:\s|$)")


def load_generator():
    spec = importlib.util.spec_from_file_location("docs_reference", ROOT / "scripts" / "docs_reference.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# ---------------------------------------------------------------------------------------------
# Finding the commands a page shows


def code_lines(text: str) -> list[tuple[int, str]]:
    """(line number, line) of the shell code in Markdown: fenced blocks whose language is a shell
    or none, and indented blocks (4+ spaces after a blank line); lines ending in a backslash are
    joined with the next."""
    out: list[tuple[int, str]] = []
    fence: str | None = None
    shell = False
    indented = False
    prev_blank = True
    lines = text.splitlines()
    for n, line in enumerate(lines, 1):
        stripped = line.strip()
        m = re.match(r"\s*(```+|~~~+)\s*([\w+-]*)", line)
        if fence is None and m:
            fence, shell = m.group(1), m.group(2).lower() in SHELL_FENCES
            continue
        if fence is not None:
            if stripped.startswith(fence):
                fence = None
            elif shell:
                out.append((n, line))
            continue
        if line.startswith("    ") and stripped and (prev_blank or indented):
            indented = True
            out.append((n, line))
        elif stripped:
            indented = False
        prev_blank = not stripped
    joined: list[tuple[int, str]] = []
    for n, line in out:
        if joined and joined[-1][1].endswith("\\") and n == joined[-1][0] + joined[-1][1].count("\n") + 1:
            joined[-1] = (joined[-1][0], joined[-1][1][:-1] + "\n" + line)
        else:
            joined.append((n, line))
    return [(n, line.replace("\n", " ")) for n, line in joined]


def invocations(line: str) -> list[list[str]]:
    """The argument lists of every `dflash` command in one shell line: at its start or after a
    separator (&&, |, ;, `$(`...), after any VAR=value assignments, `dflash` or a path ending in
    /dflash. Raises ValueError for a line the shell would not parse."""
    if not INVOCATION.search(line):
        return []
    lex = shlex.shlex(line.strip().removeprefix("$ "), posix=True, punctuation_chars=True)
    lex.whitespace_split = True
    tokens = list(lex)
    found, segment = [], []
    for tok in [*tokens, ";"]:
        if tok in SEPARATORS or (set(tok) <= set("();&|<>") and tok):
            words = [w for w in segment if w != "$"]
            while words and ASSIGNMENT.match(words[0]):
                words.pop(0)
            if words and (words[0] == "dflash" or words[0].endswith("/dflash")):
                found.append(words[1:])
            segment = []
        else:
            segment.append(tok)
    return found


def _options(cmd: click.Command, ctx: click.Context) -> dict[str, bool]:
    """Every flag spelling of a command (help included) -> whether it takes a value."""
    out: dict[str, bool] = {}
    for p in cmd.get_params(ctx):
        if isinstance(p, click.Option):
            takes = not (p.is_flag or p.count)
            for name in (*p.opts, *p.secondary_opts):
                out[name] = takes
    return out


def check_args(args: list[str]) -> list[str]:
    """What is wrong with `dflash ARGS`, resolved against the click objects: an unknown command (of
    a group too) or a flag the command does not take. Nothing after `--` is checked."""
    cmd: click.Command = cli
    ctx = cli.make_context("dflash", [], resilient_parsing=True)
    path = ["dflash"]
    i = 0
    while i < len(args):
        tok = args[i]
        if tok == "--":
            break
        opts = _options(cmd, ctx)
        if tok.startswith("-") and tok != "-" and not re.fullmatch(r"-\d+(\.\d+)?", tok):
            name = tok.split("=", 1)[0]
            if name not in opts:
                return [f"{' '.join(path)} has no option {name}"]
            i += 2 if opts[name] and "=" not in tok else 1
            continue
        if isinstance(cmd, click.Group):
            sub = cmd.commands.get(tok)
            if sub is None:
                return [f"{' '.join(path)} has no command {tok!r}"]
            cmd, path = sub, [*path, tok]
            ctx = cmd.make_context(tok, [], parent=ctx, resilient_parsing=True)
        i += 1  # an argument of the command (its value is not checked)
    if isinstance(cmd, click.Group) and cmd is not cli and not any(a in ("-h", "--help") for a in args):
        return [f"{' '.join(path)} needs a command: {', '.join(sorted(cmd.commands))}"]
    return []


def check_text(text: str, where: str = "") -> tuple[int, list[str]]:
    """(commands found, problems) for one Markdown text."""
    count, problems = 0, []
    for n, line in code_lines(text):
        try:
            found = invocations(line)
        except ValueError as e:
            problems.append(f"{where}:{n}: cannot parse {line.strip()!r}: {e}")
            continue
        for args in found:
            count += 1
            problems += [f"{where}:{n}: {p}: {line.strip()}" for p in check_args(args)]
    return count, problems


# ---------------------------------------------------------------------------------------------
# (a) the site builds


def _installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:  # the parent package is missing
        return False


def test_the_site_builds_with_warnings_as_errors(tmp_path):
    missing = [m for m in ("mkdocs", "material", "mkdocstrings", "mkdocstrings_handlers.python") if not _installed(m)]
    if missing:
        pytest.skip(f"not installed: {', '.join(missing)} (the `docs` extra; scripts/setup --all installs it)")
    site = tmp_path / "site"
    r = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(site)], cwd=ROOT,
                       capture_output=True, text=True, timeout=300, env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    html = (site / "reference" / "cli" / "index.html").read_text()
    for path, _cmd, _ctx in load_generator().walk_commands():
        assert f'id="{"-".join(path)}"' in html, path
    for page in ("environment", "exit-codes", "json", "python-api"):
        assert (site / "reference" / page / "index.html").is_file(), page
    assert "dflash.Session" in (site / "reference" / "python-api" / "index.html").read_text()


def test_no_generated_page_is_checked_in():
    for rel in load_generator().PAGES:
        assert not (ROOT / "docs" / rel).exists(), f"docs/{rel} is generated when the site builds; remove the copy"


# ---------------------------------------------------------------------------------------------
# (b) every command the pages show exists, with flags it takes


def test_every_command_shown_in_the_docs_is_one_the_cli_accepts():
    total, problems = 0, []
    for page in PAGES:
        count, found = check_text(page.read_text(), str(page.relative_to(ROOT)))
        total += count
        problems += found
    assert not problems, "\n".join(problems)
    assert total >= 30, total  # the extractor finds the pages' commands (not a vacuous pass)


def test_the_readme_opens_with_the_two_commands():
    text = (ROOT / "README.md").read_text()
    first = "scripts/setup && DFLASH_DS4_EXACT_PREFILL_BANDS=1 .venv/bin/dflash prefill --compare-q1"
    second = ('scripts/setup --all && .venv/bin/ruff check . && .venv/bin/mypy && '
              '.venv/bin/python -m pytest -q -m "not long"')
    blocks = [line.strip() for _, line in code_lines(text)]
    assert blocks[:2] == [first, second], blocks[:2]
    assert len(text.splitlines()) <= 230


# ---------------------------------------------------------------------------------------------
# (c) the generated CLI reference lists every command and flag


def test_the_generated_cli_reference_lists_every_command_and_flag():
    gen = load_generator()
    page = gen.cli_page()
    sections: dict[str, str] = {}
    for part in re.split(r"^## ", page, flags=re.M)[1:]:
        heading, _, body = part.partition("\n")
        sections[re.sub(r"\s*\{#.*\}$", "", heading)] = body
    walked = list(gen.walk_commands())
    assert sorted(sections) == sorted(" ".join(path) for path, _, _ in walked)
    assert {"dflash records list", "dflash records show", "dflash records remove",
            "dflash kernels selftest"} <= set(sections)
    for path, cmd, ctx in walked:
        body = sections[" ".join(path)]
        for p in cmd.get_params(ctx):
            names = (*p.opts, *p.secondary_opts) if isinstance(p, click.Option) else (p.make_metavar(ctx),)
            for name in names:
                assert re.search(rf"`[^`]*(?<![\w-]){re.escape(name)}(?![\w-])[^`]*`", body), (path, name)
        if cmd.help:
            assert gen.help_markdown(cmd.help)[:60] in body, path


def test_the_generated_pages_name_every_environment_flag_and_exit_code():
    from dflash.core.settings import ENV_DOCS
    from dflash.native.graph_switches import ENV_SWITCHES

    gen = load_generator()
    env = gen.environment_page()
    for name in (*ENV_DOCS, *(s.name for s in ENV_SWITCHES)):
        assert f"`{name}`" in env, name
    codes = gen.exit_codes_page()
    for code in (0, 1, 2, 3, 4, 130):
        assert re.search(rf"^\| {code} \|", codes, re.M), code
    schemas = gen.json_page()
    for key in ("logits_sha256", "response_tokens_sha256", "qualification.path", "rows[].width"):
        assert f"`{key}`" in schemas, key


# ---------------------------------------------------------------------------------------------
# (d) the checker can fail

SAMPLE = """\
Prose that mentions dflash keeps the bits is not a command.

    dflash prefill --chunk 4 --no-such-flag
    .venv/bin/dflash plan --compare-q1
    DFLASH_X=1 .venv/bin/dflash nosuchcommand --json
    dflash records show --all 3f2a
    dflash records
    X=$(.venv/bin/dflash build --gpu hip --jsn | python3 -c 'print(1)')

```bash
dflash qualify --device vulkan:0 --widths 2,4 \\
    --nope
```

```python
import dflash  # not shell: not checked
```
"""

GOOD = """\
    dflash prefill --chunk 4 --compare-q1 --prompt-file - --json
    DFLASH_DS4_EXACT_PREFILL_BANDS=1 .venv/bin/dflash --debug prefill --compare-q1
    .venv/bin/dflash serve --port 8081 & curl -s http://127.0.0.1:8081/health
    dflash serve -- --chat-template chatml --whatever-llama-server-takes
    dflash records remove --all
    dflash kernels selftest --device hip:0 --build-dir=build/hip_kernels
    HIPLIB=$(.venv/bin/dflash build --lib exact --gpu hip --json | python3 -c 'import json')
    dflash qualify --serve --model M.gguf -- --chat-template gemma   # a comment: --not-a-flag
"""


def test_the_checker_catches_planted_commands_and_flags():
    count, problems = check_text(SAMPLE, "sample")
    assert count == 7, (count, problems)
    text = "\n".join(problems)
    for needle in ("dflash prefill has no option --no-such-flag", "dflash plan has no option --compare-q1",
                   "dflash has no command 'nosuchcommand'", "dflash records show has no option --all",
                   "dflash records needs a command", "dflash build has no option --jsn",
                   "dflash qualify has no option --nope"):
        assert needle in text, (needle, text)
    assert len(problems) == 7, text


def test_the_checker_accepts_what_the_cli_accepts():
    count, problems = check_text(GOOD, "good")
    assert (count, problems) == (8, [])
