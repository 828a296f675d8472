"""The README's command blocks, run in order against a started stack, so the docs cannot rot.

Every fenced block whose commands start with ``mmctl``, ``.venv/bin/mmctl``,
``.venv/bin/python`` or ``curl`` is run as written, top to bottom, with bash.  Only the
addresses change: the stack runs on free ports, so ``localhost:8000/8001`` (the router) point
at its ports, ``mmctl`` finds the admin API through ``MMCTL_URL``, and ``curl`` fails on an
HTTP error.  A command is expected to exit 0 unless its line ends with ``# exit N``, and to
print what the README shows under it: each ``#>`` line must match a line of its output
(stdout, then stderr), in order, where ``…`` stands for any text, runs of spaces for any
run of spaces (table columns), and a ``YYYY-MM-DD HH:MM:SS`` time for any such time.  The
README's default ports (admin API 8090, router 8000/8001) stand for the stack's.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from control_plane.triton.process import free_port
from tests.product import Product

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
RUNNABLE = re.compile(r"^(\.venv/bin/)?(mmctl|python)\b|^curl\b")
EXPECT = re.compile(r"#\s*exit\s+(\d+)\s*$")
OUTPUT = "#>"  # a line the command above it prints
ANY = "…"
TIME = r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d"  # when a change was made: differs every run
# mmctl records who made a registry change (getpass reads LOGNAME first); the README's
# outputs name alice.
README_USER = "alice"


@dataclass
class Step:
    line: int  # where the command starts in README.md
    command: str
    expect_rc: int = 0
    output: list[str] = field(default_factory=list)  # the README's #> lines under it


def readme_steps(text: str) -> list[Step]:
    """Commands of the runnable fenced blocks: backslash continuations joined, heredocs kept
    whole, comments left to bash."""
    steps: list[Step] = []
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        if not lines[i].startswith("```"):
            i += 1
            continue
        j = i + 1
        block: list[tuple[int, str]] = []
        while j < len(lines) and not lines[j].startswith("```"):
            block.append((j + 1, lines[j]))
            j += 1
        i = j + 1
        first = next((t for _, t in block if t.strip()), "")
        if not RUNNABLE.match(first.strip()):
            continue
        k = 0
        first_step = len(steps)
        while k < len(block):
            lineno, text_line = block[k]
            if text_line.startswith(OUTPUT):
                assert len(steps) > first_step, f"README.md line {lineno}: output before any command"
                steps[-1].output.append(text_line[len(OUTPUT):].strip())
                k += 1
                continue
            if not text_line.strip() or text_line.lstrip().startswith("#"):
                k += 1
                continue
            parts = [text_line]
            heredoc = re.search(r"<<-?'?(\w+)'?", text_line)
            while parts[-1].rstrip().endswith("\\") and k + 1 < len(block):
                k += 1
                parts.append(block[k][1])
            if heredoc:
                end = heredoc.group(1)
                while k + 1 < len(block):
                    k += 1
                    parts.append(block[k][1])
                    if block[k][1].strip() == end:
                        break
            command = "\n".join(parts)
            m = EXPECT.search(parts[0]) if not heredoc else None
            steps.append(Step(lineno, command, int(m.group(1)) if m else 0))
            k += 1
    return steps


def _normal(text: str) -> str:
    return " ".join(text.split())


def output_line(expected: str) -> re.Pattern:
    """What a README ``#>`` line promises, as a pattern for one (whitespace-normalised) line."""
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


def test_readme_steps_parser():
    steps = readme_steps("\n".join([  # noqa: FLY002 - one README line per item reads best
        "```", "make up", "```",
        "```", "mmctl status   # a comment", "#> MODEL  STATE", "mmctl canary start a --to b \\",
        "   --stages 1,5", "mmctl health x    # exit 8", "#> x: unhealthy", "#> (… ms)", "```",
        "```", ".venv/bin/python - <<'EOF'", "print(1)", "EOF", "#> 1", "# a note", "curl -s x", "```",
    ]))
    assert [s.command.split()[0] for s in steps] == ["mmctl", "mmctl", "mmctl", ".venv/bin/python", "curl"]
    assert steps[1].command.endswith("--stages 1,5")
    assert [s.expect_rc for s in steps] == [0, 0, 8, 0, 0]
    assert steps[3].command.endswith("EOF")
    assert [s.output for s in steps] == [["MODEL  STATE"], [], ["x: unhealthy", "(… ms)"], ["1"], []]


