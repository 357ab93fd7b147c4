"""The documentation runs: every ```python block of docs/ and README.md, every page in the site's nav, every link.

A python block is a complete program, run as `python prog.py` in a fresh temporary directory on one CPU,
unless the line just before its fence is one of these markers:

    <!-- docs-test: launch 2 -->            run it with `replicator launch -n 2 prog.py` (1 to 4 processes)
    <!-- docs-test: continues -->           append it to the previous python block of the page, run the whole
    <!-- docs-test: compile-only (why) -->  only compile it (it needs several machines, a GPU, TensorFlow ...)

prog.py keeps each line at its line number in the page (blank lines fill the rest), so a traceback's line
numbers are the page's. Single-process blocks run in processes forked from a server that has imported torch
and replicator once (as `replicator.testing.run_replicas` does), which keeps the whole file well under a
minute; launched blocks start fresh processes through the real launcher.
"""

from __future__ import annotations

import multiprocessing
import os
import re
import runpy
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
PAGES = [*sorted(DOCS.rglob("*.md")), ROOT / "README.md"]
BLOCK_TIMEOUT_S = 240.0  # launched blocks start 3 interpreters; a loaded 2-core machine needs the slack
MAX_LAUNCHED = 4

FENCE = re.compile(r"^(?P<indent>\s*)(?P<fence>```+|~~~+)\s*(?P<info>[\w+-]*)")
MARKER = re.compile(r"^\s*<!--\s*docs-test:\s*(?P<body>.*?)\s*-->\s*$")
LAUNCH = re.compile(r"^launch (?P<n>\d+)$")
COMPILE_ONLY = re.compile(r"^compile-only \((?P<why>.+)\)$")


@dataclass(frozen=True)
class Block:
    """One ```python block: where it is, what it says, and how the marker before it says to run it."""

    page: str  # relative to the repository root
    line: int  # the line of its opening fence, from 1
    lines: tuple[tuple[int, str], ...]  # (page line, text) of the program: earlier blocks first if it continues
    how: str  # "run", "launch" or "compile"
    processes: int = 1
    problem: str = ""  # a marker this file does not know, or a "continues" with nothing before it

    @property
    def id(self) -> str:
        return f"{self.page}:{self.line}"

    def program(self) -> str:
        """The program, each line at its page line number so that tracebacks point into the page."""
        text = [""] * (max(number for number, _ in self.lines) if self.lines else 0)
        for number, line in self.lines:
            text[number - 1] = line
        return "\n".join(text) + "\n"


def _dedent(lines: list[tuple[int, str]], indent: str) -> list[tuple[int, str]]:
    """Strip the fence's indentation (blocks inside lists and tabs are indented in the page)."""
    return [(number, line[len(indent):] if line.startswith(indent) else line.lstrip()) for number, line in lines]


def blocks_of(path: Path) -> tuple[list[Block], list[str]]:
    """The page's python blocks, and the markers that stand before no python block (each a problem)."""
    page = str(path.relative_to(ROOT))
    lines = path.read_text().splitlines()
    blocks: list[Block] = []
    stray: list[str] = []
    previous: Block | None = None
    index = 0
    while index < len(lines):
        match = FENCE.match(lines[index])
        marker = MARKER.match(lines[index])
        following = FENCE.match(lines[index + 1]) if index + 1 < len(lines) else None
        if marker and not (following and following["info"] == "python"):
            stray.append(f"{page}:{index + 1}: a docs-test marker must stand on the line just before a ```python fence")
        if not match:
            index += 1
            continue
        opening, indent, info = index, match["indent"], match["info"]
        index += 1
        body: list[tuple[int, str]] = []
        while index < len(lines) and not re.match(rf"^\s*{re.escape(match['fence'])}\s*$", lines[index]):
            body.append((index + 1, lines[index]))
            index += 1
        index += 1  # past the closing fence
        if info != "python":
            continue
        before = MARKER.match(lines[opening - 1]) if opening > 0 else None
        how, processes, problem, code = "run", 1, "", _dedent(body, indent)
        if before:
            marker_body = before["body"]
            if marker_body == "continues":
                if previous is None:
                    problem = "`continues` but no python block comes before it on the page"
                else:
                    how, processes, code = previous.how, previous.processes, [*previous.lines, *code]
            elif launch := LAUNCH.match(marker_body):
                how, processes = "launch", int(launch["n"])
                if not 1 <= processes <= MAX_LAUNCHED:
                    problem = f"`launch {processes}`: blocks launch 1 to {MAX_LAUNCHED} processes"
            elif COMPILE_ONLY.match(marker_body):
                how = "compile"
            else:
                problem = (f"unknown docs-test marker {marker_body!r}: use `launch N`, `continues` or "
                           "`compile-only (why)`")
        previous = Block(page, opening + 1, tuple(code), how, processes, problem)
        blocks.append(previous)
    return blocks, stray


