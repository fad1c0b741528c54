"""Every fenced code block of README.md and docs/*.md runs here: one test per block, ``page:line``.

What each kind of block gets:

* ``python``: executed. The python blocks of one page run in order in one namespace and build on
  each other, as a reader following the page does (docs/integrations.md builds ``app`` in one block
  and wraps it in the next, docs/ledger.md imports ``LedgerPolicy`` once); so a block may use what
  an earlier block of its page imported. After a block runs, every global name its functions and
  lambdas read must exist: a handler's NameError would otherwise wait for a request that never
  comes. As in a fresh interpreter, the main thread has an event loop (one per page: ``grpc.aio``
  objects made at a block's top level need one).
* ``bash``, ``sh``, ``shell``, ``console`` (its ``$ `` lines): ``bash -n``, then each command is
  checked: ``pip install`` is not run, but every extra of ``askonce[...]`` or ``.[...]`` must be one
  of pyproject.toml's, and any other package one that pyproject.toml names; ``python FILE`` and
  ``bash FILE`` must name a file of the repository, ``python -c CODE`` must compile and
  ``python -m askonce.X`` must exist. A block with an ``askonce ...`` or ``python -m askonce...``
  command is then run by bash in the page's temporary directory within ``TIMEOUT`` seconds: those
  commands run for real (``python -m askonce`` from this checkout); every other ``python``, ``pip``
  and ``bash`` command is a stub that does nothing (shell utilities such as ``awk`` do run). The
  functions a shell block defines are defined in the page's later ones (docs/results.md's
  ``recap``). An ``askonce demo`` command runs once per module however many blocks show it (the same
  arguments after the pages' replacements: README.md, docs/demo.md and docs/results.md run one).
* ``json``: parsed.
* no language, ``text``: output, not run. Where it makes a claim that can be checked cheaply it is
  checked: an ``askonce-question:`` / ``askonce-reply:`` line (or a bare ``v=1, ...`` value) must
  parse; an ``askonce demo|simulate|report|audit`` command shown in it must be accepted by the
  command's own parser (nothing runs; ``[...]`` options are tried without and with, ``$var`` is 1);
  ``python FILE`` must name a file; a tree drawing (first line ``some/dir/``) must name files that
  exist.
* any other language (``nginx``, ``yaml``, ...): cannot run here, and must say so (below).

A block whose test runs alone (``-k 'docs/ledger.md:181'``) first runs the python and shell blocks
above it on its page.

A page gives a block what it needs in an HTML comment right before the fence (blank lines between
are allowed), invisible to readers::

    <!-- docs-test: skip: REASON -->

    <!-- docs-test
    setup: CODE              python run in the page's namespace before the block; more lines may
      MORE CODE              follow, indented
    teardown: CODE           python run after the block, even when it failed
    replace: `OLD` -> `NEW`  the block runs with OLD replaced by NEW (the page keeps what a reader
                             types: e.g. `askonce demo` -> `askonce demo --quick ...`); {...} in NEW
                             is formatted from the page's namespace, e.g. {docs.redis}
    -->

``skip:`` is for a block that truly cannot run (it needs nginx, Django, a service of the reader's);
its REASON is required, and ``test_blocks_that_do_not_run_are_marked_and_counted`` lists them and
pins their number. Setup code, teardown code and ``{...}`` see ``docs`` (:class:`Docs`):
``docs.target`` is the URL of a real HTTP target (tests/http_target.py), ``docs.redis`` the URL of
a real redis-server (tests/redis_server.py, started on first use), ``docs.serve(app)`` serves an
ASGI app on 127.0.0.1 and returns its URL, ``docs.cwd`` is the directory the page's shell blocks run
in.
"""

from __future__ import annotations

import ast
import asyncio
import builtins
import contextlib
import importlib.util
import io
import json
import os
import re
import shlex
import signal
import subprocess
import symtable
import sys
import textwrap
import threading
import time
import tomllib
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from unittest import mock

import pytest

import askonce
from askonce.core import wire

ROOT = Path(__file__).resolve().parents[2]
SRC = Path(askonce.__file__).resolve().parents[1]  # the askonce under test, for the subprocesses
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
TIMEOUT = 120.0  # seconds, per shell block
NOT_RUN = 4  # blocks marked `skip:`, each with its reason in the page: changing it is a decision

PYTHON = ("python", "py")
SHELL = ("bash", "sh", "shell", "console")
OUTPUT = ("", "text")
KEYS = ("skip", "setup", "teardown", "replace")
UNRUN_MARKS = "docs-test marks on a block that is not run"

# --- the pages' blocks ----------------------------------------------------------------------------


