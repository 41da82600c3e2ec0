"""The README and the docs/ pages stay true where a test can hold them to it:

- every ```python block is run by a test: the line above it names the test
  (`<!-- tested: tests/<area>/test_x.py::test_name -->`), which must exist and read that page;
- every way of starting jpaged that a ```bash block shows (`jpaged batch`, `jpaged serve`,
  `python scripts/serve_batch.py`, `python scripts/serve.py`, `make serve`, `make serve-http`,
  the Ray Serve command) is started by a test: some test that starts that command names each
  of its flags (and each flag's value, where the value is a choice or a file of the repository);
- every relative link points at a file that exists, and at a heading of it where it names one.

Text only: nothing here loads a model."""

from __future__ import annotations

import ast
import functools
import pathlib
import re
import shlex

import pytest

from doc_examples import ROOT, Block, blocks, pages

TESTS = ROOT / "tests"

# How a test starts each command: a test file "starts" it when its source matches.
STARTERS = {
    "batch": re.compile(r"scripts/serve_batch\.py|jpaged_command\(\"batch\"\)"),
    "serve": re.compile(r"scripts/serve\.py|jpaged_command\(\"serve\"\)"),
    # The Ray Serve command's main() builds deployment(...) and serve.run()s it; the tests
    # run those two calls on a local Ray (a second Ray cluster per test run is too slow).
    "ray": re.compile(r"deployment\((?s:.*)serve\.run"),
}
# The documented command -> which of STARTERS starts it.  `make serve` / `make serve-http`
# are checked against the Makefile's recipes below.
COMMANDS = [
    (re.compile(r"^make serve-http\b"), "serve"),
    (re.compile(r"^make serve\b"), "batch"),
    (re.compile(r"^jpaged batch\b"), "batch"),
    (re.compile(r"^jpaged serve\b"), "serve"),
    (re.compile(r"^python scripts/serve_batch\.py\b"), "batch"),
    (re.compile(r"^python scripts/serve\.py\b"), "serve"),
    (re.compile(r"^python -m jpaged\.entrypoints\.ray_serve\b"), "ray"),
]
MAKE_RECIPES = {"serve": "jpaged batch --config $(CONFIG)", "serve-http": "jpaged serve --config $(CONFIG)"}


@functools.cache
def sources_of_tests() -> dict[str, str]:
    """{path: source} of every test module but this one (which names the commands it looks for)."""
    return {str(p.relative_to(ROOT)): p.read_text() for p in sorted(TESTS.rglob("test_*.py"))
            if p.name != pathlib.Path(__file__).name}


def every_block() -> list[Block]:
    return [b for page in pages() for b in blocks(page)]


def page_name(block: Block) -> str:
    return str(block.page.relative_to(ROOT))


# ---------------------------------------------------------------- python examples
def marker_problem(b: Block) -> str | None:
    """Why `b`'s marker does not show a test that runs it, or None."""
    if b.marker is None:
        return f"{b.where()}: no `<!-- tested: tests/<area>/test_x.py::test_name -->` above the block"
    path, name = b.marker
    if not (ROOT / path).is_file():
        return f"{b.where()}: {path} does not exist"
    source = (ROOT / path).read_text()
    found = [n for n in ast.walk(ast.parse(source)) if isinstance(n, ast.FunctionDef) and n.name == name]
    if not found:
        return f"{b.where()}: {path} has no test {name}"
    if page_name(b) not in ast.get_source_segment(source, found[0]):
        return f"{b.where()}: {path}::{name} does not read {page_name(b)}"
    return None


def test_every_python_block_names_the_test_that_runs_it():
    python = [b for b in every_block() if b.language == "python"]
    assert python, "no python blocks found: the page parser is broken"
    problems = [p for p in map(marker_problem, python) if p]
    assert not problems, "\n".join(problems)


def test_every_marker_names_a_test_that_reads_its_page():
    problems = [p for p in map(marker_problem, [b for b in every_block() if b.marker]) if p]
    assert not problems, "\n".join(problems)


def test_a_missing_or_wrong_marker_is_caught():
    """The checks above can fail: no marker, a test that does not exist, one that reads another page."""
    page = ROOT / "docs" / "rl.md"
    assert "no `<!--" in marker_problem(Block(page, 1, "python", "", None))
    assert "has no test" in marker_problem(Block(page, 1, "python", "", ("tests/e2e/test_readme.py", "test_nope")))
    assert "does not read" in marker_problem(Block(ROOT / "docs" / "lora.md", 1, "python", "",
                                                   ("tests/e2e/test_readme.py", "test_docs_python_api_example")))


# ---------------------------------------------------------------- ways of starting jpaged
def command_lines(code: str) -> list[str]:
    """The shell commands of a bash block: continuations joined, comments dropped."""
    out = []
    for line in code.replace("\\\n", " ").splitlines():
        line = line.split(" #", 1)[0].strip()
        if line and not line.startswith("#"):
            out.append(line)
    return out


def flags(command: str) -> list[tuple[str, str | None]]:
    """(name, value) of each `--flag[=value]` / `--flag value` of a command, `[optional]`
    brackets and make's ARGS='...' unwrapped; `--config.x=v` is ("x", "v")."""
    words = shlex.split(command.replace("[", " ").replace("]", " "))
    words = [w for word in words for w in (shlex.split(word[5:]) if word.startswith("ARGS=") else [word])]
    out = []
    for i, word in enumerate(words):
        if not word.startswith("--"):
            continue
        name, eq, value = word[2:].partition("=")
        if not eq and i + 1 < len(words) and not words[i + 1].startswith("--"):
            value = words[i + 1]
        out.append((name.removeprefix("config."), value or None))
    return out