PARSED = [blocks_of(page) for page in PAGES]
BLOCKS = [block for blocks, _ in PARSED for block in blocks]
STRAY_MARKERS = [problem for _, stray in PARSED for problem in stray]

# What a block's process sees: one thread (the machine is shared), no display for matplotlib.
BLOCK_ENV = {"REPLICATOR_THREADS": "1", "OMP_NUM_THREADS": "1", "MPLBACKEND": "Agg", "REPLICATOR_DEVICE": "cpu"}
# What it must not inherit: a launcher's or Slurm's place in a job (a test suite run under srun, a variable
# a test left behind) would make a one-process block join a job, and REPLICATOR_* settings change its output.
FOREIGN = ("REPLICATOR_", "SLURM_", "TORCHELASTIC_", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE",
           "GROUP_RANK", "NODE_RANK", "MASTER_ADDR", "MASTER_PORT")


def _block_environment(environ: dict[str, str]) -> dict[str, str]:
    """`environ` without a job's variables, plus BLOCK_ENV."""
    return {**{key: value for key, value in environ.items() if not key.startswith(FOREIGN)}, **BLOCK_ENV}


# Runs inside the forked process: what `python prog.py` would set up, with stdout and stderr to a file.
WRAPPER = """\
import os, sys
os.chdir({workdir!r})
for key in [key for key in os.environ if key.startswith({foreign!r})]:
    del os.environ[key]
os.environ.update({env!r})
out = os.open("output.txt", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
os.dup2(out, 1)
os.dup2(out, 2)
sys.argv = ["prog.py"]
sys.path.insert(0, {workdir!r})
import runpy
runpy.run_path("prog.py", run_name="__main__")
"""


def _run_alone(workdir: Path) -> tuple[int | None, str]:
    """`python prog.py` in `workdir`, forked from a server that already imported torch and replicator."""
    context = multiprocessing.get_context("forkserver")
    # As replicator.testing.run_replicas asks, plus what torch imports when it builds the first optimizer
    # (2-3 s a process); whichever asks first in a session starts the one server.
    context.set_forkserver_preload(["torch", "replicator", "torch._dynamo"])
    wrapper = workdir / "_docs_test_wrapper.py"
    wrapper.write_text(WRAPPER.format(workdir=str(workdir), foreign=FOREIGN, env=BLOCK_ENV))
    process = context.Process(target=runpy.run_path, args=(str(wrapper),), kwargs={"run_name": "__main__"})
    process.start()
    process.join(BLOCK_TIMEOUT_S)
    finished = not process.is_alive()
    if not finished:
        process.kill()
        process.join()
    output = workdir / "output.txt"
    return process.exitcode if finished else None, output.read_text(errors="replace") if output.exists() else ""