class PageError(ValueError):
    """A page that breaks the docs-test convention: an unclosed fence, an unknown directive, ..."""


@dataclass(frozen=True)
class Marks:
    """What the page's ``<!-- docs-test ... -->`` comment says about the block after it."""

    skip: str | None = None
    setup: str = ""
    teardown: str = ""
    replace: tuple[tuple[str, str], ...] = ()


@dataclass(frozen=True)
class Block:
    page: str  # relative to the repository: README.md, docs/ledger.md
    line: int  # of the opening fence, 1-based
    lang: str  # the info string's first word, lower case; "" without one
    text: str
    marks: Marks = Marks()

    @property
    def id(self) -> str:
        return f"{self.page}:{self.line}"


FENCE = re.compile(r"^(?P<indent> {0,3})(?P<fence>`{3,}|~{3,})(?P<info>.*)$")
DIRECTIVE = re.compile(r"^(?P<key>[a-z][a-z-]*):(?: (?P<value>.*)|$)")
REPLACE = re.compile(r"^`(?P<old>[^`]+)`\s*->\s*`(?P<new>[^`]*)`$")


def parse_marks(where: str, body: str) -> Marks:
    """The directives of one docs-test comment, ``body`` being what follows ``docs-test``."""
    entries: list[tuple[str, list[str]]] = []
    for raw in body.removeprefix(":").strip("\n").splitlines():
        line = raw.strip() if not entries else raw  # the first may follow `docs-test:` on its line
        m = DIRECTIVE.match(line)
        if m and m["key"] in KEYS:
            entries.append((m["key"], [(m["value"] or "").strip()]))
        elif not line.strip() or (entries and line[:1].isspace()):
            if entries:
                entries[-1][1].append(line)
        else:
            raise PageError(f"{where}: not a docs-test directive ({', '.join(KEYS)}): {line!r}")
    if not entries:
        raise PageError(f"{where}: a docs-test comment says nothing")
    skip: str | None = None
    setup: list[str] = []
    teardown: list[str] = []
    replace: list[tuple[str, str]] = []
    for key, (first, *more) in entries:
        text = "\n".join([first, *textwrap.dedent("\n".join(more)).splitlines()]).strip()
        if key == "skip":
            if not text:
                raise PageError(f"{where}: `skip:` needs a reason")
            skip = text
        elif key == "replace":
            r = REPLACE.match(text)
            if r is None:
                raise PageError(f"{where}: `replace:` takes `OLD` -> `NEW`, not {text!r}")
            replace.append((r["old"], r["new"]))
        else:
            (setup if key == "setup" else teardown).append(text)
    return Marks(skip, "\n".join(setup), "\n".join(teardown), tuple(replace))


def extract(page: str, markdown: str) -> list[Block]:
    """The fenced code blocks of one page, with what the docs-test comment before each says."""
    lines = markdown.splitlines()
    blocks: list[Block] = []
    pending: tuple[int, Marks] | None = None
    i = 0
    while i < len(lines):
        line = lines[i]
        start = line.strip()
        if start.startswith("<!-- docs-test"):
            if pending is not None:
                raise PageError(f"{page}:{pending[0]}: a docs-test comment with no block after it")
            end = i
            while "-->" not in lines[end]:
                end += 1
                if end == len(lines):
                    raise PageError(f"{page}:{i + 1}: a docs-test comment that is never closed")
            body = "\n".join(lines[i:end + 1]).strip()
            if not body.endswith("-->"):
                raise PageError(f"{page}:{end + 1}: text after a docs-test comment's -->")
            pending = (i + 1, parse_marks(f"{page}:{i + 1}", body[len("<!-- docs-test"):-3]))
            i = end + 1
            continue
        fence = FENCE.match(line)
        if fence is not None:
            mark, indent = fence["fence"], len(fence["indent"])
            if mark[0] == "`" and "`" in fence["info"]:
                i += 1  # inline code at the start of a line, not a fence
                continue
            closing = re.compile(rf"^ {{0,3}}{re.escape(mark[0])}{{{len(mark)},}}\s*$")
            end = i + 1
            while end < len(lines) and not closing.match(lines[end]):
                end += 1
            if end == len(lines):
                raise PageError(f"{page}:{i + 1}: a code block that is never closed")
            content = [re.sub(rf"^ {{0,{indent}}}", "", text) for text in lines[i + 1:end]]
            words = fence["info"].split()
            marks = pending[1] if pending is not None else Marks()
            blocks.append(Block(page, i + 1, words[0].lower() if words else "",
                                "\n".join(content) + "\n", marks))
            pending = None
            i = end + 1
            continue
        if start and pending is not None:
            raise PageError(f"{page}:{pending[0]}: a docs-test comment must precede its block")
        i += 1
    if pending is not None:
        raise PageError(f"{page}:{pending[0]}: a docs-test comment with no block after it")
    return blocks


