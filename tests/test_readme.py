"""The manual's Python code runs as written: for README.md and for each page of docs/, every
```python block, in order, in one namespace, as a reader pasting them one after another would run
them. And the manual holds together: every relative link points to a file (and a heading) that
exists, and the README stays a product page.

A block is left out only when the line right before its fence is an HTML comment that says
why, ``<!-- not run: needs CUDA -->``. Each page's blocks run in a process of their own (a
block may register rules or change settings for good), with ``GradhooksWarning`` an error, and
must print nothing to stderr: no warning reaches the reader, torch's own included (without
NumPy, ``import torch`` warns). On Linux one interpreter imports gradhooks, and nothing else,
and forks a child per page, as many at once as there are cores, so the pages share the cost of
importing torch; elsewhere each page has a fresh interpreter.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import gradhooks

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
PAGES = [README, *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"^```(\w*)\s*$")
NOT_RUN = re.compile(r"^<!--\s*not run:\s*\S.*-->\s*$")
PAGE_TIMEOUT = 300  # seconds
# fork after importing torch, safe on Linux; macOS may crash a forked child, Windows has no fork
FORK = sys.platform == "linux"

# What every page's process runs before its blocks. run_page runs a page's blocks,
# [[first line, code], ...], in order in one namespace, each compiled as the page at its own
# lines, so a traceback points at the page; an error ends the process as a script's would
SETUP = """
import json, os, sys, time, warnings
import gradhooks
warnings.simplefilter("error", gradhooks.GradhooksWarning)
# (a library's notice of its own deprecations, not the README's code: peft calls an API of
# transformers' that warns so)
warnings.filterwarnings("ignore", category=FutureWarning, module=r"(transformers|peft)\\.")

def run_page(name, blocks):
    namespace = {"__name__": "__main__"}
    for line, code in blocks:
        exec(compile("\\n" * (line - 1) + code, name, "exec"), namespace)
"""

# One page in a fresh interpreter: [name, blocks] as JSON on stdin
RUNNER = SETUP + "run_page(*json.load(sys.stdin))\n"

# The pages in children forked from one interpreter that has imported gradhooks and nothing
# else, as many at once as the machine has cores (each child at one torch thread: pages are
# small, and two children of two threads on two cores wait on each other's spinning threads):
# [[name, blocks, file for its stderr], ...] as JSON on stdin; prints the children's exit codes
# as JSON, in the pages' order (None: killed past the timeout)
FORKING_RUNNER = (
    SETUP
    + f"""
jobs = json.load(sys.stdin)
exits, running, waiting = [None] * len(jobs), {{}}, list(range(len(jobs)))
at_once = max(1, len(os.sched_getaffinity(0)))
while waiting or running:
    while waiting and len(running) < at_once:
        i = waiting.pop(0)
        name, blocks, stderr = jobs[i]
        sys.stdout.flush()
        sys.stderr.flush()
        child = os.fork()
        if child == 0:
            os.dup2(os.open(stderr, os.O_WRONLY | os.O_CREAT | os.O_TRUNC), 2)
            os.dup2(os.open(os.devnull, os.O_WRONLY), 1)
            if at_once > 1:
                import torch
                torch.set_num_threads(1)
            run_page(name, blocks)
            sys.exit(0)
        running[child] = (i, time.monotonic() + {PAGE_TIMEOUT})
    time.sleep(0.02)
    for child, (i, deadline) in list(running.items()):
        pid, status = os.waitpid(child, os.WNOHANG)
        if pid:
            exits[i] = os.waitstatus_to_exitcode(status)
        elif time.monotonic() > deadline:
            os.kill(child, 9)
            os.waitpid(child, 0)
        else:
            continue
        del running[child]
print(json.dumps(exits))
"""
)


def python_blocks(text: str) -> list[tuple[int, str]]:
    """The ```python blocks of ``text`` in order, as (line of their first code line, code),
    less those right after a ``<!-- not run: why -->`` line."""
    blocks, lines = [], text.splitlines()
    i = 0
    while i < len(lines):
        fence = FENCE.match(lines[i])
        if not fence:
            i += 1
            continue
        end = next((j for j in range(i + 1, len(lines)) if lines[j].startswith("```")), None)
        assert end is not None, f"line {i + 1}: a code block that is never closed"
        skipped = i > 0 and NOT_RUN.match(lines[i - 1])
        if fence.group(1) == "python" and not skipped:
            blocks.append((i + 2, "\n".join(lines[i + 1 : end]) + "\n"))
        i = end + 1
    return blocks


def test_python_blocks_are_found_and_a_marked_block_is_left_out():
    text = "\n".join(
        [
            "# Title", "```python", "a = 1", "```", "text",
            "<!-- not run: needs CUDA -->", "```python", "b = torch.ones(1, device='cuda')",
            "```", "```bash", "pip install gradhooks", "```", "<!-- a plain comment -->",
            "```python", "c = a + 1", "```",
        ]
    )  # fmt: skip
    assert python_blocks(text) == [(3, "a = 1\n"), (15, "c = a + 1\n")]


def test_readme_has_code():
    blocks = python_blocks(README.read_text(encoding="utf-8"))
    assert len(blocks) >= 2, f"only {len(blocks)} ```python blocks found in {README}"