def _run_launched(workdir: Path, processes: int) -> tuple[int | None, str]:
    """`replicator launch -n N prog.py` in `workdir`, through the real launcher."""
    command = [sys.executable, "-m", "replicator.cli", "launch", "-n", str(processes), "--threads", "1", "prog.py"]
    env = {**_block_environment(dict(os.environ)),
           "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    try:
        done = subprocess.run(command, cwd=workdir, env=env, capture_output=True, text=True, timeout=BLOCK_TIMEOUT_S)
    except subprocess.TimeoutExpired as expired:
        return None, str(expired.stdout or "") + str(expired.stderr or "")
    return done.returncode, done.stdout + done.stderr


@pytest.mark.timeout(BLOCK_TIMEOUT_S + 30)
@pytest.mark.parametrize("block", BLOCKS, ids=[block.id for block in BLOCKS])
def test_python_block_runs(block: Block, tmp_path: Path) -> None:
    assert not block.problem, f"{block.id}: {block.problem}"
    program = block.program()
    compiled = compile(program, f"{block.page} (block at line {block.line})", "exec")
    if block.how == "compile":
        assert compiled is not None
        return
    (tmp_path / "prog.py").write_text(program)
    code, output = _run_launched(tmp_path, block.processes) if block.how == "launch" else _run_alone(tmp_path)
    how = f"replicator launch -n {block.processes} prog.py" if block.how == "launch" else "python prog.py"
    if code is None:
        pytest.fail(f"{block.id}: `{how}` did not finish within {BLOCK_TIMEOUT_S:.0f} s (prog.py's line numbers are "
                    f"the page's)\n{output[-6000:]}")
    if code != 0:
        pytest.fail(f"{block.id}: `{how}` exited with {code} (prog.py's line numbers are the page's)\n"
                    f"{output[-6000:]}")


def test_every_marker_stands_before_a_python_block() -> None:
    assert not STRAY_MARKERS, "\n".join(STRAY_MARKERS)


def test_pages_have_python_blocks_to_run() -> None:
    """The parser finds the blocks (a fence it misread would silently test nothing)."""
    assert len(BLOCKS) >= 20, [block.id for block in BLOCKS]
    assert {block.how for block in BLOCKS} == {"run", "launch", "compile"}


# --- the site: nav and links ---------------------------------------------------------------------------


def _nav_pages() -> list[str]:
    """Every page the nav of mkdocs.yml names (the config's !!python tags are not needed to read it)."""
    import yaml

    class Loader(yaml.SafeLoader):
        pass

    Loader.add_multi_constructor("tag:yaml.org,2002:python/", lambda loader, suffix, node: None)
    config = yaml.load((ROOT / "mkdocs.yml").read_text(), Loader=Loader)
    pages: list[str] = []

    def walk(entry: object) -> None:
        if isinstance(entry, str):
            pages.append(entry)
        elif isinstance(entry, list):
            for item in entry:
                walk(item)
        elif isinstance(entry, dict):
            for value in entry.values():
                walk(value)

    walk(config["nav"])
    return pages


def test_every_page_is_in_the_nav_and_every_nav_entry_is_a_page() -> None:
    nav = _nav_pages()
    on_disk = {str(page.relative_to(DOCS)) for page in DOCS.rglob("*.md")}
    assert not on_disk - set(nav), f"pages missing from mkdocs.yml's nav: {sorted(on_disk - set(nav))}"
    assert not set(nav) - on_disk, f"nav entries without a page under docs/: {sorted(set(nav) - on_disk)}"
    assert len(nav) == len(set(nav)), "a page appears twice in the nav"


LINK = re.compile(r"(?<!!)\[[^\]]*\]\((?P<target>[^)\s]+)(?:\s+\"[^\"]*\")?\)")


def _anchors(path: Path) -> set[str]:
    """The heading ids of a Markdown page, as mkdocs's toc extension makes them."""
    from markdown.extensions.toc import slugify

    anchors: set[str] = set()
    fenced = False
    for line in path.read_text().splitlines():
        if FENCE.match(line):
            fenced = not fenced
        elif not fenced and (heading := re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)):
            anchors.add(slugify(re.sub(r"[`*]", "", heading[1]), "-"))
    return anchors