def collect() -> tuple[list[Block], list[str]]:
    blocks: list[Block] = []
    errors: list[str] = []
    for path in PAGES:
        try:
            blocks += extract(path.relative_to(ROOT).as_posix(), path.read_text(encoding="utf-8"))
        except PageError as exc:
            errors.append(str(exc))
    return blocks, errors


BLOCKS, PAGE_ERRORS = collect()


# --- python ---------------------------------------------------------------------------------------


def unknown_globals(source: str, namespace: dict[str, Any]) -> list[str]:
    """The global names that the block's functions, lambdas and classes read but nothing defines."""
    missing: set[str] = set()

    def visit(table: symtable.SymbolTable) -> None:
        for child in table.get_children():
            for sym in child.get_symbols():
                name = sym.get_name()
                if (sym.is_global() and sym.is_referenced() and not sym.is_assigned()
                        and name not in namespace and not hasattr(builtins, name)):
                    missing.add(name)
            visit(child)

    visit(symtable.symtable(source, "<block>", "exec"))
    return sorted(missing)


def run_code(source: str, namespace: dict[str, Any], filename: str, first_line: int) -> None:
    """Run ``source`` in ``namespace``, its line numbers those of the page it comes from."""
    tree = ast.parse(source, filename)
    ast.increment_lineno(tree, first_line - 1)
    exec(compile(tree, filename, "exec"), namespace)


def run_python(block: Block, source: str, namespace: dict[str, Any]) -> None:
    run_code(source, namespace, str(ROOT / block.page), block.line + 1)
    missing = unknown_globals(source, namespace)
    if missing:
        raise NameError(f"{block.id}: the block's functions read {', '.join(missing)}, "
                        "which nothing defines")


# --- shell ----------------------------------------------------------------------------------------

CONTROL = set(";&|()\n")
KEYWORDS = {"{", "}", "do", "done", "then", "else", "elif", "fi", "if", "while", "until", "!",
            "time"}
PYTHONS = ("python", "python3")
ASSIGNMENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*=")


def strip_comments(script: str) -> str:
    """The script without its comments: ``#`` at the start of a word, outside quotes, to the end of
    its line (a comment's apostrophe is no quote)."""
    out: list[str] = []
    quote = ""
    i = 0
    while i < len(script):
        c = script[i]
        if quote:
            if c == "\\" and quote == '"':
                out.append(script[i:i + 2])
                i += 2
                continue
            quote = "" if c == quote else quote
        elif c == "\\":
            out.append(script[i:i + 2])
            i += 2
            continue
        elif c in "'\"":
            quote = c
        elif c == "#" and (not out or out[-1][-1:] in " \t\n;&|("):
            end = script.find("\n", i)
            i = len(script) if end < 0 else end
            continue
        out.append(c)
        i += 1
    return "".join(out)


def simple_commands(script: str) -> list[list[str]]:
    """The words of each simple command of a shell script, from the first word that runs something.

    Comments, redirections (and their targets), leading ``VAR=value`` and shell keywords are left
    out; a ``for``/``case`` header is no command. Good enough for the commands a page shows.
    """
    text = strip_comments(script).replace("\\\n", " ")
    lexer = shlex.shlex(text, posix=True, punctuation_chars=";&|()<>\n")
    lexer.whitespace = " \t\r"
    lexer.whitespace_split = True
    lexer.commenters = ""
    commands: list[list[str]] = []
    words: list[str] = []
    tokens = iter(lexer)
    for token in tokens:
        if token and set(token) <= CONTROL:
            commands.append(words)
            words = []
        elif "<" in token or ">" in token:
            next(tokens, None)  # the redirection's target
        else:
            words.append(token)
    commands.append(words)
    out: list[list[str]] = []
    for command in commands:
        while command and (command[0] in KEYWORDS or ASSIGNMENT.match(command[0])):
            command = command[1:]
        if command and command[0] not in ("for", "case", "in", "esac", "function"):
            out.append(command)
    return out


def pyproject() -> dict[str, Any]:
    data: dict[str, Any] = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))
    return data