def test_readme_is_a_product_page():
    lines = README.read_text(encoding="utf-8").count("\n")
    assert lines <= 200, f"README.md has {lines} lines: move the detail into a page of docs/"


# [text](target) and [text](target "title"); the text may run over lines
LINK = re.compile(r"\[(?:[^\]]|\n)*?\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")


def prose(text: str) -> str:
    """``text`` without its fenced code blocks and inline code, where brackets are code."""
    out, fenced = [], False
    for line in text.splitlines():
        if line.startswith("```"):
            fenced = not fenced
            continue
        out.append("" if fenced else re.sub(r"(`+).*?\1", "", line))
    return "\n".join(out)


def anchors(text: str) -> set[str]:
    """The anchors GitHub makes of a page's headings (outside code blocks): lower case,
    punctuation and backticks dropped, spaces as hyphens, a repeated heading numbered."""
    made, seen, fenced = set(), {}, False
    for line in text.splitlines():
        if line.startswith("```"):
            fenced = not fenced
        heading = None if fenced else re.match(r"^#{1,6}\s+(.*?)\s*$", line)
        if heading:
            slug = re.sub(r"[^\w\- ]", "", heading.group(1).lower()).replace(" ", "-")
            made.add(f"{slug}-{seen[slug]}" if slug in seen else slug)
            seen[slug] = seen.get(slug, 0) + 1
    return made


def test_anchors_are_githubs():
    text = "# Title\n## `grad1`'s memory, reused\n```\n# a comment\n```\n## Title"
    assert anchors(text) == {"title", "grad1s-memory-reused", "title-1"}


def links(page: Path) -> list[str]:
    return LINK.findall(prose(page.read_text(encoding="utf-8")))


def test_links_are_found():
    page = (
        "[a](docs/a.md) `[not](a link)` [b\nc](b.md#part) [web](https://x.org)\n```\n[no](x)\n```"
    )
    assert LINK.findall(prose(page)) == ["docs/a.md", "b.md#part", "https://x.org"]


@pytest.mark.parametrize("page", PAGES, ids=[p.relative_to(ROOT).as_posix() for p in PAGES])
def test_relative_links_resolve(page: Path):
    broken = []
    for target in links(page):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        file = (page.parent / path).resolve() if path else page
        if not file.exists():
            broken.append(f"{target}: no such file")
        elif anchor and file.suffix == ".md" and anchor not in anchors(file.read_text("utf-8")):
            broken.append(f"{target}: no heading #{anchor} in {file.name}")
    assert not broken, f"{page.relative_to(ROOT)}: broken links:\n" + "\n".join(broken)


def run(runner: str, stdin: object, timeout: float) -> subprocess.CompletedProcess:
    root = str(Path(gradhooks.__file__).resolve().parents[1])  # this checkout's gradhooks
    path = os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)
    return subprocess.run(
        [sys.executable, "-c", runner],
        input=json.dumps(stdin),
        capture_output=True,
        text=True,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": path},
        timeout=timeout,
    )


def name_of(page: Path) -> str:
    return page.relative_to(ROOT).as_posix()


@pytest.fixture(scope="module")
def page_runs(request, tmp_path_factory) -> dict[str, tuple[int | None, str]]:
    """Each page's exit code and stderr, for the pages whose test was collected; on Linux from
    one forking interpreter, elsewhere from one fresh interpreter per page."""
    pages = [
        item.callspec.params["page"]
        for item in request.session.items
        if getattr(item, "originalname", None) == "test_page_code_runs_in_order"
        and item.module is request.module
    ]
    runs = {}
    if not FORK:
        for page in pages:
            try:
                done = run(
                    RUNNER, [name_of(page), python_blocks(page.read_text("utf-8"))], PAGE_TIMEOUT
                )
            except subprocess.TimeoutExpired:
                runs[name_of(page)] = (None, "")
            else:
                runs[name_of(page)] = (done.returncode, done.stderr)
        return runs
    stderrs = tmp_path_factory.mktemp("stderr")
    jobs = [
        [name_of(page), python_blocks(page.read_text("utf-8")), str(stderrs / f"{i}.txt")]
        for i, page in enumerate(pages)
    ]
    done = run(FORKING_RUNNER, jobs, PAGE_TIMEOUT * (len(jobs) + 1))
    assert done.returncode == 0, f"the forking interpreter failed:\n{done.stderr}"
    for (name, _, stderr), code in zip(jobs, json.loads(done.stdout), strict=True):
        # (what the parent printed, importing gradhooks, each page's own interpreter would have)
        runs[name] = (code, done.stderr + Path(stderr).read_text("utf-8"))
    return runs


@pytest.mark.parametrize("page", PAGES, ids=[name_of(p) for p in PAGES])
def test_page_code_runs_in_order(page: Path, page_runs):
    name = name_of(page)
    code, stderr = page_runs[name]
    if code is None:
        pytest.fail(f"{name}'s code ran past {PAGE_TIMEOUT} s", pytrace=False)
    if code != 0:
        pytest.fail(f"{name}'s code failed:\n{stderr}", pytrace=False)
    if stderr:
        pytest.fail(f"{name}'s code ran but printed to stderr:\n{stderr}", pytrace=False)
