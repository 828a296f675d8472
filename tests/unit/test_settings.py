"""Each setting is declared once (domain/settings.py) and everything else is
derived from that declaration: mmctl's options with their defaults, help and environment
variables, the config objects, the control plane's file, and the command line of a router
worker.  These tests fail when a consumer declares a setting of its own."""

from __future__ import annotations

import ast
import importlib
import inspect
import os
from pathlib import Path

import click
import pytest
from click.testing import CliRunner

from control_plane.client import ClientSettings, find_token
from control_plane.runtime.config import (
    SECRETS,
    ServiceConfig,
    config_from_json,
    config_to_json,
    parse_budget,
    parse_device_budget,
)
from control_plane.tiers.cold.s3 import S3Config
from domain.errors import InvalidInput
from domain.settings import (
    ADMIN_TOKEN,
    ENV_PREFIX,
    FLAG,
    LOG_LEVEL,
    MULTIPLE,
    SWITCH,
    TEST_SWITCH_PREFIX,
    TEST_SWITCHES,
    Setting,
    at_least_zero,
    comma_list,
    declared,
    env_value,
    file_path,
    parse_argv,
    secret_env,
    shared_values,
    to_argv,
)
from domain.sizes import parse_size
from domain.worker_settings import WorkerConfig, parse_worker_argv
from mmctl import serve
from mmctl import settings as cli_settings
from router import worker

cli_main = importlib.import_module("mmctl.main")  # the package's main() shadows it
GiB = 1 << 30
COMMANDS = {"up": serve.up, "control-plane": serve.control_plane_command,
            "router": serve.router_command, "mmctl": cli_main.cli}
# The environment names of earlier releases that must keep working (no user breaks), and
# the AWS names boto3 users already set.
OLD_NAMES = {"MMCTL_TOKEN", "MMCTL_STATE_URL", "MMCTL_ADVERTISE_URL", "MMCTL_TRITON_ADMIN_KEY",
             "MMCTL_URL", "MMCTL_TOKEN_FILE", "MMCTL_CONTROL_URL",
             "AWS_ENDPOINT_URL_S3", "AWS_REGION", "AWS_DEFAULT_REGION"}


def all_settings() -> dict[Setting, list[tuple[type, str]]]:
    """Every setting object, with the (config class, field) pairs holding it."""
    out: dict[Setting, list[tuple[type, str]]] = {}
    for cls in cli_settings.TABLES:
        for d in declared(cls):
            out.setdefault(d.setting, []).append((cls, d.name))
    return out


@pytest.fixture(autouse=True)
def clean_environment(monkeypatch):
    """No setting comes from the environment of whoever runs the tests."""
    for s in all_settings():
        for name in s.env_names:
            monkeypatch.delenv(name, raising=False)


# One value of each kind of setting, as a person writes it, and what it parses to.
SAMPLES = {int: ("7", 7), float: ("2.5", 2.5), Path: ("/tmp/sample", Path("/tmp/sample")),
           file_path: ("/tmp/sample.json", Path("/tmp/sample.json")), str: ("sample", "sample"),
           parse_size: ("3MiB", 3 << 20), parse_budget: ("2GiB", 2 * GiB),
           comma_list: ("gpu0, gpu1/mig2", ["gpu0", "gpu1/mig2"]), at_least_zero: ("3", 3),
           parse_device_budget: ("gpu0=1GiB gpu1=2GiB", {"gpu0": GiB, "gpu1": 2 * GiB})}


def sample(s: Setting) -> tuple[str, object]:
    if s.kind in (FLAG, SWITCH):
        return ("0", False) if s.default else ("1", True)
    if s.choices:
        return s.choices[-1], s.choices[-1]
    if s.kind == MULTIPLE and s.parse is str:
        return "a b", s.collect(["a", "b"])
    return SAMPLES[s.parse]


