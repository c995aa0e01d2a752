"""The documentation site: every relative link and image of docs/*.md and README.md resolves (file
and anchor), every page is in the navigation, and `mkdocs build --strict` passes. No model."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.docs.pages import DOCS, PAGES, README, ROOT, has_anchor, is_external, links

DOCS_TOOLS = ("mkdocs", "material", "mkdocstrings", "mkdocstrings_handlers.python")


def _missing_tools() -> list[str]:
    missing = []
    for name in DOCS_TOOLS:
        try:
            found = importlib.util.find_spec(name) is not None
        except ModuleNotFoundError:  # a dotted name whose parent is missing
            found = False
        if not found:
            missing.append(name)
    return missing


@pytest.mark.parametrize("page", [*PAGES, README], ids=lambda p: p.name)
def test_relative_links_and_images_resolve(page: Path):
    broken = []
    for target in links(page):
        if is_external(target):
            continue
        path, _, anchor = target.partition("#")
        linked = (page.parent / path).resolve() if path else page
        if not linked.exists():
            broken.append(f"{target}: no file {linked.relative_to(ROOT) if linked.is_relative_to(ROOT) else linked}")
        elif anchor and linked.suffix == ".md" and not has_anchor(linked, anchor):
            broken.append(f"{target}: no heading with anchor #{anchor} in {linked.name}")
    assert not broken, f"{page.name}: broken links:\n" + "\n".join(broken)


def test_every_page_is_in_the_navigation():
    config = (ROOT / "mkdocs.yml").read_text()
    assert not [p.name for p in PAGES if f" {p.name}" not in config]


def test_images_in_docs_are_used():
    """Every plot in docs/ is shown on some page (a plot no page shows is a stale file)."""
    shown = {(DOCS / target).resolve() for page in PAGES for target in links(page) if target.endswith(".png")}
    assert not [p.name for p in DOCS.glob("*.png") if p.resolve() not in shown]


def test_site_builds_strict(tmp_path):
    """Warnings fail the build: broken links or anchors, pages left out of the navigation,
    objects mkdocstrings cannot find."""
    missing = _missing_tools()
    if missing:
        pytest.skip(f"the docs tools are not installed ({', '.join(missing)}): pip install -e '.[docs]'")
    result = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
        cwd=ROOT, capture_output=True, text=True, timeout=300, env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert (tmp_path / "site" / "python-api" / "index.html").read_text().count('id="tokendance.LLM.generate"') == 1


def test_readme_code_is_the_tested_getting_started_code():
    """The README's Python examples are not run; each must appear word for word on the getting-started
    page, whose examples are (test_docs_examples.py)."""
    from tests.docs.pages import blocks

    started = (DOCS / "getting-started.md").read_text()
    for block in (b for b in blocks(README) if b.lang == "python"):
        assert block.code.strip() in started, f"README.md:{block.line} is not on getting-started.md"
