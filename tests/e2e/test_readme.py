"""The README's command blocks, run in order against a started stack, so the docs cannot rot.

Every fenced block whose commands start with ``mmctl``, ``.venv/bin/mmctl``,
``.venv/bin/python`` or ``curl`` is run as written, top to bottom, with bash.  Only the
addresses change: the stack runs on free ports, so ``localhost:8000/8001`` (the router) point
at its ports, ``mmctl`` finds the admin API through ``MMCTL_URL``, and ``curl`` fails on an
HTTP error.  A command is expected to
exit 0 unless its line ends with ``# exit N``.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from control_plane.triton.process import free_port
from tests.product import Product

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
RUNNABLE = re.compile(r"^(\.venv/bin/)?(mmctl|python)\b|^curl\b")
EXPECT = re.compile(r"#\s*exit\s+(\d+)\s*$")


@dataclass
class Step:
    line: int  # where the command starts in README.md
    command: str
    expect_rc: int = 0


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
        while k < len(block):
            lineno, text_line = block[k]
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


def test_readme_steps_parser():
    steps = readme_steps("\n".join([  # noqa: FLY002 - one README line per item reads best
        "```", "make up", "```",
        "```", "mmctl status   # a comment", "mmctl canary start a --to b \\", "   --stages 1,5",
        "mmctl health x    # exit 8", "```",
        "```", ".venv/bin/python - <<'EOF'", "print(1)", "EOF", "curl -s x", "```",
    ]))
    assert [s.command.split()[0] for s in steps] == ["mmctl", "mmctl", "mmctl", ".venv/bin/python", "curl"]
    assert steps[1].command.endswith("--stages 1,5")
    assert [s.expect_rc for s in steps] == [0, 0, 8, 0, 0]
    assert steps[3].command.endswith("EOF")


def test_readme_walkthrough_runs_as_written(tmp_path):
    steps = readme_steps((ROOT / "README.md").read_text())
    assert len(steps) >= 20, "the README lost its walkthrough"
    http_port, grpc_port = free_port(), free_port()
    product = Product(tmp_path / "state", None, "--router-http-port", str(http_port),
                      "--router-grpc-port", str(grpc_port)).start()
    shim = tmp_path / "bin"
    shim.mkdir()
    (shim / "mmctl").write_text(f"#!/bin/sh\nexec {shlex.quote(sys.executable)} -m control_plane.cli \"$@\"\n")
    (shim / "mmctl").chmod(0o755)
    env = dict(os.environ, PATH=f"{shim}:{os.environ['PATH']}", **product.client_env())
    try:
        for step in steps:
            # The README's .venv is the interpreter running these tests (CI: make test).
            command = (step.command.replace(".venv/bin/", f"{Path(sys.executable).parent}/")
                       .replace("localhost:8001", f"127.0.0.1:{grpc_port}")
                       .replace("localhost:8000", f"127.0.0.1:{http_port}"))
            if command.startswith("curl "):  # an HTTP error must fail the step, as it would a person
                command = "curl --fail-with-body " + command[len("curl "):]
            start = time.monotonic()
            out = subprocess.run(["bash", "-o", "pipefail", "-c", command], cwd=ROOT, env=env,
                                 capture_output=True, text=True, timeout=300, check=False)
            assert out.returncode == step.expect_rc, (
                f"README.md line {step.line}: `{step.command}` exited {out.returncode} "
                f"(expected {step.expect_rc}) after {time.monotonic() - start:.1f}s\n"
                f"stdout: {out.stdout[-2000:]}\nstderr: {out.stderr[-2000:]}")
    finally:
        product.stop()