def run(command: str, args: list[str], monkeypatch) -> object:
    """The config object a command builds from ``args`` and the environment."""
    seen = []
    if command in ("up", "control-plane"):
        monkeypatch.setattr(serve, "_run_service", seen.append)
    elif command == "router":
        monkeypatch.setattr(worker, "main", lambda argv: seen.append(parse_worker_argv(argv)))
    else:
        class Recorder:
            def __init__(self, url, timeout_s, token_file):
                seen.append(ClientSettings(url=url, timeout_s=timeout_s, token_file=token_file))

        monkeypatch.setattr(cli_main, "Api", Recorder)
        args = [*args, "settings"]
    if command == "router" and "--control-url" not in args and not any(
            os.environ.get(name) for name in ("MMS_CONTROL_URL", "MMCTL_CONTROL_URL")):
        args = ["--control-url", "http://cp:8090", *args]
    result = CliRunner().invoke(COMMANDS[command], args)
    assert result.exit_code == 0, result.output
    (cfg,) = seen
    return cfg


def config_class(command: str) -> type:
    return {"up": ServiceConfig, "control-plane": ServiceConfig, "router": WorkerConfig,
            "mmctl": ClientSettings}[command]


# --------------------------------------------------------------------------- declared once
def test_every_environment_variable_belongs_to_one_setting():
    owner: dict[str, Setting] = {}
    for s in all_settings():
        for name in s.env_names:
            assert owner.setdefault(name, s) is s, f"{name} is declared by two settings"


def test_every_setting_uses_the_mms_prefix_and_keeps_the_old_names():
    aliases = set()
    for s in all_settings():
        if s.internal:
            assert not s.env_names, "plumbing between the product's processes has no env var"
            continue
        assert s.env and s.env.startswith(ENV_PREFIX), s.env
        assert not s.env.startswith(TEST_SWITCH_PREFIX) and s.env not in TEST_SWITCHES
        assert not any(a.startswith(ENV_PREFIX) for a in s.aliases), s.aliases
        aliases.update(s.aliases)
    assert aliases == OLD_NAMES


def test_a_shared_setting_is_one_object_with_one_default():
    shared = {s: places for s, places in all_settings().items() if len(places) > 1}
    assert {s for s in shared} >= {ADMIN_TOKEN, LOG_LEVEL}
    router_host = next(s for s in shared if s.env == "MMS_ROUTER_HOST")
    assert {cls for cls, _ in shared[router_host]} == {ServiceConfig, WorkerConfig}
    for s, places in all_settings().items():
        for cls, name in places:
            value = getattr(cls(), name) if cls is not WorkerConfig else getattr(WorkerConfig(), name)
            expected = s.collect(list(s.default)) if s.kind == MULTIPLE else s.default
            assert value == expected, (cls.__name__, name)


@pytest.mark.parametrize("module", [serve, worker, cli_main])
def test_commands_declare_no_option_by_hand(module):
    """Options of the commands that run the product come from the table, never from a
    click.option or add_argument of their own."""
    tree = ast.parse(inspect.getsource(module))
    calls = [node for node in ast.walk(tree) if isinstance(node, ast.Call)
             and isinstance(node.func, ast.Attribute) and node.func.attr in ("option", "add_argument")]
    if module is cli_main:  # other commands' own arguments (--json, --all...) are not settings
        calls = [c for c in calls if any(isinstance(a, ast.Constant) and a.value in
                                         ("--url", "--timeout", "--token-file") for a in c.args)]
    assert not calls, [ast.unparse(c)[:80] for c in calls]


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_the_options_are_the_table_and_the_table_is_the_options(command):
    """Fails when someone adds a click option to one of these commands that is not in the
    table, or a setting of the command that is no option."""
    cls = config_class(command)
    params = {p.name for p in COMMANDS[command].params}
    expected = {d.name for d in cli_settings.taken(cls, command)}
    if command != "mmctl":
        expected.add(cli_settings.CONFIG_FILE_OPTION)
    assert params == expected


