"""README.md and docs/*.md as the tests read them: the pages in reading order, their fenced
blocks and what kind each one is, and the commands of the runnable ones with the output the
page shows under them.

A fenced block says what it is with its language (the fence's info string):

* ``sh``: run by ``tests/e2e/test_readme.py``, every command top to bottom.  Each command
  must start with ``mmctl``, ``python`` or ``curl`` (``.venv/bin/`` in front allowed, and
  ``VAR=value`` assignments before it); any other command is a problem.
* ``sh not-run``: shell commands the test does not run (a cluster, another machine, ``make``,
  minutes of benchmarks), marked so in the page itself.
* ``text``, ``json``, ``yaml``: not commands (diagrams, outputs, files); a line in one that
  looks like a shell command is a problem, so a command block cannot hide there.

Any other fence (none, ``bash``, ``console``...) is a problem: every block is either run or
explicitly marked.  In an ``sh`` block a ``#>`` line is what the command above it prints and
``# exit N`` at the end of a command's line the exit status it expects (default 0).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = ROOT / "docs"
READING_ORDER = "## Where to read on"  # README's list of the docs pages, in reading order

RUN, NOT_RUN = "sh", "sh not-run"
NOT_COMMANDS = ("text", "json", "yaml")
KINDS = (RUN, NOT_RUN, *NOT_COMMANDS)

_ENV = r"(?:[A-Za-z_]\w*=\S*\s+)*"  # VAR=value assignments before a command
RUNNABLE = re.compile(rf"^{_ENV}(?:(?:\.venv/bin/)?(?:mmctl|python)\b|curl\b)")
# What a shell command looks like, for blocks that must not hold one.
SHELLISH = re.compile(rf"^(?:\$ |{_ENV}(?:\.venv/bin/)?(?:mmctl|python3?|curl|make|kubectl|helm|"
                      r"docker|tritonserver|pip|export|source|cd)(?=\s|$))")
EXPECT = re.compile(r"#\s*exit\s+(\d+)\s*$")
OUTPUT = "#>"  # a line the command above it prints
ANY = "…"
TIME = r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d"  # when a change was made: differs every run
FENCE = re.compile(r"^(\s*)(`{3,}|~{3,})(.*)$")


@dataclass
class Block:
    page: str  # e.g. "docs/cli.md"
    line: int  # of the opening fence, 1-based
    info: str  # the fence's info string, e.g. "sh not-run"
    lines: list[tuple[int, str]]  # (line number, text without the fence's indentation)

    @property
    def kind(self) -> str:
        return " ".join(self.info.split())


@dataclass
class Step:
    page: str
    line: int  # where the command starts
    command: str
    expect_rc: int = 0
    output: list[str] = field(default_factory=list)  # the page's #> lines under it

    @property
    def where(self) -> str:
        return f"{self.page} line {self.line}"


@dataclass
class Page:
    name: str
    blocks: list[Block]
    steps: list[Step]
    problems: list[str]


def relative(path: Path) -> str:
    return path.resolve().relative_to(ROOT).as_posix()


def fenced_blocks(text: str, page: str) -> list[Block]:
    """Every fenced block (``` or ~~~, at any indentation, as inside a list item)."""
    blocks: list[Block] = []
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        indent, fence, info = len(m.group(1)), m.group(2), m.group(3).strip()
        body: list[tuple[int, str]] = []
        j = i + 1
        while j < len(lines):
            close = FENCE.match(lines[j])
            if close and close.group(2)[0] == fence[0] and len(close.group(2)) >= len(fence) \
                    and not close.group(3).strip():
                break
            line = lines[j]
            body.append((j + 1, line[indent:] if line[:indent].strip() == "" else line.lstrip()))
            j += 1
        blocks.append(Block(page, i + 1, info, body))
        i = j + 1
    return blocks


def block_steps(block: Block) -> tuple[list[Step], list[str]]:
    """Commands of an ``sh`` block: backslash continuations joined, heredocs kept whole,
    comments left to bash; and the lines that are not commands this test can run."""
    steps: list[Step] = []
    problems: list[str] = []
    body = block.lines
    k = 0
    while k < len(body):
        lineno, text_line = body[k]
        if text_line.startswith(OUTPUT):
            if not steps:
                problems.append(f"{block.page} line {lineno}: output before any command")
            else:
                steps[-1].output.append(text_line[len(OUTPUT):].strip())
            k += 1
            continue
        if not text_line.strip() or text_line.lstrip().startswith("#"):
            k += 1
            continue
        if not RUNNABLE.match(text_line.strip()):
            problems.append(f"{block.page} line {lineno}: `{text_line.strip()}` is not a command "
                            f"the docs test runs (mmctl, python, curl): fence the block as "
                            f"```{NOT_RUN} if it is not meant to run")
        parts = [text_line]
        heredoc = re.search(r"<<-?'?(\w+)'?", text_line)
        while parts[-1].rstrip().endswith("\\") and k + 1 < len(body):
            k += 1
            parts.append(body[k][1])
        if heredoc:
            end = heredoc.group(1)
            while k + 1 < len(body):
                k += 1
                parts.append(body[k][1])
                if body[k][1].strip() == end:
                    break
        m = EXPECT.search(parts[0]) if not heredoc else None
        steps.append(Step(block.page, lineno, "\n".join(parts), int(m.group(1)) if m else 0))
        k += 1
    return steps, problems


def parse_page(text: str, page: str) -> Page:
    blocks = fenced_blocks(text, page)
    steps: list[Step] = []
    problems: list[str] = []
    for block in blocks:
        if block.kind == RUN:
            found, wrong = block_steps(block)
            steps += found
            problems += wrong
        elif block.kind == NOT_RUN:
            continue
        elif block.kind in NOT_COMMANDS:
            problems += [f"{block.page} line {lineno}: `{line.strip()}` looks like a shell command "
                         f"in a ```{block.kind} block: fence it as ```{RUN} (run by the docs "
                         f"test) or ```{NOT_RUN}"
                         for lineno, line in block.lines if SHELLISH.match(line.strip())]
        else:
            problems.append(f"{block.page} line {block.line}: a fenced block with "
                            f"{'no language' if not block.info else repr(block.info)}: say what "
                            f"it is, one of {', '.join(KINDS)} (see tests/docs_pages.py)")
    return Page(page, blocks, steps, problems)


def read_page(path: Path) -> Page:
    return parse_page(path.read_text(), relative(path))


def docs_pages() -> list[Path]:
    return sorted(DOCS.glob("*.md"))


def reading_order() -> list[Path]:
    """README.md, then the docs pages in the order its "Where to read on" list links them."""
    text = README.read_text()
    assert READING_ORDER in text, f"README.md has no {READING_ORDER!r} section"
    section = text.split(READING_ORDER, 1)[1].split("\n## ", 1)[0]
    pages: list[Path] = []
    for target in re.findall(r"\]\((docs/[^)#\s]+\.md)\)", section):
        path = ROOT / target
        if path not in pages:
            pages.append(path)
    return [README, *pages]


def _normal(text: str) -> str:
    return " ".join(text.split())


def output_line(expected: str) -> re.Pattern:
    """What a ``#>`` line promises, as a pattern for one (whitespace-normalised) line."""
    pieces = re.split(f"({ANY}|{TIME})", _normal(expected))
    return re.compile("".join(".*?" if p == ANY else TIME if re.fullmatch(TIME, p) else re.escape(p)
                              for p in pieces))


def missing_output(expected: list[str], printed: str) -> str | None:
    """The first expected line that no printed line (after the previous one's) matches."""
    lines = [_normal(line) for line in printed.splitlines()]
    at = 0
    for want in expected:
        pattern = output_line(want)
        while at < len(lines) and not pattern.fullmatch(lines[at]):
            at += 1
        if at == len(lines):
            return want
        at += 1
    return None


# -- links, headings and named paths ---------------------------------------------------------

def prose(text: str) -> str:
    """The page without its fenced blocks (blank lines in their place)."""
    out = text.splitlines()
    for block in fenced_blocks(text, ""):
        for lineno in range(block.line, block.line + len(block.lines) + 2):
            if lineno - 1 < len(out):
                out[lineno - 1] = ""
    return "\n".join(out)


def anchors(text: str) -> set[str]:
    """GitHub's anchors of a page's headings: lower case, punctuation dropped, spaces to
    hyphens, repeats numbered."""
    seen: dict[str, int] = {}
    found = set()
    for line in prose(text).splitlines():
        m = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if not m:
            continue
        slug = re.sub(r"[^\w\- ]", "", m.group(1).lower()).replace(" ", "-")
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        found.add(slug if n == 0 else f"{slug}-{n}")
    return found


def links(text: str) -> list[str]:
    """Targets of the page's inline links, code spans left out."""
    without_code = re.sub(r"`[^`\n]*`", "", prose(text))
    return re.findall(r"\]\(([^)\s]+)\)", without_code)


def code_spans(text: str) -> list[str]:
    return re.findall(r"`([^`\n]+)`", prose(text))


def code_tokens(text: str) -> list[str]:
    """Words of the page's code: its code spans and the lines of its fenced blocks."""
    chunks = code_spans(text)
    for block in fenced_blocks(text, ""):
        chunks += [line for _, line in block.lines]
    tokens: list[str] = []
    for chunk in chunks:
        tokens += [t.strip("()[]{},;:'\"\\.") for t in re.split(r"[\s=,'\"]+", chunk) if t]
    return [t for t in tokens if t]
