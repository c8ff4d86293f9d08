"""The manual's Python code runs as written: for README.md and for each page of docs/, every
```python block, in order, in one namespace, as a reader pasting them one after another would run
them. And the manual holds together: every relative link points to a file (and a heading) that
exists, and the README stays a product page.

A block is left out only when the line right before its fence is an HTML comment that says
why, ``<!-- not run: needs CUDA -->``. The blocks run in a fresh interpreter (a block may
register rules or change settings for good), with ``GradhooksWarning`` an error, and must
print nothing to stderr: no warning reaches the reader, torch's own included (without NumPy,
``import torch`` warns).
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

# Runs in the fresh interpreter: the blocks come as JSON [[first line, code], ...] on stdin;
# each is compiled as README.md at its own lines, so a traceback points at the README
RUNNER = """
import json, sys, warnings
import gradhooks
warnings.simplefilter("error", gradhooks.GradhooksWarning)
# (a library's notice of its own deprecations, not the README's code: peft calls an API of
# transformers' that warns so)
warnings.filterwarnings("ignore", category=FutureWarning, module=r"(transformers|peft)\\.")
namespace = {"__name__": "__main__"}
name, blocks = json.load(sys.stdin)
for line, code in blocks:
    exec(compile("\\n" * (line - 1) + code, name, "exec"), namespace)
"""


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


@pytest.mark.parametrize("page", PAGES, ids=[p.relative_to(ROOT).as_posix() for p in PAGES])
def test_page_code_runs_in_order(page: Path):
    blocks = python_blocks(page.read_text(encoding="utf-8"))
    name = page.relative_to(ROOT).as_posix()
    root = str(Path(gradhooks.__file__).resolve().parents[1])  # this checkout's gradhooks
    path = os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)
    run = subprocess.run(
        [sys.executable, "-c", RUNNER],
        input=json.dumps([name, blocks]),
        capture_output=True,
        text=True,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": path},
        timeout=300,
    )
    if run.returncode != 0:
        pytest.fail(f"{name}'s code failed:\n{run.stderr}", pytrace=False)
    if run.stderr:
        pytest.fail(f"{name}'s code ran but printed to stderr:\n{run.stderr}", pytrace=False)