def normal(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


REQUIREMENT = re.compile(r"(?P<name>\.|[A-Za-z0-9][A-Za-z0-9_.-]*)(?:\[(?P<extras>[^\]]*)\])?")


def check_pip(args: list[str]) -> list[str]:
    """What is wrong with ``pip ARGS`` as a line of the docs: extras and packages must be known."""
    if args[:1] != ["install"]:
        return [f"pip {' '.join(args)}: only `pip install` is checked"]
    project = pyproject()["project"]
    extras = set(project["optional-dependencies"])
    known = {normal(re.split(r"[\[<>=!~; ]", spec, maxsplit=1)[0])
             for specs in [project["dependencies"], *project["optional-dependencies"].values()]
             for spec in specs}
    problems: list[str] = []
    words = iter(args[1:])
    for word in words:
        if word in ("-r", "--requirement", "-c", "--constraint", "-i", "--index-url",
                    "--extra-index-url", "-t", "--target"):
            problems.append(f"pip install {word}: not checked here")
            next(words, None)
            continue
        if word.startswith("-"):
            continue
        m = REQUIREMENT.fullmatch(word)
        if m is None:
            problems.append(f"pip install {word}: not a requirement this test can check")
        elif m["name"] in (".", "askonce"):
            for extra in filter(None, (m["extras"] or "").split(",")):
                if extra.strip() not in extras:
                    problems.append(f"pip install {word}: pyproject.toml has no extra {extra!r} "
                                    f"(it has {', '.join(sorted(extras))})")
        elif normal(m["name"]) not in known:
            problems.append(f"pip install {word}: a package pyproject.toml does not name")
    return problems


def check_path(command: str, path: str) -> list[str]:
    if re.search(r"[<>$*{}]", path) or (ROOT / path).is_file():
        return []
    return [f"{command} {path}: the repository has no such file"]


def check_commands(script: str) -> tuple[list[str], bool]:
    """What is wrong with the block's commands, and whether it has an askonce command to run."""
    problems: list[str] = []
    runs = False
    for words in simple_commands(script):
        head, args = words[0], words[1:]
        if head == "askonce":
            runs = True
        elif head in ("pip", "pip3"):
            problems += check_pip(args)
        elif head in ("bash", "sh") and args and not args[0].startswith("-"):
            problems += check_path(head, args[0])
        elif head in PYTHONS and args[:1] == ["-m"] and len(args) > 1:
            if args[1] == "pip":
                problems += check_pip(args[2:])
            elif args[1].partition(".")[0] == "askonce":
                runs = True
                if importlib.util.find_spec(args[1]) is None:
                    problems.append(f"python -m {args[1]}: no such module")
        elif head in PYTHONS and args[:1] == ["-c"] and len(args) > 1:
            try:
                compile(args[1], "<python -c>", "exec")
            except SyntaxError as exc:
                problems.append(f"python -c: {exc}")
        elif head in PYTHONS and args and not args[0].startswith("-"):
            problems += check_path(head, args[0])
    return problems, runs


def bash_syntax(script: str) -> str | None:
    """``bash -n``'s complaint about the script, or None."""
    done = subprocess.run(["bash", "-n"], input=script, capture_output=True, text=True, timeout=30)
    return None if done.returncode == 0 else done.stderr.strip()


SHIMS = r"""
set -eo pipefail
if [ -f "$DOCS_FUNCTIONS" ]; then source "$DOCS_FUNCTIONS"; fi
trap 'declare -f >"$DOCS_FUNCTIONS"' EXIT
askonce() {
  if [ "${1-}" != demo ]; then "$DOCS_PY" -m askonce "$@"; return; fi
  local key; key="$DOCS_CACHE/$(printf '%s\n' "$@" | cksum | tr ' ' _)"
  if [ ! -f "$key.rc" ]; then
    local rc=0; "$DOCS_PY" -m askonce "$@" >"$key.out" 2>"$key.err" || rc=$?; echo "$rc" >"$key.rc"
  fi
  cat "$key.out"; cat "$key.err" >&2; return "$(cat "$key.rc")"
}
python() {
  if [ "${1-}" = -m ] && [[ "${2-}" == askonce* ]]; then "$DOCS_PY" "$@"; return; fi
  echo "docs-test: not run: python $*" >&2
}
python3() { python "$@"; }
pip() { echo "docs-test: not run: pip $*" >&2; }
pip3() { pip "$@"; }
bash() { echo "docs-test: not run: bash $*" >&2; }
"""


def run_shell(script: str, cwd: Path, cache: Path) -> subprocess.CompletedProcess[str]:
    """Run the block in bash with the askonce commands real and the others stubs (SHIMS).

    The functions a block defines are defined for the page's later blocks (kept in ``cwd``).
    """
    env = {**os.environ, "DOCS_PY": sys.executable, "DOCS_CACHE": str(cache),
           "DOCS_FUNCTIONS": str(cwd / ".docs-test-functions.sh"),
           "PYTHONPATH": os.pathsep.join(filter(None, [str(SRC), os.environ.get("PYTHONPATH")]))}
    proc = subprocess.Popen(["bash", "-c", SHIMS + script], cwd=cwd, env=env, text=True,
                            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=TIMEOUT)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        err += f"\ndocs-test: killed after {TIMEOUT:.0f} s"
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def console_script(text: str) -> str:
    """The commands of a console block: its ``$ `` lines."""
    return "".join(line[2:] + "\n" for line in text.splitlines() if line.startswith("$ "))


# --- output ---------------------------------------------------------------------------------------

CLI_COMMAND = re.compile(
    r"(?:^|[;&|(]|\bdo\b)\s*askonce\s+((?:demo|simulate|report|audit)\b[^;&|#>)]*)")


def cli_refuses(argv: list[str]) -> str | None:
    """None if ``askonce``'s own parser accepts ``argv`` (nothing runs), else what it says."""
    from askonce import _cli, cli

    original = _cli.Parser.parse_args

    def parse_only(self: _cli.Parser, *args: Any, **kwargs: Any) -> Any:
        parsed = original(self, *args, **kwargs)
        parsed.func = lambda _: 0
        return parsed

    err = io.StringIO()
    with (mock.patch.object(_cli.Parser, "parse_args", parse_only),
          contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO())):
        try:
            code: object = cli.main(argv)
        except SystemExit as exc:
            code = exc.code
    return None if code == 0 else err.getvalue().strip() or f"exit {code}"