# --------------------------------------------------------------------------- options
@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_every_setting_is_an_option_with_its_flag_default_help_and_env(command):
    cls = config_class(command)
    by_name = {p.name: p for p in COMMANDS[command].params}
    ctx = click.Context(COMMANDS[command], info_name=command)
    text = " ".join(COMMANDS[command].get_help(ctx).split())
    for d in cli_settings.taken(cls, command):
        s, param = d.setting, by_name[d.name]
        assert d.flag in param.opts, (d.flag, param.opts)
        assert param.help.startswith(s.help)
        assert list(param.envvar or []) == list(s.env_names)
        assert d.flag in text
        for name in s.env_names:
            assert name in text
        if s.kind == MULTIPLE:
            assert param.multiple
        elif s.kind in (FLAG, SWITCH):
            assert param.is_flag and param.default == s.default
        elif s.default is not None:
            assert f"[default: {s.show(s.default)}]" in text, d.flag
            assert param.type_cast_value(ctx, param.default) == s.default


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_no_option_given_means_every_declared_default(command, monkeypatch):
    cfg = run(command, [], monkeypatch)
    resolved = {"demo", "router_workers"}  # decided by mmctl up itself
    for d in cli_settings.taken(type(cfg), command):
        if d.name in resolved or d.setting.required:
            continue
        s = d.setting
        expected = s.collect(list(s.default)) if s.kind == MULTIPLE else s.default
        assert getattr(cfg, d.name) == expected, d.name


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_each_environment_variable_sets_its_setting(command, monkeypatch):
    cls = config_class(command)
    checked = 0
    for d in cli_settings.taken(cls, command):
        for name in d.setting.env_names:
            text, value = sample(d.setting)
            monkeypatch.setenv(name, text)
            try:
                got = getattr(run(command, [], monkeypatch), d.name)
            finally:
                monkeypatch.delenv(name)
            assert got == value, (name, text, got)
            checked += 1
    assert checked >= len(cli_settings.taken(cls, command))


def test_the_mms_name_wins_over_the_old_one_and_the_command_line_over_both(monkeypatch):
    monkeypatch.setenv("MMCTL_STATE_URL", "sqlite:///old.db")
    assert run("up", [], monkeypatch).state_url == "sqlite:///old.db"
    monkeypatch.setenv("MMS_STATE_URL", "sqlite:///new.db")
    assert run("up", [], monkeypatch).state_url == "sqlite:///new.db"
    assert run("up", ["--state-url", "sqlite:///argv.db"], monkeypatch).state_url == "sqlite:///argv.db"


def test_a_bad_value_in_the_environment_names_the_variable(monkeypatch):
    monkeypatch.setenv("MMS_MAX_LOADED", "many")
    result = CliRunner().invoke(serve.up, [])
    assert result.exit_code == 2 and "MMS_MAX_LOADED" in result.output and "'many'" in result.output
    with pytest.raises(InvalidInput, match="MMS_S3_MAX_CONCURRENCY='many' is not a whole number"):
        S3Config.from_env({"MMS_S3_MAX_CONCURRENCY": "many"})


def test_memory_budget_unlimited_turns_the_derived_budget_off(monkeypatch):
    cfg = run("up", ["--memory-budget", "unlimited"], monkeypatch)
    assert cfg.memory_budget_bytes is None and cfg.derive_memory_budget is False
    cfg = run("up", ["--memory-budget", "2GiB"], monkeypatch)
    assert cfg.memory_budget_bytes == 2 * GiB and cfg.derive_memory_budget is True


def test_up_and_control_plane_resolve_what_depends_on_several_settings(monkeypatch):
    assert run("up", ["--router-workers", "0"], monkeypatch).router_workers == 0
    assert run("up", [], monkeypatch).router_workers >= 1  # a quarter of the cores
    remote = run("control-plane", ["--attach", "h:1"], monkeypatch)
    assert remote.triton_servers == 0 and remote.attach == ["h:1"]
    assert (remote.router, remote.router_workers, remote.external_routers, remote.demo) == (
        False, 0, True, False)


def test_env_only_settings_come_from_the_environment(monkeypatch):
    for d in declared(S3Config):
        for name in d.setting.env_names:
            text, value = sample(d.setting)
            got = S3Config.from_env({name: text})
            assert getattr(got, d.name) == value, name
    assert S3Config.from_env({"MMS_S3_PREFIX": ""}).prefix == ""  # the bucket's root
    assert S3Config.from_env({"MMS_S3_ENDPOINT_URL": "http://m:9000"}).addressing_style == "path"
    monkeypatch.setenv("MMS_ADMIN_TOKEN", "new")
    monkeypatch.setenv("MMCTL_TOKEN", "old")
    assert find_token(Path("/nonexistent")) == ("new", "MMS_ADMIN_TOKEN")
    monkeypatch.delenv("MMS_ADMIN_TOKEN")
    assert find_token(Path("/nonexistent")) == ("old", "MMCTL_TOKEN")
    assert parse_worker_argv(["--control-url", "http://cp"]).admin_token == "old"


