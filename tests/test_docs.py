"""The documentation's links: every relative link in README.md, docs/*.md and
benchmarks/README.md names an existing file, and every ``#anchor`` a heading of
the page it points into; README.md stays short (the rest lives in docs/). The
benchmark page's scoreboard names, in each row, a benchmark that exists and
results that exist."""

from __future__ import annotations

import re
from collections.abc import Iterable
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(30)

ROOT = Path(__file__).resolve().parents[1]
README_MAX_LINES = 300
BENCHMARKS_MAX_LINES = 450

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


_TABLE_ROW = re.compile(r"^\s*\|(.*)\|\s*$")
_BENCHMARK_PATH = re.compile(r"benchmarks/[\w./-]+")
#: a row's figure cell that says its measurement is not in yet (no command needed)
_PENDING = "see below"


def _cells(row: str) -> list[str]:
    return [c.strip() for c in _TABLE_ROW.match(row).group(1).split("|")]


def check_scoreboard(page: Path, root: Path = ROOT) -> list[str]:
    """One line per broken row of the page's ``## Scoreboard`` tables: a command
    that names no file under ``benchmarks/`` or one that does not exist, a row
    with no command whose figure is not "see below", or a linked file (a
    results file, a journal) that does not exist. Problems if there is no
    scoreboard or it has no row."""
    problems: list[str] = []
    rows = 0
    in_board = False
    header: list[str] | None = None
    for number, line in _prose_lines(page.read_text(encoding="utf-8")):
        if line.startswith("## "):
            in_board = line[3:].strip().lower() == "scoreboard"
            header = None
            continue
        if not in_board:
            continue
        if not _TABLE_ROW.match(line):
            header = None
            continue
        cells = _cells(line)
        if header is None:
            header = [c.lower() for c in cells]
            continue
        if all(set(c) <= set(":- ") for c in cells):
            continue  # the delimiter row
        rows += 1
        where = f"{page}:{number}"
        if len(cells) != len(header):
            problems.append(f"{where}: {len(cells)} cells under a header of {len(header)}")
            continue
        row = dict(zip(header, cells, strict=True))
        if "command" not in row:
            problems.append(f"{where}: a scoreboard table without a command column")
            continue
        figure = next((v for k, v in row.items() if k.startswith("figure")), "")
        commands = [m.group(2) for m in _CODE_SPAN.finditer(row["command"])]
        if not commands:
            if figure.lower() != _PENDING:
                problems.append(f"{where}: no command (only a {_PENDING!r} row may have none)")
            continue
        for command in commands:
            paths = _BENCHMARK_PATH.findall(command)
            if not paths:
                problems.append(f"{where}: command {command!r} names no benchmarks/ file")
            for path in paths:
                if not (root / path).is_file():
                    problems.append(f"{where}: command {command!r}: no such file {path}")
        for m in _INLINE_LINK.finditer(line):
            target = m.group(2).partition("#")[0]
            if target and not _SCHEME.match(target) and not (page.parent / target).exists():
                problems.append(f"{where}: linked file {target} does not exist")
    if rows == 0:
        problems.append(f"{page}: no scoreboard rows (a '## Scoreboard' section with tables)")
    return problems


def test_every_link_and_anchor_resolves() -> None:
    files = doc_files()
    assert all(f.exists() for f in files), files
    problems = check_links(files)
    assert not problems, "\n".join(problems)


def test_readme_is_short() -> None:
    lines = (ROOT / "README.md").read_text(encoding="utf-8").count("\n")
    assert lines <= README_MAX_LINES, f"README.md has {lines} lines: move the detail to docs/"


def test_the_scoreboard_names_existing_benchmarks_and_results() -> None:
    page = ROOT / "benchmarks" / "README.md"
    problems = check_scoreboard(page)
    assert not problems, "\n".join(problems)
    lines = page.read_text(encoding="utf-8").count("\n")
    assert lines <= BENCHMARKS_MAX_LINES, f"{page} has {lines} lines: history goes to results/"


def test_the_benchmark_journals_links_resolve() -> None:
    journals = sorted((ROOT / "benchmarks" / "results").glob("journal-*.md"))
    assert journals
    problems = check_links(journals)
    assert not problems, "\n".join(problems)


def test_scoreboard_checker_finds_planted_broken_rows(tmp_path: Path) -> None:
    (tmp_path / "benchmarks" / "results").mkdir(parents=True)
    (tmp_path / "benchmarks" / "ok.py").write_text("")
    (tmp_path / "benchmarks" / "results" / "journal-ok.md").write_text("# ok\n")
    page = tmp_path / "benchmarks" / "README.md"
    page.write_text(
        "# Benchmarks\n\n## Scoreboard\n\n### Group\n\n"
        "| what | figure: median (worst) | command | more |\n"
        "|---|---|---|---|\n"
        "| good | 1 s (2 s) | `benchmarks/ok.py --n 2` | [j](results/journal-ok.md) |\n"
        "| pending | see below | | |\n"
        "| missing file | 1 s | `benchmarks/missing.py` | |\n"
        "| broken link | 1 s | `benchmarks/ok.py` | [j](results/journal-gone.md#x) |\n"
        "| no command | 1 s | | |\n"
        "| no path | 1 s | `python ok.py` | |\n"
        "\n## The benchmarks\n\n| what | command |\n|---|---|\n| outside | |\n"
    )
    problems = check_scoreboard(page, tmp_path)
    assert len(problems) == 4, problems
    assert ":11:" in problems[0] and "no such file benchmarks/missing.py" in problems[0]
    assert ":12:" in problems[1] and "results/journal-gone.md does not exist" in problems[1]
    assert ":13:" in problems[2] and "no command" in problems[2]
    assert ":14:" in problems[3] and "names no benchmarks/ file" in problems[3]
    page.write_text("# Benchmarks\n\nNo table.\n")
    assert check_scoreboard(page, tmp_path) == [
        f"{page}: no scoreboard rows (a '## Scoreboard' section with tables)"
    ]


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