def tree_problems(lines: list[str]) -> list[str]:
    """A tree drawing (``dir/`` then entries indented two spaces a level): every entry exists."""
    root = ROOT / lines[0].strip()
    problems: list[str] = []
    parents: list[Path] = [root]
    for line in lines[1:]:
        m = re.match(r"^(?P<indent>(?:  )+)(?P<name>[\w.-]+/?)(?:\s{2,}|$)", line)
        if m is None or len(m["indent"]) > 16:
            continue  # a description carried over from the line above
        depth = len(m["indent"]) // 2
        if depth > len(parents):
            problems.append(f"{line.strip()}: indented deeper than its parent")
            continue
        path = parents[depth - 1] / m["name"].rstrip("/")
        del parents[depth:]
        if m["name"].endswith("/"):
            parents.append(path)
        if not path.exists():
            problems.append(f"{path.relative_to(ROOT)}: drawn in the tree, not in the repository")
    return problems


def output_problems(text: str) -> list[str]:
    lines = text.splitlines()
    problems: list[str] = []
    first = lines[0].strip() if lines else ""
    if re.fullmatch(r"[\w.-]+(?:/[\w.-]+)*/", first) and (ROOT / first).is_dir():
        problems += tree_problems(lines)
    for line in lines:
        header = re.match(r"^(askonce-question|askonce-reply):\s*(.*)$", line)
        value = header[2] if header else line.strip() if line.startswith("v=1,") else None
        if value is not None:
            reply = header[1] == "askonce-reply" if header else "k=" not in value
            parsed = wire.parse_reply(value) if reply else wire.parse_question(value, 0.0)
            if isinstance(parsed, wire.Malformed):
                problems.append(f"{line.strip()}: does not parse ({parsed})")
        for m in CLI_COMMAND.finditer(line):
            command = re.sub(r"\$\{?\w+\}?", "1", m[1])
            without, with_ = re.sub(r"\[[^\]]*\]", "", command), re.sub(r"[\[\]]", "", command)
            for variant in dict.fromkeys([without, with_]):
                refused = cli_refuses(shlex.split(variant))
                if refused is not None:
                    problems.append(f"askonce {variant.strip()}: {refused}")
        for m in re.finditer(r"\bpython3? (?!-)(\S+\.py)\b", line):
            problems += check_path("python", m[1])
    return problems


# --- running a page -------------------------------------------------------------------------------


class Docs:
    """``docs`` in a page's namespace: what its docs-test setup, teardown and ``{...}`` may use."""

    def __init__(self, cwd: Path, served: list[Any]) -> None:
        self.cwd = cwd
        self.request: pytest.FixtureRequest | None = None
        self._served = served

    def _fixture(self, name: str) -> Any:
        assert self.request is not None
        return self.request.getfixturevalue(name)

    @property
    def target(self) -> str:
        """The URL (no trailing slash) of tests/http_target.py's real HTTP target."""
        url: str = self._fixture("http_server").url("")
        return url

    @property
    def redis(self) -> str:
        """The URL of a real redis-server (tests/redis_server.py), started on first use."""
        url: str = self._fixture("shared_redis").url
        return url

    def serve(self, app: Any) -> str:
        """Serve an ASGI app on 127.0.0.1 until the module's tests end: its URL, no slash after."""
        import uvicorn

        server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="critical"))
        thread = threading.Thread(target=server.run, daemon=True)
        thread.start()
        self._served.append((server, thread))
        limit = time.monotonic() + 10
        while not server.started:
            assert thread.is_alive() and time.monotonic() < limit, "the ASGI app did not start"
            time.sleep(0.01)
        port = server.servers[0].sockets[0].getsockname()[1]
        return f"http://127.0.0.1:{port}"


