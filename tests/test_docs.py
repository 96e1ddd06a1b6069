"""The documentation's links: every relative link in README.md, docs/*.md and
benchmarks/README.md names an existing file, and every ``#anchor`` a heading of
the page it points into; README.md stays short (the rest lives in docs/)."""

from __future__ import annotations

import re
from collections.abc import Iterable
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(30)

ROOT = Path(__file__).resolve().parents[1]
README_MAX_LINES = 300

_FENCE = re.compile(r"^\s*(```|~~~)")
_CODE_SPAN = re.compile(r"(`+)(.+?)\1")
_INLINE_LINK = re.compile(r"!?\[([^\]]*)\]\(\s*<?([^)\s>]*)>?(?:\s+\"[^\"]*\")?\s*\)")
_REF_LINK = re.compile(r"^\s{0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s+.*)?$")
_HEADING = re.compile(r"^\s{0,3}(#{1,6})\s+(.*?)\s*#*\s*$")
_HTML_ANCHOR = re.compile(r"<a\s+(?:name|id)=\"([^\"]+)\"")
_SCHEME = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*:")


def doc_files(root: Path = ROOT) -> list[Path]:
    """The pages whose links are checked."""
    docs = sorted((root / "docs").glob("*.md"))
    return [root / "README.md", *docs, root / "benchmarks" / "README.md"]


def _prose_lines(text: str) -> Iterable[tuple[int, str]]:
    """(line number, line) of the lines outside fenced code blocks."""
    fence = None
    for number, line in enumerate(text.splitlines(), 1):
        m = _FENCE.match(line)
        if m:
            if fence is None:
                fence = m.group(1)
            elif m.group(1) == fence:
                fence = None
            continue
        if fence is None:
            yield number, line


def slug(heading: str) -> str:
    """A heading's anchor as GitHub makes it: the text as shown (code and link
    markup dropped), lower case, every character but letters, digits, '-', '_'
    and spaces dropped, each space a '-'."""
    text = _CODE_SPAN.sub(lambda m: m.group(2), heading)
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", text)
    text = re.sub(r"<[^>]+>", "", text)
    text = re.sub(r"[^\w\- ]", "", text.strip().lower())
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """Every anchor a page has: its headings' slugs (a repeated one gets -1, -2, ...)
    and explicit ``<a name=...>`` / ``<a id=...>`` anchors."""
    seen: dict[str, int] = {}
    found: set[str] = set()
    for _, line in _prose_lines(path.read_text(encoding="utf-8")):
        found.update(_HTML_ANCHOR.findall(line))
        m = _HEADING.match(line)
        if not m:
            continue
        base = slug(m.group(2))
        n = seen.get(base, 0)
        seen[base] = n + 1
        found.add(base if n == 0 else f"{base}-{n}")
    return found


def links(path: Path) -> Iterable[tuple[int, str]]:
    """(line number, target) of every link and image of a page, outside code; a
    link whose text wraps onto the next line counts at the line it starts on."""
    text = path.read_text(encoding="utf-8")
    prose = [""] * (text.count("\n") + 1)  # code blocks blanked, line numbers kept
    for number, line in _prose_lines(text):
        prose[number - 1] = _CODE_SPAN.sub("code", line)
        m = _REF_LINK.match(prose[number - 1])
        if m:
            yield number, m.group(1)
    joined = "\n".join(prose)
    for m in _INLINE_LINK.finditer(joined):
        yield joined.count("\n", 0, m.start()) + 1, m.group(2)


def check_links(files: Iterable[Path]) -> list[str]:
    """One line per broken relative link: a file that does not exist, or an
    anchor that no heading of the page it points into has."""
    problems: list[str] = []
    cache: dict[Path, set[str]] = {}
    for page in files:
        for number, target in links(page):
            if not target or _SCHEME.match(target):
                continue  # an absolute URL (http:, mailto:) is not ours to check
            path_part, _, anchor = target.partition("#")
            where = f"{page}:{number}: {target}"
            dest = (page.parent / path_part).resolve() if path_part else page.resolve()
            if not dest.exists():
                problems.append(f"{where}: no such file {dest}")
                continue
            if not anchor or dest.suffix != ".md":
                continue
            if dest not in cache:
                cache[dest] = anchors(dest)
            if anchor not in cache[dest]:
                problems.append(f"{where}: no heading of {dest.name} has the anchor #{anchor}")
    return problems


def test_every_link_and_anchor_resolves() -> None:
    files = doc_files()
    assert all(f.exists() for f in files), files
    problems = check_links(files)
    assert not problems, "\n".join(problems)


def test_readme_is_short() -> None:
    lines = (ROOT / "README.md").read_text(encoding="utf-8").count("\n")
    assert lines <= README_MAX_LINES, f"README.md has {lines} lines: move the detail to docs/"


def test_index_lists_every_page() -> None:
    listed = {target.partition("#")[0] for _, target in links(ROOT / "docs" / "index.md")}
    pages = {p.name for p in (ROOT / "docs").glob("*.md")} - {"index.md"}
    assert pages <= listed, f"docs/index.md does not link {sorted(pages - listed)}"


def test_checker_finds_planted_broken_links(tmp_path: Path) -> None:
    (tmp_path / "sub").mkdir()
    other = "# Other page\n\n## Rank assignment by topology: `Tree`\n"
    (tmp_path / "sub" / "other.md").write_text(other)
    (tmp_path / "pic.png").write_bytes(b"")
    page = tmp_path / "page.md"
    page.write_text(
        "# Title\n\n## What's here\n\n## What's here\n\n"
        "[ok](sub/other.md) [ok](sub/other.md#rank-assignment-by-topology-tree) "
        "[ok](#whats-here) [ok](#whats-here-1) ![ok](pic.png) [web](https://example.com/x)\n"
        "[broken file](sub/missing.md)\n"
        "[broken anchor](sub/other.md#no-such-heading)\n"
        "[broken own anchor](#whats-here-2) [a link whose text\nwraps](nowhere.md)\n"
        "`[inside code](nowhere.md)`\n"
        "```\n[in a fence](nowhere.md)\n```\n"
    )
    problems = sorted(check_links([page]), key=lambda p: int(p.split(":")[1]))
    assert len(problems) == 4, problems
    assert "sub/missing.md" in problems[0] and "no such file" in problems[0]
    assert "#no-such-heading" in problems[1] and "other.md" in problems[1]
    assert "#whats-here-2" in problems[2] and ":10:" in problems[2]
    assert "nowhere.md" in problems[3] and ":10:" in problems[3]


def test_slug_follows_github() -> None:
    assert slug("Rank assignment by topology: `Tree`") == "rank-assignment-by-topology-tree"
    assert slug("Warm standbys (`--standby`) and cold restarts (issue 13)") == (
        "warm-standbys---standby-and-cold-restarts-issue-13"
    )
    assert slug("An initial barrier every rank derives; 4096 to 16,384 ranks") == (
        "an-initial-barrier-every-rank-derives-4096-to-16384-ranks"
    )
    assert slug("The [launcher](launcher.md): `inprocess-run`") == "the-launcher-inprocess-run"
