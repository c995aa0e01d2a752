"""The documentation pages as the docs tests read them: fenced code blocks, links, and the anchors
each page's headings make. Plain text parsing, no Markdown library: the strict site build
(`mkdocs build --strict`) checks the same links again where MkDocs is installed."""

from __future__ import annotations

import re
import unicodedata
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
README = ROOT / "README.md"
PAGES = sorted(DOCS.glob("*.md"))
NO_TEST = "<!-- no-test -->"  # the line before a fenced block that the tests must not run

FENCE = re.compile(r"^(?P<indent>\s*)(?P<fence>```+|~~~+)\s*(?P<lang>[\w+-]*)")
LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\((?P<target>[^()\s]+)(?:\s+\"[^\"]*\")?\)")
INLINE_CODE = re.compile(r"(`+)(?:(?!\1).)+?\1")
HEADING = re.compile(r"^(#{1,6})\s+(?P<text>.+?)\s*#*\s*$")
DIRECTIVE = re.compile(r"^:::\s+(?P<identifier>[\w.]+)")


@dataclass(frozen=True)
class Block:
    """A fenced code block: its page, the line of its opening fence (1-based), its language."""

    page: Path
    line: int
    lang: str
    code: str
    skipped: bool  # marked NO_TEST

    def name(self) -> str:
        return f"{self.page.name}:{self.line}"


def blocks(page: Path) -> list[Block]:
    found, lines = [], page.read_text().splitlines()
    i = 0
    while i < len(lines):
        opening = FENCE.match(lines[i])
        if not opening:
            i += 1
            continue
        indent, fence = len(opening["indent"]), opening["fence"]
        before = next((lines[j].strip() for j in range(i - 1, -1, -1) if lines[j].strip()), "")
        body, j = [], i + 1
        while j < len(lines) and not lines[j].strip().startswith(fence):
            body.append(lines[j][indent:])
            j += 1
        found.append(Block(page, i + 1, opening["lang"].lower(), "\n".join(body) + "\n", before == NO_TEST))
        i = j + 1
    return found


def prose(page: Path) -> str:
    """The page without its fenced blocks and inline code: where its links are."""
    lines, inside = [], None
    for line in page.read_text().splitlines():
        opening = FENCE.match(line)
        if inside is None and opening:
            inside = opening["fence"]
        elif inside is not None and line.strip().startswith(inside):
            inside = None
        elif inside is None:
            lines.append(INLINE_CODE.sub("", line))
    return "\n".join(lines)


def links(page: Path) -> list[str]:
    """Every link and image target of the page."""
    return [m["target"] for m in LINK.finditer(prose(page))]


def is_external(target: str) -> bool:
    return re.match(r"^[a-z][a-z0-9+.-]*:", target) is not None  # http:, https:, mailto:, ...


def anchors(page: Path) -> set[str]:
    """The anchors a page has: its headings' (MkDocs' slugs for docs pages, GitHub's for the
    README) and the objects mkdocstrings renders for its `::: identifier` lines."""
    slug = github_slug if page.resolve() == README.resolve() else mkdocs_slug
    found = set()
    inside = None
    for line in page.read_text().splitlines():
        opening = FENCE.match(line)
        if inside is None and opening:
            inside = opening["fence"]
            continue
        if inside is not None:
            if line.strip().startswith(inside):
                inside = None
            continue
        heading, directive = HEADING.match(line), DIRECTIVE.match(line)
        if heading:
            found.add(slug(heading["text"]))
        elif directive:
            found.add(directive["identifier"])
    return found


def has_anchor(page: Path, anchor: str) -> bool:
    found = anchors(page)
    # mkdocstrings also renders each member of an object: `tokendance.LLM.generate`
    return anchor in found or any(anchor.startswith(identifier + ".") for identifier in found)


def heading_text(text: str) -> str:
    """A heading as rendered: no code backticks, links reduced to their text, no emphasis marks."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", text)
    return text.replace("`", "").replace("**", "").replace("*", "")


def mkdocs_slug(text: str) -> str:
    """Python-Markdown's toc slugify, as MkDocs uses it."""
    text = unicodedata.normalize("NFKD", heading_text(text)).encode("ascii", "ignore").decode()
    text = re.sub(r"[^\w\s-]", "", text).strip().lower()
    return re.sub(r"[-\s]+", "-", text)


def github_slug(text: str) -> str:
    """GitHub's heading anchors: lower case, punctuation dropped, each space a hyphen."""
    text = re.sub(r"[^\w\- ]", "", heading_text(text).strip().lower())
    return text.replace(" ", "-")