@dataclass
class PageRun:
    namespace: dict[str, Any]
    next: int = 0  # the index, among the page's blocks, of the next block to run
    failed: list[str] = field(default_factory=list)
    loop: asyncio.AbstractEventLoop = field(default_factory=asyncio.new_event_loop)


class Pages:
    """The pages' runs in this module: one namespace per page, and one cache for the demo."""

    def __init__(self, tmp: pytest.TempPathFactory) -> None:
        self.tmp = tmp
        self.cache = tmp.mktemp("docs-cache")
        self.served: list[Any] = []
        self.runs: dict[str, PageRun] = {}
        self.loops: list[asyncio.AbstractEventLoop] = []

    def fresh(self, page: str) -> PageRun:
        cwd = self.tmp.mktemp(re.sub(r"\W", "-", page))
        name = "docs_" + re.sub(r"\W", "_", page)
        run = PageRun({"__name__": name, "docs": Docs(cwd, self.served)})
        self.runs[page] = run
        self.loops.append(run.loop)
        return run

    def run(self, block: Block, request: pytest.FixtureRequest) -> None:
        blocks = [b for b in BLOCKS if b.page == block.page]
        index = blocks.index(block)
        run = self.runs.get(block.page)
        if run is None or run.next > index:
            run = self.fresh(block.page)
        docs: Docs = run.namespace["docs"]
        docs.request = request
        for earlier in blocks[run.next:index]:  # a block run alone: the blocks above it first
            if earlier.lang in PYTHON + SHELL and earlier.marks.skip is None:
                try:
                    self.one(earlier, run)
                except Exception as exc:
                    run.failed.append(f"{earlier.id}: {exc!r}")
        run.next = index + 1
        try:
            self.one(block, run)
        except BaseException as exc:
            if run.failed:
                exc.add_note("earlier blocks of the page failed: " + "; ".join(run.failed))
            raise

    def python(self, block: Block, run: PageRun) -> None:
        asyncio.set_event_loop(run.loop)
        try:
            with self.marked(block, run.namespace) as source:
                run_python(block, source, run.namespace)
        finally:
            asyncio.set_event_loop(None)

    @contextlib.contextmanager
    def marked(self, block: Block, namespace: dict[str, Any]) -> Iterator[str]:
        """The block's source with its replacements, inside its setup and teardown."""
        where = f"<docs-test setup of {block.id}>"
        if block.marks.setup:
            run_code(block.marks.setup, namespace, where, 1)
        try:
            source = block.text
            for old, new in block.marks.replace:
                if old not in source:
                    raise PageError(f"{block.id}: `replace:` {old!r} is not in the block")
                source = source.replace(old, new.format_map(namespace))
            yield source
        finally:
            if block.marks.teardown:
                run_code(block.marks.teardown, namespace, where.replace("setup", "teardown"), 1)

    def one(self, block: Block, run: PageRun) -> None:
        namespace = run.namespace
        if block.lang in PYTHON:
            self.python(block, run)
        elif block.lang in SHELL:
            script = console_script(block.text) if block.lang == "console" else block.text
            syntax = bash_syntax(script)
            assert syntax is None, f"{block.id}: bash -n: {syntax}"
            problems, runs = check_commands(script)
            assert not problems, "\n".join(problems)
            if runs:
                with self.marked(block, namespace) as source:
                    if block.lang == "console":
                        source = console_script(source)
                    done = run_shell(source, namespace["docs"].cwd, self.cache)
                assert done.returncode == 0 and "Traceback" not in done.stderr, (
                    f"{block.id} ended with {done.returncode}:\n{source}\n"
                    f"--- stdout (end) ---\n{done.stdout[-3000:]}\n"
                    f"--- stderr (end) ---\n{done.stderr[-3000:]}")
            else:
                assert block.marks == Marks(), f"{block.id}: {UNRUN_MARKS}"
        elif block.lang == "json":
            assert block.marks == Marks(), f"{block.id}: {UNRUN_MARKS}"
            json.loads(block.text)
        elif block.lang in OUTPUT:
            assert block.marks == Marks(), f"{block.id}: {UNRUN_MARKS}"
            problems = output_problems(block.text)
            assert not problems, "\n".join(problems)
        else:
            pytest.fail(f"{block.id}: a ```{block.lang} block cannot run here; if it truly cannot, "
                        "say why before it: <!-- docs-test: skip: REASON -->")

    def close(self) -> None:
        for server, thread in self.served:
            server.should_exit = True
            thread.join(10)
        for loop in self.loops:
            loop.close()


