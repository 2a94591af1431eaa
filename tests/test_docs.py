"""Every relative link in README.md and docs/*.md leads to a file of this repository (and, with
``#anchor``, to a heading of that file): the docs must read the same in any checkout."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
_INLINE = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
_REFERENCE = re.compile(r"^\s{0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s.*)?$", re.MULTILINE)
_HTML = re.compile(r"""(?:href|src)\s*=\s*["']([^"']+)["']""")
_FENCE = re.compile(r"^(```|~~~).*?^\1", re.MULTILINE | re.DOTALL)
_EXTERNAL = re.compile(r"^[a-z][a-z0-9+.-]*:", re.IGNORECASE)


def links(text: str) -> list[str]:
    """Link targets of a Markdown page, code blocks and inline code left out."""
    text = re.sub(r"`[^`\n]*`", "", _FENCE.sub("", text))
    return [m.group(1) for pattern in (_INLINE, _REFERENCE, _HTML) for m in pattern.finditer(text)]


def anchors(text: str) -> set[str]:
    """GitHub's anchors of a page's headings: lower case, punctuation dropped, spaces to '-'."""
    found = set()
    for heading in re.findall(r"^#{1,6}\s+(.+?)\s*#*\s*$", _FENCE.sub("", text), re.MULTILINE):
        slug = re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")
        found.add(slug)
    return found


def problems(text: str, folder: Path) -> list[str]:
    """What is wrong with the relative links of a page ``text`` in ``folder`` (empty when none)."""
    out = []
    for target in links(text):
        if _EXTERNAL.match(target):
            continue
        path, _, anchor = target.partition("#")
        file = (folder / path).resolve()
        if not file.is_relative_to(REPO):
            out.append(f"{target}: outside the repository")
        elif path and not file.is_file():
            out.append(f"{target}: no such file")
        elif anchor and (file.suffix == ".md" or not path):
            headings = anchors(file.read_text() if path else text)
            if anchor not in headings:
                out.append(f"{target}: no heading with anchor #{anchor}")
    return out


def test_there_are_pages_and_links_to_check() -> None:
    assert len(PAGES) > 5 and len(links((REPO / "README.md").read_text())) > 5


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(REPO)))
def test_relative_links_resolve_inside_the_repository(page: Path) -> None:
    assert problems(page.read_text(), page.parent) == []


def test_the_checker_finds_what_is_wrong() -> None:
    text = ("# A page\n[a](../../shared/DESIGN.md) [b](missing.md) [c](guide.md#no-such-heading) "
            "[ok](guide.md#strategies) [web](https://example.com) `[code](nowhere.md)`\n"
            "[here](#a-page) [there](#elsewhere)\n"
            "[ref]: ../README.md#layout\n<img src=\"gone.png\">\n```\n[x](fenced.md)\n```\n")
    assert links(text) == ["../../shared/DESIGN.md", "missing.md", "guide.md#no-such-heading",
                           "guide.md#strategies", "https://example.com", "#a-page",
                           "#elsewhere", "../README.md#layout", "gone.png"]
    assert problems(text, REPO / "docs") == [
        "../../shared/DESIGN.md: outside the repository",
        "missing.md: no such file",
        "guide.md#no-such-heading: no heading with anchor #no-such-heading",
        "#elsewhere: no heading with anchor #elsewhere",
        "gone.png: no such file",
    ]