def must_appear(value: str | None) -> bool:
    """A flag's value that the starting test must use too: a choice (a bare word) or a file
    of this repository; not a number, a host or a path on the reader's machine."""
    if value is None:
        return False
    if re.fullmatch(r"[A-Za-z_][\w-]*", value):
        return value.lower() not in ("true", "false", "auto")
    return (ROOT / value).is_file()


def documented_starts() -> list[tuple[Block, str, str]]:
    """(block, command line, kind) for every command that starts jpaged."""
    out = []
    for b in every_block():
        if b.language not in ("bash", "sh", "shell"):
            continue
        for line in command_lines(b.code):
            kinds = [kind for pattern, kind in COMMANDS if pattern.match(line)]
            if kinds:
                out.append((b, line, kinds[0]))
    return out


def test_the_documented_starts_are_found():
    kinds = {kind for _, _, kind in documented_starts()}
    assert {"batch", "serve"} <= kinds, kinds  # the quick start's make serve / make serve-http at least


def test_make_serve_runs_the_commands_the_docs_say():
    makefile = (ROOT / "Makefile").read_text()
    for target, recipe in MAKE_RECIPES.items():
        body = re.search(rf"^{re.escape(target)}:.*\n((?:\t.*\n)+)", makefile, re.M)
        assert body and recipe in body.group(1), f"make {target} no longer runs `{recipe}`"
    assert re.search(r"^CONFIG\s*\??=\s*configs/smollm2_135m\.py$", makefile, re.M), "make serve's config moved"


@pytest.mark.parametrize("start", documented_starts(), ids=lambda s: f"{page_name(s[0])}: {s[1][:60]}")
def test_every_documented_start_is_started_by_a_test(start):
    block, line, kind = start
    if block.marker:  # a test runs this very line (test_every_marker_names_a_test_that_reads_its_page)
        return
    starters = {path: src for path, src in sources_of_tests().items() if STARTERS[kind].search(src)}
    assert starters, f"no test starts `{kind}` ({block.where()}: {line})"
    missing = []
    for name, value in flags(line):
        name_used = re.compile(rf"\b{re.escape(name)}\b")
        covering = [p for p, src in starters.items() if name_used.search(src)
                    and (not must_appear(value) or value in src)]
        if not covering:
            missing.append(f"--{name}" + (f"={value}" if must_appear(value) else ""))
    assert not missing, (f"{block.where()}: `{line}` -- no test that starts {kind} "
                         f"({', '.join(starters)}) uses {', '.join(missing)}")


def test_a_flag_no_test_uses_is_caught():
    """The check above can fail: a flag no starting test uses is reported."""
    starters = [src for src in sources_of_tests().values() if STARTERS["batch"].search(src)]
    assert flags("jpaged batch --config.no_such_field_anywhere=xyz [--port 8000]") == [
        ("no_such_field_anywhere", "xyz"), ("port", "8000")]
    assert not any(re.search(r"\bno_such_field_anywhere\b", src) for src in starters)
    assert flags("make serve ARGS='--config.kv_cache_dtype=int8'") == [("kv_cache_dtype", "int8")]


# ---------------------------------------------------------------- links
def slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def without_code(text: str) -> str:
    return re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)


@functools.cache
def anchors(page: pathlib.Path) -> frozenset[str]:
    """The anchors of a page's headings (a repeated heading's second is `slug-1`, ...)."""
    found, counts = set(), {}
    for heading in re.findall(r"^#+ (.*)$", without_code(page.read_text()), re.M):
        s = slug(heading)
        found.add(s if s not in counts else f"{s}-{counts[s]}")
        counts[s] = counts.get(s, 0) + 1
    return frozenset(found)


def test_every_relative_link_resolves():
    problems = []
    for page in [*pages(), ROOT / "benchmarks" / "README.md"]:
        for target in re.findall(r"\]\(([^)\s]+)\)", without_code(page.read_text())):
            if re.match(r"[a-z][a-z0-9+.-]*:", target):
                continue  # http:, https:, mailto:
            path, _, anchor = target.partition("#")
            file = (page.parent / path).resolve() if path else page
            where = f"{page.relative_to(ROOT)}: ({target})"
            if not file.exists():
                problems.append(f"{where}: no such file")
            elif anchor and file.suffix == ".md" and anchor not in anchors(file):
                problems.append(f"{where}: no heading with that anchor")
    assert not problems, "\n".join(problems)


def test_slugs_are_githubs():
    assert slug("KV memory (2-core CPU, SmolLM2-135M; 2026-11-26)") == "kv-memory-2-core-cpu-smollm2-135m-2026-11-26"
    assert slug("Bitwise-reproducible logprobs: `batch_invariant=True`") == \
        "bitwise-reproducible-logprobs-batch_invarianttrue"


def test_the_readme_stays_short():
    """The README is the quick start and a map (issue 39: at most 250 lines); the manual is docs/."""
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= 250, f"README.md has {len(lines)} lines: move the new text to a docs/ page"


def test_the_docs_index_lists_every_page():
    index = (ROOT / "docs" / "README.md").read_text()
    listed = set(re.findall(r"\]\(([\w-]+\.md)\)", index))
    pages_ = {p.name for p in (ROOT / "docs").glob("*.md")} - {"README.md"}
    assert pages_ <= listed, f"docs/README.md does not list {sorted(pages_ - listed)}"
