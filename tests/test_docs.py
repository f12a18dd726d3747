"""The documentation's relative links resolve, and docs/index.md reaches every page."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DOCS = REPO / "docs"
PAGES = sorted([*DOCS.glob("*.md"), REPO / "README.md"])

_FENCE = re.compile(r"^(```|~~~).*?^\1", re.M | re.S)
_CODE = re.compile(r"`[^`\n]*`")
_LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
_EXTERNAL = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*:|^//")


def relative_links(page: Path) -> list[str]:
    """Targets of the inline links and images of ``page`` that point into the repository
    (code spans and fenced blocks skipped; ``#anchor``-only and ``scheme:`` links too)."""
    text = _CODE.sub("", _FENCE.sub("", page.read_text()))
    targets = (m.group(1) for m in _LINK.finditer(text))
    return [t for t in targets if not _EXTERNAL.match(t) and not t.startswith("#")]


def _resolves(page: Path, target: str) -> bool:
    path = target.split("#", 1)[0].split("?", 1)[0]
    return (page.parent / path).exists()


def test_relative_links_resolve() -> None:
    broken = set()
    for page in PAGES:
        for target in relative_links(page):
            if not _resolves(page, target):
                broken.add((page.relative_to(REPO).as_posix(), target))
    assert broken == set(), "broken relative links (page, target)"


def test_index_links_every_page() -> None:
    index = DOCS / "index.md"
    linked = {(DOCS / t.split("#", 1)[0]).resolve() for t in relative_links(index)}
    orphans = [p.name for p in sorted(DOCS.glob("*.md")) if p != index and p not in linked]
    assert orphans == [], "docs/index.md does not link these pages"


def test_the_link_check_sees_links() -> None:
    page = DOCS / "index.md"
    assert "multi-rank.md" in relative_links(page)
    assert "../formats/SPEC.md" in relative_links(page)
    assert _resolves(page, "cli.md") and not _resolves(page, "no-such-page.md")