@pytest.mark.parametrize("command", ["up", "control-plane", "router"])
def test_a_setting_of_the_environment_only_reaches_the_commands_config(command, monkeypatch):
    """A setting with no option (the data-plane token: argv is visible to every user) is
    read from the environment by mmctl up / control-plane / router too, not only by the
    processes they start: `mmctl control-plane` in a pod has its token from a Secret.
    (mmctl's own commands read the admin token where they send it: ``find_token``.)"""
    cls = config_class(command)
    env_only = [d for d in declared(cls) if d.flag is None]
    for d in env_only:
        text, value = sample(d.setting)
        monkeypatch.setenv(d.setting.env, text)
        assert getattr(run(command, [], monkeypatch), d.name) == value, d.setting.env
        monkeypatch.delenv(d.setting.env)
        assert getattr(run(command, [], monkeypatch), d.name) == d.setting.default


# --------------------------------------------------------------------------- config file
def test_a_toml_config_file_gives_the_same_settings(tmp_path, monkeypatch):
    config = tmp_path / "mms.toml"
    config.write_text('max-loaded = 12\nmemory-budget = "2GiB"\nattach = ["h:1", "h:2"]\n'
                      'expose-versions = true\nrouter-workers = 0\n')
    cfg = run("up", ["--config", str(config)], monkeypatch)
    assert (cfg.max_loaded, cfg.memory_budget_bytes, cfg.attach, cfg.expose_versions) == (
        12, 2 * GiB, ["h:1", "h:2"], True)
    monkeypatch.setenv("MMS_MAX_LOADED", "5")
    assert run("up", ["--config", str(config)], monkeypatch).max_loaded == 5  # env wins
    assert run("up", ["--config", str(config), "--max-loaded", "3"], monkeypatch).max_loaded == 3
    config.write_text("max-loded = 12\n")
    result = CliRunner().invoke(serve.up, ["--config", str(config)])
    assert result.exit_code == 2 and "max-loded is not a setting of mmctl up" in result.output


# --------------------------------------------------------------------------- processes
def everything_changed() -> ServiceConfig:
    """A ServiceConfig where every setting a worker shares is off its default."""
    return ServiceConfig(state_dir=Path("/srv/state"), router_host="0.0.0.0", router_grpc_port=9001,
                         router_http_port=9000, max_request_bytes=3 << 20,
                         load_timeout_s=7.5, log_level="DEBUG", router_workers=2,
                         admin_token="tok", dataplane_token="dataplane-tok", miss_budget=0.5,
                         client_header="x-forwarded-for", trace_exporter="otlp")


def test_the_worker_gets_every_setting_it_shares_with_the_control_plane():
    cfg = everything_changed()
    handed = shared_values(cfg, WorkerConfig)
    both = {d.setting for d in declared(WorkerConfig)} & {d.setting for d in declared(ServiceConfig)}
    assert len(handed) == len(both) >= 6
    defaults = WorkerConfig()
    for name, value in handed.items():
        assert value != getattr(defaults, name), f"{name}: the test config leaves it at its default"
    w = serve.worker_config(cfg, "w1", "http://127.0.0.1:8090", cfg.dataplane_token,
                            Path("/srv/run"), Path("/srv/run/shm"))
    # Every shared setting but the admin token: a worker parses untrusted input and holds
    # the data-plane token only.
    assert w.admin_token is None
    assert {name: getattr(w, name) for name in handed if name != "admin_token"} == {
        name: value for name, value in handed.items() if name != "admin_token"}


