"""The docs a newcomer reads: README.md short, with the two commands; every docs/ page
reachable from it; every relative link in README.md and docs/ resolving to a file."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
DOCS = ROOT / "docs"
# [text](target) and ![alt](target); the target up to whitespace or ")"
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")


def relative_links(md: Path) -> list[str]:
    """Targets of ``md``'s markdown links that are paths (no scheme, no pure #anchor),
    code blocks left out."""
    text = re.sub(r"```.*?```", "", md.read_text(encoding="utf-8"), flags=re.S)
    out = []
    for target in LINK.findall(text):
        if re.match(r"[a-z][a-z0-9+.-]*:", target) or target.startswith("#"):
            continue
        out.append(target.split("#", 1)[0])
    return out


def pages() -> list[Path]:
    return sorted(DOCS.glob("*.md"))


def test_readme_is_short_and_shows_the_two_commands() -> None:
    size = len(README.read_bytes())
    assert size < 8 * 1024, f"README.md is {size} bytes: keep it under 8 KB, put reference text in docs/"
    text = README.read_text(encoding="utf-8")
    assert "make sweep" in text and "make test" in text


def test_every_docs_page_is_linked_from_readme() -> None:
    linked = {(README.parent / t).resolve() for t in relative_links(README)}
    assert pages(), "docs/ has no pages"
    unlinked = [p.name for p in pages() if p.resolve() not in linked]
    assert not unlinked, f"docs pages not linked from README.md: {unlinked}"


@pytest.mark.parametrize("md", [README, *pages()], ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(md: Path) -> None:
    broken = [t for t in relative_links(md) if not (md.parent / t).exists()]
    assert not broken, f"{md.relative_to(ROOT)}: links to missing files: {broken}"


def test_link_finder_sees_links_and_skips_urls_and_code(tmp_path: Path) -> None:
    md = tmp_path / "x.md"
    md.write_text("[a](a.md) ![i](img/i.png#x) [u](https://e.org) [h](#top)\n```\n[c](code.md)\n```\n")
    assert relative_links(md) == ["a.md", "img/i.png"]
