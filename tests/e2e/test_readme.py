"""The shell blocks of README.md and of every docs page, run in order against one started
stack, so the docs cannot rot.

The pages run in reading order: README.md, then the docs pages in the order its "Where to
read on" list links them (``tests.docs_pages.reading_order``); each page continues where the
one before left off.  Every ``sh`` block is run as written, top to bottom, with bash (what
counts as a block and how blocks that are not run are marked: ``tests/docs_pages.py``; that
every block is one or the other is checked without a stack in ``tests/unit/test_docs.py``).
Only the addresses change: the stack runs on free ports, so ``localhost:8000/8001`` (the
router) and ``localhost:8090`` (the admin API) point at its ports, ``.state/admin.token`` at
its token file, ``mmctl`` finds the admin API through ``MMS_URL``, ``mmctl`` and ``python``
are this interpreter's (as with the virtualenv active), and ``curl`` fails on an HTTP error.
A command is expected to exit 0 unless its line ends with ``# exit N``, and to print what the
page shows under it: each ``#>`` line must match a line of its output (stdout, then stderr),
in order, where ``…`` stands for any text, runs of spaces for any run of spaces (table
columns), and a ``YYYY-MM-DD HH:MM:SS`` time for any such time.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
import time
from pathlib import Path

import pytest

from control_plane.triton.process import free_port
from tests.docs_pages import ROOT, missing_output, read_page, reading_order
from tests.product import Product

pytestmark = pytest.mark.integration

# mmctl records who made a registry change (getpass reads LOGNAME first); the pages'
# outputs name alice.
DOCS_USER = "alice"


@pytest.mark.timeout(900)  # all pages on one stack: about two minutes on the 2-core machine
def test_readme_and_docs_run_as_written(tmp_path):
    pages = [read_page(path) for path in reading_order()]
    problems = [problem for page in pages for problem in page.problems]
    assert not problems, "\n".join(problems)
    http_port, grpc_port = free_port(), free_port()
    # `.state` as under `make up`: the pages show the cold store's paths ending in it.
    product = Product(tmp_path / ".state", None, "--router-http-port", str(http_port),
                      "--router-grpc-port", str(grpc_port)).start()
    shim = tmp_path / "bin"
    shim.mkdir()
    (shim / "mmctl").write_text(f"#!/bin/sh\nexec {shlex.quote(sys.executable)} -m mmctl \"$@\"\n")
    (shim / "mmctl").chmod(0o755)
    venv_bin = Path(sys.executable).parent  # `python` as with the virtualenv active
    env = dict(os.environ, PATH=f"{shim}:{venv_bin}:{os.environ['PATH']}", LOGNAME=DOCS_USER,
               USER=DOCS_USER, **product.client_env())
    admin = product.url.removeprefix("http://")

    def here(text: str) -> str:
        """The pages' default addresses as this stack's."""
        return (text.replace("localhost:8001", f"127.0.0.1:{grpc_port}")
                .replace("localhost:8000", f"127.0.0.1:{http_port}")
                .replace("127.0.0.1:8001", f"127.0.0.1:{grpc_port}")
                .replace("127.0.0.1:8000", f"127.0.0.1:{http_port}")
                .replace("localhost:8090", admin)
                .replace("127.0.0.1:8090", admin))

    def runnable(command: str) -> str:
        # The pages' .venv is the interpreter running these tests (CI: make test).
        command = here(command.replace(".venv/bin/", f"{venv_bin}/"))
        command = command.replace(".state/admin.token", shlex.quote(str(product.token_file)))
        # An HTTP error must fail the step, as it would a person (pages that show one say so).
        if "--fail" not in command.splitlines()[0]:
            command = re.sub(r"^((?:[A-Za-z_]\w*=\S*\s+)*)curl ", r"\1curl --fail-with-body ", command)
        return command

    wrong_output = []
    timings = []
    try:
        for page in pages:
            page_start = time.monotonic()
            for step in page.steps:
                start = time.monotonic()
                out = subprocess.run(["bash", "-o", "pipefail", "-c", runnable(step.command)], cwd=ROOT,
                                     env=env, capture_output=True, text=True, timeout=300, check=False)
                said = f"stdout: {out.stdout[-2000:]}\nstderr: {out.stderr[-2000:]}"
                assert out.returncode == step.expect_rc, (
                    f"{step.where}: `{step.command}` exited {out.returncode} "
                    f"(expected {step.expect_rc}) after {time.monotonic() - start:.1f}s\n{said}")
                # The command did its work, so the steps after it still make sense: run on, report all.
                missing = missing_output([here(line) for line in step.output], out.stdout + "\n" + out.stderr)
                if missing is not None:
                    wrong_output.append(f"{step.where}: `{step.command.splitlines()[0]}` "
                                        f"printed no line like\n  {missing}\n{said}")
            timings.append(f"{page.name}: {len(page.steps)} commands, {time.monotonic() - page_start:.1f}s")
    finally:
        product.stop()
        print("\n".join(timings))
    assert not wrong_output, "\n\n".join(wrong_output)