def test_round_trip_config_to_worker_argv_to_parsed_config():
    cfg = everything_changed()
    w = serve.worker_config(cfg, "w1", "http://127.0.0.1:8090", cfg.dataplane_token,
                            Path("/srv/run"), Path("/srv/run/shm"))
    w.token_file = Path("/srv/token")
    argv = to_argv(w)
    assert not any("dataplane-tok" in word for word in argv)  # secrets travel in the environment only
    env = secret_env(w)
    assert env == {"MMS_DATAPLANE_TOKEN": "dataplane-tok"}
    back = parse_argv(WorkerConfig, argv, "worker", "", environ=env)
    assert back == w
    for d in declared(WorkerConfig):  # none was left at its default: nothing can hide
        if d.name != "admin_token":  # never handed to a worker of mmctl up
            assert getattr(w, d.name) != d.setting.default, d.name
    # The old spelling of the worker's name still parses.
    assert parse_argv(WorkerConfig, ["--control-url", "u", "--worker", "w3"], "w", "",
                      environ={}).worker == "w3"


def test_round_trip_config_to_the_control_planes_file():
    cfg = everything_changed()
    cfg.state_url, cfg.triton_admin_key, cfg.admin_token = "postgresql://u:pw@h/db", "key", "tok"
    cfg.device_budgets, cfg.attach, cfg.memory_budget_bytes = {"gpu0": GiB}, ["h:1"], 2 * GiB
    text = config_to_json(cfg)
    for secret in ("pw@h", "key\"", "tok\""):
        assert secret not in text
    back = config_from_json(text)
    for name in SECRETS:
        setattr(back, name, getattr(cfg, name))
    assert back == cfg
    assert secret_env(cfg, sorted(SECRETS - {"admin_token"})) == {
        "MMS_STATE_URL": "postgresql://u:pw@h/db", "MMS_TRITON_ADMIN_KEY": "key",
        "MMS_DATAPLANE_TOKEN": "dataplane-tok"}


def test_env_value_reads_aliases_in_order():
    s = ADMIN_TOKEN
    assert env_value(s, {}) is None
    assert env_value(s, {"MMCTL_TOKEN": "a"}) == "a"
    assert env_value(s, {"MMCTL_TOKEN": "a", "MMS_ADMIN_TOKEN": "b"}) == "b"
    assert env_value(s, {"MMCTL_TOKEN": "a", "MMS_ADMIN_TOKEN": ""}) == "a"  # empty is unset


# --------------------------------------------------------------------------- docs
def test_the_markdown_table_has_a_row_per_setting():
    text = CliRunner().invoke(cli_main.cli, ["settings", "--markdown"]).output
    public = [s for s in all_settings() if not s.internal]
    assert len([line for line in text.splitlines() if line.startswith("| ")]) == len(public) + 1
    for s in public:
        assert f"`{s.env}`" in text
        for alias in s.aliases:
            assert f"`{alias}`" in text
    assert "`--router-host` (up); `--host` (router)" in text
    assert "MMS_TEST" not in text and "shadow-log-dir" not in text


# --------------------------------------------------------------------------- no env by hand
def test_the_test_switches_are_the_ones_the_product_reads():
    from control_plane.manager.records import STRICT_ENV
    from control_plane.triton.fake_nvml import TEST_HOOK_ENV

    assert TEST_SWITCHES == {STRICT_ENV, TEST_HOOK_ENV}


def test_no_environment_variable_of_ours_is_read_outside_the_table():
    """Every MMS_/MMCTL_ name in the product's code is a setting's variable (declared in the
    table), a test switch, or not an environment variable at all."""
    import re

    root = Path(__file__).resolve().parents[2]
    known = {name for s in all_settings() for name in s.env_names} | TEST_SWITCHES
    not_env = {"MMS_FAMILY_STATUS",  # a tensor name of the family models (model_runtime)
               TEST_SWITCH_PREFIX, ENV_PREFIX}
    pattern = re.compile(r"^(MMS|MMCTL)_[A-Z0-9_]*$")
    stray = []
    for package in ("control_plane", "router", "model_runtime"):
        for path in (root / package).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text())):
                if (isinstance(node, ast.Constant) and isinstance(node.value, str)
                        and pattern.match(node.value) and node.value not in known | not_env):
                    stray.append(f"{path.relative_to(root)}: {node.value}")
    assert not stray, stray
