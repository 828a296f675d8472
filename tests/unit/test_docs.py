"""README.md and docs/*.md hold together without a running stack: every fenced block is run by
tests/e2e/test_readme.py or explicitly marked as not run, every page is in the README's
reading order, every relative link and anchor resolves, every repository path and module
they name exists, and the command line they document is the one mmctl has."""

from __future__ import annotations

import os
import re
from fnmatch import fnmatch

import click
import pytest
import yaml

from mmctl.main import cli
from tests.docs_pages import (
    DOCS,
    README,
    ROOT,
    anchors,
    code_tokens,
    docs_pages,
    links,
    missing_output,
    parse_page,
    read_page,
    reading_order,
    relative,
)

PAGES = [README, *docs_pages()]
# Written by a command, never committed (.gitignore): a page may name what lands there.
GENERATED = ("bench/results/",)
# Repository paths start with one of these (anything else in code is a file of the reader's,
# a URL or a placeholder such as <state-dir>/...).
IGNORED = [line.strip().rstrip("/") for line in (ROOT / ".gitignore").read_text().splitlines()
           if line.strip() and not line.startswith("#")]
TOP_LEVEL = sorted(p.name for p in ROOT.iterdir()
                   if not p.name.startswith(".") and not any(fnmatch(p.name, pat) for pat in IGNORED))
PACKAGES = ("control_plane", "router", "model_runtime", "bench", "tests")
HELM_VALUES = ROOT / "deploy" / "helm" / "mmserve" / "values.yaml"


def test_a_docs_page_yields_its_runnable_shell_steps_and_expected_output():
    page = parse_page("\n".join([  # noqa: FLY002 - one page line per item reads best
        "```sh not-run", "make up", "```",
        "```sh", "mmctl status   # a comment", "#> MODEL  STATE", "mmctl canary start a --to b \\",
        "   --stages 1,5", "mmctl health x    # exit 8", "#> x: unhealthy", "#> (… ms)", "```",
        "- a list item:", "", "  ```sh", "  .venv/bin/python - <<'EOF'", "  print(1)", "  EOF",
        "  #> 1", "  # a note", "  MMCTL_TOKEN=x curl -s x", "  ```",
    ]), "page.md")
    steps = page.steps
    assert not page.problems
    assert [s.command.split()[0] for s in steps] == ["mmctl", "mmctl", "mmctl", ".venv/bin/python",
                                                     "MMCTL_TOKEN=x"]
    assert steps[1].command.endswith("--stages 1,5")
    assert [s.expect_rc for s in steps] == [0, 0, 8, 0, 0]
    assert steps[3].command.endswith("EOF") and "\n  " not in steps[3].command
    assert [s.output for s in steps] == [["MODEL  STATE"], [], ["x: unhealthy", "(… ms)"], ["1"], []]
    assert steps[0].where == "page.md line 5"


@pytest.mark.parametrize("block, problem", [
    (["```", "mmctl status", "```"], "no language"),
    (["```bash", "mmctl status", "```"], "'bash'"),
    (["```sh", "make up", "```"], "`make up` is not a command the docs test runs"),
    (["```sh", "kubectl get pods", "```"], "`kubectl get pods` is not a command"),
    (["```text", "helm install mm deploy/helm/mmserve", "```"], "looks like a shell command"),
    (["```text", "$ ls", "```"], "looks like a shell command"),
    (["```sh", "#> before", "mmctl status", "```"], "output before any command"),
])
def test_a_block_neither_run_nor_marked_is_a_problem(block, problem):
    problems = parse_page("\n".join(["# Page", "", *block]), "page.md").problems
    assert len(problems) == 1 and problem in problems[0], problems


def test_blocks_that_are_not_commands_pass():
    text = "\n".join(["```text", "client (tritonclient grpc/http, curl)",  # noqa: FLY002 - a line each
                      "tritonserver(s)  the real Triton", "```", "```sh not-run", "kubectl get pods", "```",
                      "```json", "{}", "```"])
    page = parse_page(text, "page.md")
    assert not page.problems and not page.steps and len(page.blocks) == 3


def test_outputs_are_compared():
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


def test_every_block_is_run_or_marked_as_not_run():
    problems = [p for path in PAGES for p in read_page(path).problems]
    assert not problems, "\n".join(problems)


def test_every_docs_page_is_in_the_readmes_reading_order():
    order = reading_order()
    assert order[0] == README
    missing = [relative(p) for p in docs_pages() if p not in order]
    assert not missing, f"README.md's 'Where to read on' does not list {missing}: the docs test " \
                        f"runs the pages in that order"
    assert all(p.exists() for p in order)


def test_the_pages_show_runnable_commands_and_their_output():
    pages = [read_page(p) for p in reading_order()]
    assert len(pages[0].steps) >= 10, "the README lost its tour"
    assert sum(len(p.steps) for p in pages) >= 80
    assert sum(len(s.output) for p in pages for s in p.steps) >= 100


def test_relative_links_point_at_files_and_headings_that_exist():
    broken = []
    for path in PAGES:
        for target in links(path.read_text()):
            if re.match(r"^[a-z]+:", target):  # http:, https:, mailto:
                continue
            file_part, _, anchor = target.partition("#")
            dest = (path.parent / file_part).resolve() if file_part else path
            if not dest.exists():
                broken.append(f"{relative(path)}: ({target}): no {file_part}")
            elif anchor and dest.suffix == ".md" and anchor not in anchors(dest.read_text()):
                broken.append(f"{relative(path)}: ({target}): {relative(dest)} has no heading #{anchor}")
    assert not broken, "\n".join(broken)