@pytest.fixture(scope="module")
def pages(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pages]:
    p = Pages(tmp_path_factory)
    yield p
    p.close()


# --- the tests ------------------------------------------------------------------------------------


def test_the_pages_follow_the_convention() -> None:
    assert not PAGE_ERRORS, "\n".join(PAGE_ERRORS)
    assert BLOCKS, "no code blocks found: are README.md and docs/ where they were?"


@pytest.mark.parametrize("block", BLOCKS, ids=[b.id for b in BLOCKS])
def test_block(block: Block, pages: Pages, request: pytest.FixtureRequest) -> None:
    if block.marks.skip is not None:
        pytest.skip(f"not run, as the page says: {block.marks.skip}")
    pages.run(block, request)


def test_blocks_that_do_not_run_are_marked_and_counted() -> None:
    marked = [f"{b.id} ({b.lang or 'output'}): {b.marks.skip}" for b in BLOCKS if b.marks.skip]
    kinds: dict[str, int] = {}
    for b in BLOCKS:
        kind = ("python" if b.lang in PYTHON else "shell" if b.lang in SHELL
                else "output" if b.lang in OUTPUT else b.lang)
        kinds[kind] = kinds.get(kind, 0) + 1
    summary = ", ".join(f"{n} {kind}" for kind, n in sorted(kinds.items()))
    print(f"{len(BLOCKS)} blocks ({summary}); not run ({len(marked)}):", *marked, sep="\n  ")
    assert len(marked) == NOT_RUN, (
        f"{len(marked)} blocks are marked not to run, NOT_RUN is {NOT_RUN}:\n" + "\n".join(marked))


# --- the checks can fail: the extractor and each kind of block on tiny in-memory pages ------------

UNIT = """\
# A page

<!-- docs-test
setup: base = 40
teardown:
  assert answer == 42
replace: `plus` -> `+`
-->

```python
answer = base plus 2
```

  ~~~ Bash and more words
  askonce --version
  ~~~

```
askonce-reply: v=1, b=0, dnr, r=exhausted
```
"""


def test_the_extractor_reads_fences_marks_and_lines() -> None:
    python, shell, output = extract("unit.md", UNIT)
    assert (python.id, python.lang) == ("unit.md:10", "python")
    assert python.text == "answer = base plus 2\n"
    assert python.marks == Marks(None, "base = 40", "assert answer == 42", (("plus", "+"),))
    assert (shell.id, shell.lang, shell.text) == ("unit.md:14", "bash", "askonce --version\n")
    assert (output.lang, output.marks) == ("", Marks())
    (nginx,) = extract("unit.md", "<!-- docs-test: skip: needs nginx -->\n```nginx\nx;\n```\n")
    assert nginx.marks.skip == "needs nginx"


@pytest.mark.parametrize(("markdown", "says"), [
    ("```python\nx = 1\n", "never closed"),
    ("<!-- docs-test: skip: why -->\n\ntext\n```python\n```\n", "must precede its block"),
    ("<!-- docs-test: skip: why -->\n", "no block after it"),
    ("<!-- docs-test: needs: redis -->\n```python\n```\n", "not a docs-test directive"),
    ("<!-- docs-test: skip: -->\n```python\n```\n", "needs a reason"),
    ("<!-- docs-test: replace: a -> b -->\n```python\n```\n", "takes `OLD` -> `NEW`"),
    ("<!-- docs-test: skip: why\n```python\n```\n", "never closed"),
])
def test_a_page_that_breaks_the_convention_is_refused(markdown: str, says: str) -> None:
    with pytest.raises(PageError, match=re.escape(says)):
        extract("unit.md", markdown)


def unit_block(pages: Pages, markdown: str) -> None:
    """Check the one block of ``markdown`` as test_block would, in a namespace of its own."""
    (block,) = extract("unit.md", markdown)
    pages.one(block, pages.fresh("unit.md"))


def test_the_unit_page_runs(pages: Pages) -> None:  # so the failures below are the breaks' own
    run = pages.fresh("unit.md")
    for block in extract("unit.md", UNIT):
        pages.one(block, run)
    assert run.namespace["answer"] == 42