def _links(path: Path) -> list[tuple[int, str]]:
    found: list[tuple[int, str]] = []
    fenced = False
    for number, line in enumerate(path.read_text().splitlines(), start=1):
        if FENCE.match(line):
            fenced = not fenced
        elif not fenced:
            found += [(number, match["target"]) for match in LINK.finditer(re.sub(r"`[^`]*`", "", line))]
    return found


@pytest.mark.parametrize("page", [*PAGES, ROOT / "CHANGELOG.md"], ids=lambda page: str(page.relative_to(ROOT)))
def test_relative_links_resolve(page: Path) -> None:
    """A link goes to a file of the clone (and a heading of it); a page of the site links only inside docs/."""
    broken = []
    for number, target in _links(page):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # https:, mailto: ...
            continue
        file, _, anchor = target.partition("#")
        resolved = (page.parent / file).resolve() if file else page
        where = f"{page.relative_to(ROOT)}:{number}: {target}"
        if not resolved.exists():
            broken.append(f"{where}: no such file")
        elif page.is_relative_to(DOCS) and not resolved.is_relative_to(DOCS):
            broken.append(f"{where}: outside docs/, so the site cannot link to it (name it as `code` instead)")
        elif anchor and resolved.suffix == ".md" and anchor not in _anchors(resolved):
            broken.append(f"{where}: no heading with that anchor")
    assert not broken, "\n".join(broken)


def test_commands_in_the_docs_parse() -> None:
    """`replicator ...` lines of ```bash blocks are accepted by the command's own parser (no stale options)."""
    from replicator.cli import build_parser

    failures = []
    for page in PAGES:
        lines = page.read_text().splitlines()
        in_bash = False
        for number, line in enumerate(lines, start=1):
            if match := FENCE.match(line):
                in_bash = not in_bash and match["info"] in ("bash", "sh", "console")
                continue
            command = line.strip()
            if not in_bash or not command.startswith("replicator ") or "$" in command:  # $: the shell's to expand
                continue
            following = iter(lines[number:])
            while command.endswith("\\"):  # a command continued on the next lines
                command = command[:-1] + " " + next(following, "").strip()
            words = shlex.split(command, comments=True)
            try:
                build_parser().parse_args(words[1:])
            except SystemExit:
                failures.append(f"{page.relative_to(ROOT)}:{number}: {command}")
    assert not failures, "the replicator command rejects:\n" + "\n".join(failures)


def test_the_site_builds_with_warnings_as_errors(tmp_path: Path) -> None:
    pytest.importorskip("mkdocs")
    pytest.importorskip("mkdocstrings")
    built = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path)],
                           cwd=ROOT, capture_output=True, text=True, timeout=180,
                           env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})
    warnings = [line for line in built.stderr.splitlines() if "WARNING" in line or "ERROR" in line]
    assert built.returncode == 0, "mkdocs build --strict failed:\n" + "\n".join(warnings or [built.stderr[-3000:]])


def test_the_command_line_reference_names_every_option_and_variable() -> None:
    """docs/reference/cli.md keeps up with the parsers and with replicator/_env.py."""
    import argparse

    from replicator import _env
    from replicator.cli import build_parser

    page = (DOCS / "reference" / "cli.md").read_text()
    missing = []
    subcommands = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    for name, parser in subcommands.choices.items():
        if f"`replicator {name}`" not in page:
            missing.append(f"a section on `replicator {name}`")
        for action in parser._actions:
            if action.option_strings and "--help" not in action.option_strings:
                option = max(action.option_strings, key=len)
                if f"`{option}" not in page and f", `{option}" not in page:
                    missing.append(f"replicator {name} {option}")
    variables = [value for key, value in vars(_env).items()
                 if key.isupper() and isinstance(value, str) and value.startswith("REPLICATOR_")]
    missing += [variable for variable in variables if f"`{variable}`" not in page]
    assert not missing, "docs/reference/cli.md does not mention: " + ", ".join(missing)
