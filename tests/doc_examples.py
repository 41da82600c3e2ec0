"""The code blocks of the README and the docs/ pages, for the tests that run them.

A block that a test runs (every ```python block; a ```bash block whose command a test
runs as written) has, on the line above its fence, a marker naming that test:
`<!-- tested: tests/<area>/test_x.py::test_name -->`.  The test asks for its
blocks by its own name (`marked_blocks(page, "test_name")`), and tests/e2e/test_docs.py
checks that every python block has a marker whose test exists and reads that page."""

from __future__ import annotations

import dataclasses
import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parent.parent
MARKER = re.compile(r"<!--\s*tested:\s*(\S+?)::(\w+)\s*-->")
FENCE = re.compile(r"^```(\w*)[^\n]*\n(.*?)^```[ \t]*$", re.S | re.M)


@dataclasses.dataclass(frozen=True)
class Block:
    page: pathlib.Path
    line: int            # 1-based line of the opening fence
    language: str        # "python", "bash", ...
    code: str
    marker: tuple[str, str] | None  # (test file, test name) from the line above, if any

    def where(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"


def pages() -> list[pathlib.Path]:
    """The README and every docs/ page."""
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def blocks(page: pathlib.Path) -> list[Block]:
    text = page.read_text()
    out = []
    for m in FENCE.finditer(text):
        line = text.count("\n", 0, m.start()) + 1
        above = text[:m.start()].rstrip("\n").rsplit("\n", 1)[-1]
        marker = MARKER.search(above)
        out.append(Block(page, line, m.group(1), m.group(2), marker.groups() if marker else None))
    return out


def marked_blocks(page: str, test_name: str, language: str = "python") -> list[str]:
    """The code of the `language` blocks of `page` (a path from the repository root) whose
    marker names `test_name`; at least one, or the test has lost its example."""
    found = [b.code for b in blocks(ROOT / page) if b.language == language and b.marker
             and b.marker[1] == test_name]
    assert found, f"{page} has no python block marked for {test_name}"
    return found
