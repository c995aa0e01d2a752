"""The pages' examples run: every fenced ```python block of docs/*.md that is not marked
`<!-- no-test -->`, page by page in one namespace (a page's blocks build on each other), against a
real `tokendance serve` on 127.0.0.1 where they call http://127.0.0.1:8000; and the cheap shell
lines (`tokendance ... --help`, `tokendance --version`)."""

from __future__ import annotations

import re
import subprocess
import sys
import textwrap

import pytest

from tests.docs.pages import PAGES, Block, blocks

DOCS_URL = "http://127.0.0.1:8000"  # where the pages' examples find `tokendance serve`
CHEAP_COMMAND = re.compile(r"^tokendance(?: [a-z]+)? --(?:help|version)$")


def runnable(page) -> list[Block]:
    return [b for b in blocks(page) if b.lang == "python" and not b.skipped]


PAGES_WITH_EXAMPLES = [page for page in PAGES if runnable(page)]


def test_examples_left_out_are_few():
    """Every page with a runnable block is run below; blocks that cannot run are marked, and rare."""
    marked = [b.name() for page in PAGES for b in blocks(page) if b.lang == "python" and b.skipped]
    assert len(marked) <= 5, f"too many examples the tests do not run: {marked}"


@pytest.mark.parametrize("page", PAGES_WITH_EXAMPLES, ids=lambda p: p.name)
def test_python_examples_run(page, plain_server, capsys):
    namespace = {"__name__": f"docs_{page.stem.replace('-', '_')}"}
    for block in runnable(page):
        code = block.code.replace(DOCS_URL, plain_server.url)
        try:
            exec(compile(code, block.name(), "exec"), namespace)  # noqa: S102 - the page's own example
        except Exception as exc:
            raise AssertionError(f"the example at {block.name()} failed: {exc!r}\n"
                                 f"{textwrap.indent(block.code, '    ')}") from exc
    assert capsys.readouterr().out.strip(), "the examples printed nothing"


def cheap_commands() -> list[str]:
    return sorted({line.split("#")[0].strip() for page in PAGES for b in blocks(page) if b.lang in ("sh", "bash")
                   for line in b.code.splitlines() if CHEAP_COMMAND.match(line.split("#")[0].strip())})


@pytest.mark.parametrize("command", cheap_commands())
def test_cheap_shell_lines_run(command):
    args = command.split()[1:]
    result = subprocess.run([sys.executable, "-m", "tokendance.cli", *args], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip()