def test_a_real_block_broken_fails(pages: Pages) -> None:
    (readme,) = [b for b in BLOCKS if b.page == "README.md" and b.lang == "python"]
    pages.one(readme, pages.fresh("unit.md"))
    broken = Block(readme.page, readme.line, "python", readme.text.replace("import askonce\n", ""))
    with pytest.raises(NameError, match="askonce"):
        pages.one(broken, pages.fresh("unit.md"))


@pytest.mark.parametrize(("code", "error"), [
    ("1 +\n", SyntaxError),
    ("print(undefined)\n", NameError),
    ("def handler():\n    return missing_helper()\n", NameError),  # never called, still found
    ("<!-- docs-test: teardown: assert x == 2 -->\nx = 1\n", AssertionError),
    ("<!-- docs-test: replace: `y` -> `z` -->\nx = 1\n", PageError),
])
def test_a_broken_python_block_fails(pages: Pages, code: str, error: type[Exception]) -> None:
    comment, _, code = code.rpartition("-->\n")
    with pytest.raises(error):
        unit_block(pages, f"{comment + '-->' if comment else ''}\n```python\n{code}```\n")


@pytest.mark.parametrize(("script", "says"), [
    ("if then fi\n", "bash -n"),
    ("pip install 'askonce[nosuchextra]'\n", "no extra 'nosuchextra'"),
    ("pip install -e '.[demo,plot]'\n", "no extra 'plot'"),
    ("pip install leftpad\n", "does not name"),
    ("python bench/no_such_bench.py --quick\n", "no such file"),
    ("bash scripts/no_such_script.sh\n", "no such file"),
    ("python -m askonce.no_such_module\n", "no such module"),
    ("python -c 'import (' \n", "python -c"),
    ("askonce simulate --no-such-flag\n", "ended with 2"),
    ("for s in 1 2; do askonce simulate --scenario nope --seed $s; done | sort\n", "ended with 2"),
    ("askonce audit missing.log  # a comment's apostrophe: it's fine\n", "ended with"),
])
def test_a_broken_shell_block_fails(pages: Pages, script: str, says: str) -> None:
    with pytest.raises(AssertionError, match=re.escape(says)):
        unit_block(pages, f"```bash\n{script}```\n")


def test_a_shell_block_runs_only_the_askonce_commands(pages: Pages) -> None:
    unit_block(pages, "```sh\npip install -e '.[demo]' && askonce --version\n"
                      "python bench/bench_retry.py --rounds 1000000   # a stub: not run\n```\n")
    (words,) = simple_commands("PYTHONPATH=x python <dir>/b.py -q > out.txt 2>&1  # c\n")
    assert words == ["python", "-q", "2"]  # the placeholder and the redirections are no arguments


@pytest.mark.parametrize(("text", "says"), [
    ("askonce-question: v=1, k=short, o=edge, b=2\n", "does not parse"),
    ("v=1, b=0, dnr, r=exhausted, pb=-1\n", "does not parse"),
    ("askonce simulate --scenario depth --no-such-flag\n", "unrecognized arguments"),
    ("askonce simulate --scenario depth [--no-such-flag]\n", "unrecognized arguments"),
    ("for s in 1 2; do askonce simulate --seed x$s; done\n", "invalid int value"),
    ("/usr/bin/time python bench/no_such_bench.py\n", "no such file"),
    ("src/askonce/\n  core/         pure\n    nothere.py  gone\n", "core/nothere.py"),
])
def test_a_wrong_output_block_fails(pages: Pages, text: str, says: str) -> None:
    with pytest.raises(AssertionError, match=re.escape(says)):
        unit_block(pages, f"```\n{text}```\n")


@pytest.mark.parametrize("markdown", [
    "<!-- docs-test: setup: x = 1 -->\n```\noutput\n```\n",
    "<!-- docs-test: replace: `a` -> `b` -->\n```bash\necho a\n```\n",
    '<!-- docs-test: teardown: x = 1 -->\n```json\n{}\n```\n',
])
def test_marks_on_a_block_that_is_not_run_are_refused(pages: Pages, markdown: str) -> None:
    with pytest.raises(AssertionError, match="marks on a block that is not run"):
        unit_block(pages, markdown)


def test_an_unknown_language_must_be_marked(pages: Pages) -> None:
    with pytest.raises(pytest.fail.Exception, match="docs-test: skip: REASON"):
        unit_block(pages, "```nginx\nlog_format x;\n```\n")
    with pytest.raises(json.JSONDecodeError):
        unit_block(pages, '```json\n{"a": 1,}\n```\n')