def test_readme_outputs_are_compared():
    printed = ("NAME       VERSION  STAGE SET BY\nsimple.v1  1        alice 2026-11-25 20:06:24\n"
               "simple.v1: healthy, ready, warm-up ok (5.2 ms)\n")
    shown = ["NAME  VERSION  STAGE SET BY", "simple.v1  1  alice 2026-11-22 23:25:15"]
    assert missing_output(shown, printed) is None  # other columns' widths, another time
    assert missing_output(["simple.v1: healthy, ready, warm-up ok (… ms)"], printed) is None
    assert missing_output(["simple.v1  …  alice …"], printed) is None
    # A different value, word, order, or a line that is only the start of one is a mismatch.
    assert missing_output(["simple.v1  2  alice 2026-11-22 23:25:15"], printed) is not None
    assert missing_output(["simple.v1: unhealthy, ready, warm-up ok (… ms)"], printed) is not None
    assert missing_output(["simple.v1  1  bob 2026-11-22 23:25:15"], printed) is not None
    assert missing_output([shown[1], shown[0]], printed) is not None
    assert missing_output(["simple.v1: healthy"], printed) is not None
    assert missing_output(["anything"], "") is not None


def test_readme_walkthrough_runs_as_written(tmp_path):
    steps = readme_steps((ROOT / "README.md").read_text())
    assert len(steps) >= 20, "the README lost its walkthrough"
    http_port, grpc_port = free_port(), free_port()
    # `.state` as under `make up`: the README shows the cold store's paths ending in it.
    product = Product(tmp_path / ".state", None, "--router-http-port", str(http_port),
                      "--router-grpc-port", str(grpc_port)).start()
    shim = tmp_path / "bin"
    shim.mkdir()
    (shim / "mmctl").write_text(f"#!/bin/sh\nexec {shlex.quote(sys.executable)} -m control_plane.cli \"$@\"\n")
    (shim / "mmctl").chmod(0o755)
    env = dict(os.environ, PATH=f"{shim}:{os.environ['PATH']}", LOGNAME=README_USER, USER=README_USER,
               **product.client_env())
    admin = product.url.removeprefix("http://")

    def here(text: str) -> str:
        """The README's default addresses as this stack's."""
        return (text.replace("localhost:8001", f"127.0.0.1:{grpc_port}")
                .replace("localhost:8000", f"127.0.0.1:{http_port}")
                .replace("127.0.0.1:8001", f"127.0.0.1:{grpc_port}")
                .replace("127.0.0.1:8000", f"127.0.0.1:{http_port}")
                .replace("127.0.0.1:8090", admin))

    wrong_output = []
    try:
        for step in steps:
            # The README's .venv is the interpreter running these tests (CI: make test).
            command = here(step.command.replace(".venv/bin/", f"{Path(sys.executable).parent}/"))
            if command.startswith("curl "):  # an HTTP error must fail the step, as it would a person
                command = "curl --fail-with-body " + command[len("curl "):]
            start = time.monotonic()
            out = subprocess.run(["bash", "-o", "pipefail", "-c", command], cwd=ROOT, env=env,
                                 capture_output=True, text=True, timeout=300, check=False)
            said = f"stdout: {out.stdout[-2000:]}\nstderr: {out.stderr[-2000:]}"
            assert out.returncode == step.expect_rc, (
                f"README.md line {step.line}: `{step.command}` exited {out.returncode} "
                f"(expected {step.expect_rc}) after {time.monotonic() - start:.1f}s\n{said}")
            # The command did its work, so the steps after it still make sense: run on, report all.
            missing = missing_output([here(line) for line in step.output], out.stdout + "\n" + out.stderr)
            if missing is not None:
                wrong_output.append(f"README.md line {step.line}: `{step.command.splitlines()[0]}` "
                                    f"printed no line like\n  {missing}\n{said}")
    finally:
        product.stop()
    assert not wrong_output, "\n\n".join(wrong_output)
    assert sum(len(step.output) for step in steps) >= 30, "the README lost the outputs it shows"
