"""The docs check: commands in README.md and docs/*.md stay true, and their links lead somewhere.

A fenced block is *runnable* when the line right before its opening fence is `<!-- runnable -->`
(invisible on GitHub): ```bash blocks run under `bash -euo pipefail`, ```python blocks under this
interpreter, each from the repository root with a timeout. Only cheap commands are marked (a few
tokens of generation, `--help`); the README's two quick-start commands are not marked, since
.ci/run runs them. Every relative link (and image) must name an existing file, and an `#anchor`
into a markdown file must name one of its headings.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
MARKER = "<!-- runnable -->"
RUNNERS = ("bash", "python")
# per block: ~10 s of CPU each on an idle machine; MOESPEC_DOCS_TIMEOUT_S raises it on a loaded one
TIMEOUT_S = float(os.environ.get("MOESPEC_DOCS_TIMEOUT_S", "180"))
FENCE = re.compile(r"^(`{3,})(\S*)\s*$")
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")


def doc_files() -> list[Path]:
    """README.md and every docs/*.md page."""
    return [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]


@dataclass(frozen=True)
class Block:
    path: Path
    line: int  # 1-based line of the opening fence
    lang: str
    code: str

    def __str__(self) -> str:
        return f"{self.path.relative_to(REPO)}:{self.line}"


def runnable_blocks(path: Path, text: str | None = None) -> list[Block]:
    """The fenced blocks of `path` whose opening fence follows a `<!-- runnable -->` line."""
    lines = (path.read_text() if text is None else text).splitlines()
    blocks, i = [], 0
    while i < len(lines):
        opening = FENCE.match(lines[i])
        if not opening:
            i += 1
            continue
        end = next((j for j in range(i + 1, len(lines)) if lines[j].strip() == opening[1]), None)
        if end is None:
            raise ValueError(f"{path}:{i + 1}: unclosed code fence")
        marked = i > 0 and lines[i - 1].strip() == MARKER
        if marked:
            if opening[2] not in RUNNERS:
                raise ValueError(f"{path}:{i + 1}: a runnable block must be one of {RUNNERS}, got {opening[2]!r}")
            blocks.append(Block(path, i + 1, opening[2], "\n".join(lines[i + 1:end]) + "\n"))
        i = end + 1
    return blocks


def _without_code(text: str) -> str:
    """The text with fenced blocks and inline code spans blanked (links inside them are not links)."""
    out, fence = [], None
    for line in text.splitlines():
        opening = FENCE.match(line)
        if fence is None and opening:
            fence = opening[1]
            out.append("")
        elif fence is not None:
            fence = None if line.strip() == fence else fence
            out.append("")
        else:
            out.append(re.sub(r"`[^`]*`", "``", line))
    return "\n".join(out)


def heading_anchors(text: str) -> set[str]:
    """GitHub's anchors of the markdown headings: lowercase, punctuation dropped, spaces as hyphens,
    a repeated anchor numbered -1, -2, ..."""
    anchors: set[str] = set()
    for line in _headings(text):
        slug = re.sub(r"[^\w\- ]", "", line.strip().lower()).replace(" ", "-")
        candidate, n = slug, 0
        while candidate in anchors:
            n += 1
            candidate = f"{slug}-{n}"
        anchors.add(candidate)
    return anchors


def _headings(text: str) -> list[str]:
    lines, fence = [], None
    for line in text.splitlines():
        opening = FENCE.match(line)
        if fence is None and opening:
            fence = opening[1]
        elif fence is not None:
            fence = None if line.strip() == fence else fence
        elif re.match(r"^#{1,6} ", line):
            lines.append(line.lstrip("#").strip())
    return lines


def broken_links(path: Path, text: str | None = None) -> list[str]:
    """The relative links of `path` whose file (or heading) does not exist, as 'target: why'."""
    text = path.read_text() if text is None else text
    broken = []
    for target in LINK.findall(_without_code(text)):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
            continue
        file_part, _, anchor = target.partition("#")
        dest = (path.parent / file_part).resolve() if file_part else path
        if not dest.exists():
            broken.append(f"{target}: no such file {dest}")
        elif anchor and dest.suffix == ".md" and anchor not in heading_anchors(dest.read_text()):
            broken.append(f"{target}: no heading #{anchor} in {dest.name}")
    return broken


def run_block(block: Block, timeout_s: float = TIMEOUT_S) -> subprocess.CompletedProcess:
    """Run one block from the repository root, with this interpreter's environment first on PATH."""
    env = dict(os.environ, PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
               OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    if block.lang == "bash":
        cmd = ["bash", "-c", "set -euo pipefail\n" + block.code]
    else:
        cmd = [sys.executable, "-c", block.code]
    return subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout_s)


ALL_BLOCKS = [b for path in doc_files() for b in runnable_blocks(path)]


def test_docs_have_runnable_blocks_and_not_the_quick_start():
    readme = [b for b in ALL_BLOCKS if b.path.name == "README.md"]
    assert {b.lang for b in readme} == {"bash", "python"}, "the README's CLI and Python examples must be runnable"
    assert len(ALL_BLOCKS) >= 4
    for block in ALL_BLOCKS:  # .ci/run runs the install and the whole suite; a docs block must stay cheap
        assert "pip install" not in block.code and "pytest" not in block.code, block


@pytest.mark.parametrize("block", ALL_BLOCKS, ids=str)
def test_runnable_block(block: Block):
    result = run_block(block)
    assert result.returncode == 0, f"{block} exited {result.returncode}:\n{result.stdout[-2000:]}\n{result.stderr[-4000:]}"


@pytest.mark.parametrize("path", doc_files(), ids=lambda p: str(p.relative_to(REPO)))
def test_relative_links_resolve(path: Path):
    assert broken_links(path) == []


# ---------------------------------------------------------------- the check itself can fail
def test_the_marker_selects_only_the_block_right_after_it(tmp_path):
    text = ("intro\n<!-- runnable -->\n```bash\necho one\n```\n\n```bash\necho two\n```\n"
            "<!-- runnable -->\n\n```python\nprint(3)\n```\n<!-- runnable -->\n```python\nprint(4)\n```\n")
    blocks = runnable_blocks(tmp_path / "x.md", text)
    assert [(b.lang, b.code, b.line) for b in blocks] == [("bash", "echo one\n", 3), ("python", "print(4)\n", 16)]
    with pytest.raises(ValueError, match="runnable block must be one of"):
        runnable_blocks(tmp_path / "x.md", "<!-- runnable -->\n```\nls\n```\n")
    with pytest.raises(ValueError, match="unclosed"):
        runnable_blocks(tmp_path / "x.md", "```bash\nls\n")


def test_a_failing_block_fails(tmp_path):
    assert run_block(Block(tmp_path / "x.md", 1, "bash", "true\nfalse\ntrue\n")).returncode != 0
    assert run_block(Block(tmp_path / "x.md", 1, "bash", "false | true\n")).returncode != 0
    assert run_block(Block(tmp_path / "x.md", 1, "python", "raise SystemExit(3)\n")).returncode == 3
    assert run_block(Block(tmp_path / "x.md", 1, "bash", "moespec --help >/dev/null\n")).returncode == 0


def test_broken_links_are_found(tmp_path):
    (tmp_path / "there.md").write_text("# A `code` heading\n\n## Twice\n\n## Twice\n")
    page = tmp_path / "page.md"
    text = ("[ok](there.md) [ok](there.md#a-code-heading) [ok](there.md#twice-1) ![img](there.md) "
            "[web](https://example.com/x) `[not a link](nowhere.md)`\n```\n[in code](nowhere.md)\n```\n"
            "[gone](missing.md) [bad anchor](there.md#nope) [own](#page)\n# Page\n")
    page.write_text(text)
    assert broken_links(page, text) == [
        f"missing.md: no such file {tmp_path / 'missing.md'}", "there.md#nope: no heading #nope in there.md"]