def _module_names(path) -> set[str]:
    """What a module defines or imports at its top level, read from its text."""
    text = path.read_text()
    names = {name for pair in re.findall(r"^(?:class|(?:async\s+)?def)\s+(\w+)|^(\w+)\s*[:=]", text, re.MULTILINE)
             for name in pair if name}
    for imported in re.findall(r"^(?:from\s+\S+\s+)?import\s+([^(\n]+)$", text, re.MULTILINE):
        names |= {part.split()[-1] for part in imported.split(",") if part.strip()}
    return names


def _python_files() -> list[str]:
    """Every .py file of the repository, as a path relative to its root."""
    found = []
    for folder, dirs, files in os.walk(ROOT):
        dirs[:] = [d for d in dirs if not d.startswith(".") and d not in ("__pycache__", "build")]
        found += [os.path.relpath(os.path.join(folder, f), ROOT) for f in files if f.endswith(".py")]
    return found


def _source_file(name: str) -> bool:
    """``name`` (``warm_tier.py``, ``1/model.py``) is the end of a .py file's path here."""
    return any(f == name or f.endswith("/" + name) for f in _python_files())


def _helm_value(dotted: str) -> bool:
    """A key of the chart's values (``router.service.type``), which reads like a module."""
    node = yaml.safe_load(HELM_VALUES.read_text())
    for key in dotted.split("."):
        if not isinstance(node, dict) or key not in node:
            return False
        node = node[key]
    return True


def _module_exists(dotted: str) -> bool:
    parts = dotted.split(".")
    for i in range(len(parts), 0, -1):
        base = ROOT.joinpath(*parts[:i])
        module = base.with_suffix(".py") if base.with_suffix(".py").exists() else base / "__init__.py"
        if module.exists():
            rest = parts[i:]
            return not rest or rest[0] in _module_names(module)
    return False


def test_named_repository_paths_and_modules_exist():
    missing = []
    for path in PAGES:
        for token in code_tokens(path.read_text()):
            if token.split("/")[0] in TOP_LEVEL and "/" in token:
                if not token.startswith(GENERATED) and not (ROOT / token).exists():
                    missing.append(f"{relative(path)}: {token}")
            elif re.fullmatch(rf"(?:{'|'.join(PACKAGES)})(?:\.[A-Za-z_]\w*)+", token):
                if not _module_exists(token) and not _helm_value(token):
                    missing.append(f"{relative(path)}: module {token}")
            elif token.endswith(".py") and not _source_file(token):
                missing.append(f"{relative(path)}: {token}")
    assert not missing, "paths and modules the docs name that do not exist:\n" + "\n".join(missing)


def test_the_path_checks_catch_stale_names():
    assert not _module_exists("control_plane.warm_tier")
    assert not _module_exists("control_plane.client.NoSuchClient")
    assert _module_exists("control_plane.client.AdminClient")
    assert _module_exists("bench.load_profile")
    assert _helm_value("router.service.type") and not _helm_value("router.serving")
    assert "control_plane" in TOP_LEVEL and "docs" in TOP_LEVEL
    assert not _source_file("warm_tier.py") and not _source_file("cold_store.py")
    assert _source_file("1/model.py") and _source_file("test_readme.py")


def test_the_layout_table_names_every_folder_and_package():
    text = (DOCS / "development.md").read_text()
    layout = text.split("## Layout", 1)[1].split("\n## ", 1)[0]
    named = [n.rstrip("/") for n in re.findall(r"^\| `([^`]+)`", layout, re.MULTILINE)]
    assert all((ROOT / n).exists() for n in named), [n for n in named if not (ROOT / n).exists()]
    folders = [p for p in TOP_LEVEL if (ROOT / p).is_dir()]
    packages = [f"{top}/{p.name}" for top in ("control_plane", "router", "model_runtime")
                for p in sorted((ROOT / top).iterdir()) if (p / "__init__.py").exists()]
    missing = [f for f in folders + packages if not any(n == f or n.startswith(f + "/") for n in named)]
    assert not missing, f"docs/development.md's Layout has no row for {missing}"


def _options(command: click.Command) -> list[str]:
    return [opt for param in command.params if isinstance(param, click.Option)
            for opt in [*param.opts, *param.secondary_opts] if opt.startswith("--") and opt != "--help"]


def _named(option: str, text: str) -> bool:
    return re.search(re.escape(option) + r"(?![\w-])", text) is not None


def test_every_option_of_the_serving_commands_is_on_the_configuration_page():
    text = (DOCS / "configuration.md").read_text()
    ctx = click.Context(cli)
    missing = [f"mmctl {name} {opt}" for name in ("up", "control-plane", "router")
               for opt in _options(cli.get_command(ctx, name)) if not _named(opt, text)]
    assert not missing, f"docs/configuration.md does not name {missing}"


def _commands(group: click.Group, prefix: str = "mmctl"):
    ctx = click.Context(group)
    for name in group.list_commands(ctx):
        command = group.get_command(ctx, name)
        yield f"{prefix} {name}", command
        if isinstance(command, click.Group):
            yield from _commands(command, f"{prefix} {name}")


def test_every_mmctl_command_and_global_option_is_on_the_cli_page():
    text = " ".join((DOCS / "cli.md").read_text().split())
    missing = [path for path, _ in _commands(cli) if not _named(path, text)]
    missing += [opt for opt in _options(cli) if not _named(opt, text)]
    assert not missing, f"docs/cli.md does not name {missing}"


def test_the_settings_table_of_the_configuration_page_is_what_mmctl_settings_prints():
    from mmctl.settings import markdown

    text = (ROOT / "docs" / "configuration.md").read_text()
    start = text.index("<!-- settings table: mmctl settings --markdown -->\n")
    end = text.index("<!-- end of the settings table -->")
    table = text[start:end].split("\n", 1)[1].strip()
    assert table == markdown().strip(), "run `mmctl settings --markdown` and paste its table"
