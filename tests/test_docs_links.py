"""Every relative link in the README and docs/ reaches a file that exists and, where it
names an anchor, a heading of that file (anchors as GitHub makes them from headings).
Pages get split and headings renamed; a reader following a dead link is lost."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"\]\(([^)\s]+)\)")
FENCE = re.compile(r"^```.*?^```", flags=re.MULTILINE | re.DOTALL)


def _anchors(page: Path) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation but '-' and '_' dropped, spaces
    as '-', a repeated one suffixed -1, -2, ..."""
    seen: dict[str, int] = {}
    for heading in re.findall(r"^#{1,6} (.+)$", FENCE.sub("", page.read_text()), re.MULTILINE):
        slug = re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")
        count = seen.get(slug, 0)
        seen[slug] = count + 1
        if count:
            seen[f"{slug}-{count}"] = 1
    return set(seen)


def _links(page: Path) -> list[str]:
    return [
        target
        for target in LINK.findall(FENCE.sub("", page.read_text()))
        if not re.match(r"[a-z]+:", target)  # http:, https:, mailto:
    ]


def test_the_pages_exist_and_link_somewhere() -> None:
    assert ROOT / "docs" / "vllm.md" in PAGES
    assert any(_links(page) for page in PAGES)


@pytest.mark.parametrize("page", PAGES, ids=lambda page: page.name)
def test_every_relative_link_reaches_its_file_and_heading(page: Path) -> None:
    dead = []
    for target in _links(page):
        path, _, anchor = target.partition("#")
        goal = (page.parent / path).resolve() if path else page
        if not goal.exists():
            dead.append(f"{target} (no file {goal.relative_to(ROOT)})")
        elif anchor and (goal.suffix != ".md" or anchor not in _anchors(goal)):
            dead.append(f"{target} (no heading #{anchor} in {goal.relative_to(ROOT)})")
    assert not dead, f"{page.relative_to(ROOT)}: dead links: {dead}"


def test_a_dead_anchor_is_caught(tmp_path: Path) -> None:
    """The check itself: a renamed heading leaves its old anchor dead."""
    page = tmp_path / "page.md"
    page.write_text("# Title\n\n## Counters on `/metrics`\n\n## Counters on `/metrics`\n")
    assert _anchors(page) == {"title", "counters-on-metrics", "counters-on-metrics-1"}
    assert "counters" not in _anchors(page)
