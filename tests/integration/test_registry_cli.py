"""`mmctl registry ...` against the real admin handlers on a loopback port (no Triton needed)."""

from __future__ import annotations

import asyncio
import json
import shutil
import threading
from pathlib import Path
from types import SimpleNamespace

import pytest
from aiohttp import web
from click.testing import CliRunner

from control_plane.admin.api import error_middleware
from control_plane.admin.registry_routes import add_registry_routes
from control_plane.registry import Registry
from control_plane.state.state_store import StateStore
from control_plane.tiers.cold import ColdStores, LocalDirStore, folder_sha256
from control_plane.tiers.warm import WarmTier
from control_plane.triton.process import free_port
from mmctl.common import Api
from mmctl.registry import registry as registry_cli

pytestmark = pytest.mark.integration


class AdminServer:
    """The registry routes in an aiohttp app on its own loop thread."""

    def __init__(self, tmp_path):
        self.store = StateStore(tmp_path / "state.db")
        self.cold = LocalDirStore(tmp_path / "cold")
        stores = ColdStores([self.cold])
        self.registry = Registry(self.store.db, stores=stores)
        self.warm = WarmTier(tmp_path / "shm" / "repository", self.registry, stores)
        manager = SimpleNamespace(records={})
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.loop = asyncio.new_event_loop()
        self.ready = threading.Event()
        self.thread = threading.Thread(target=self._serve, args=(manager,), daemon=True)
        self.thread.start()
        assert self.ready.wait(10)

    def _serve(self, manager):
        asyncio.set_event_loop(self.loop)
        app = web.Application(middlewares=[error_middleware])
        add_registry_routes(app, self.registry, warm=self.warm, locate=self.warm.locator(manager))
        self.runner = web.AppRunner(app, access_log=None)
        self.loop.run_until_complete(self.runner.setup())
        self.loop.run_until_complete(web.TCPSite(self.runner, "127.0.0.1", self.port).start())
        self.ready.set()
        self.loop.run_forever()

    def close(self):
        asyncio.run_coroutine_threadsafe(self.runner.cleanup(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        assert not self.thread.is_alive()
        self.store.close()


@pytest.fixture
def admin(tmp_path):
    server = AdminServer(tmp_path)
    yield server
    server.close()


def mmctl(url, *args):
    result = CliRunner().invoke(registry_cli, list(args), obj=Api(url, 30))
    return result.exit_code, result.output


def test_registry_add_list_promote_history_and_stage(admin, fleet_template):
    url = admin.url
    src = fleet_template / "cust001"
    code, out = mmctl(url, "add", "cust001", "--version", "3", "--from-dir", str(src),
                      "--metric", "auc=0.781", "--data-fingerprint", "sha256:" + "d" * 64,
                      "--sla", "gold", "--tenant", "acme", "--who", "alice")
    assert code == 0, out
    # The model's first version: production by default, and the output says so.
    assert out.startswith("cust001.v3: cust001 version 3, production") and "file://" in out
    assert "the first version of cust001, so it is production" in out
    mv = admin.registry.get("cust001", 3)
    assert mv.sha256 == folder_sha256(src) and mv.metrics == {"auc": 0.781} and mv.sla == "gold"

    # A second version from an artifact that is already in the store: sha256 from its manifest.
    code, out = mmctl(url, "add", "cust001", "--version", "4", "--artifact", mv.artifact_uri,
                      "--sha256", "sha256:" + mv.sha256, "--who", "alice", "--json")
    assert code == 0, out
    added = json.loads(out)
    assert added["sha256"] == mv.sha256 and added["stage"] == "registered"
    assert "cust001 keeps serving cust001.v3" in added["serves"]
    code, out = mmctl(url, "add", "cust001", "--version", "5", "--artifact", mv.artifact_uri,
                      "--sha256", "0" * 64, "--who", "alice")
    assert code == 2 and "check the upload" in out

    code, out = mmctl(url, "promote", "cust001", "--version", "4", "--stage", "canary", "--who", "bob",
                      "--note", "metrics ok")
    assert code == 0 and "cust001.v4: canary (by bob" in out
    code, out = mmctl(url, "promote", "cust001", "--version", "4", "--stage", "production", "--who", "carol")
    assert code == 0, out
    code, out = mmctl(url, "history", "cust001", "--json")
    steps = [(h["version"], h["to_stage"], h["who"]) for h in json.loads(out)]
    assert steps == [(3, "production", "alice"), (4, "registered", "alice"), (4, "canary", "bob"),
                     (3, "retired", "carol"), (4, "production", "carol")]
    code, out = mmctl(url, "history", "cust001")
    assert code == 0 and "metrics ok" in out

    code, out = mmctl(url, "list", "--json")
    rows = {v["name"]: v for v in json.loads(out)}
    assert rows["cust001.v3"]["tier"] == "cold" and rows["cust001.v4"]["stage"] == "production"

    # `stage` without --version takes the production version.
    code, out = mmctl(url, "stage", "cust001", "--poll-interval", "0.05")
    assert code == 0 and "cust001.v4: warm" in out, out
    code, out = mmctl(url, "list")
    line = next(ln for ln in out.splitlines() if ln.startswith("cust001.v4"))
    assert "production" in line and "warm" in line and "carol" in line
    line = next(ln for ln in out.splitlines() if ln.startswith("cust001.v3"))
    assert "retired" in line and "cold" in line and "auc=0.781" in line
    code, out = mmctl(url, "warm", "--json")
    assert [m["name"] for m in json.loads(out)["models"]] == ["cust001.v4"]


def test_add_takes_the_next_free_version_and_keeps_production(admin, fleet_template):
    code, out = mmctl(admin.url, "add", "cust003", "--from-dir", str(fleet_template / "cust003"))
    assert code == 0 and out.startswith("cust003.v1: cust003 version 1, production"), out
    code, out = mmctl(admin.url, "add", "cust003", "--from-dir", str(fleet_template / "cust004"))
    assert code == 0 and out.startswith("cust003.v2: cust003 version 2, registered"), out
    assert "cust003 keeps serving cust003.v1" in out
    assert "mmctl registry promote cust003 --version 2 --stage production" in out
    assert admin.registry.resolve_name("cust003") == "cust003.v1"
    code, out = mmctl(admin.url, "add", "cust003", "--version", "2", "--from-dir", str(fleet_template / "cust004"))
    assert code == 2 and "already registered" in out and "the next free one is 3" in out


def simple_folder(root, config_name='name: "simple"', version_dir="1"):
    folder = root / "simple"
    folder.mkdir(parents=True)
    (folder / "config.pbtxt").write_text(
        f'{config_name}\nbackend: "python"\nmax_batch_size: 0\n'
        'input [ { name: "INPUT0" data_type: TYPE_INT32 dims: [ 16 ] } ]\n'
        'output [ { name: "OUTPUT0" data_type: TYPE_INT32 dims: [ 16 ] } ]\n')
    if version_dir:
        (folder / version_dir).mkdir()
        (folder / version_dir / "model.py").write_text("# a model\n")
    return folder


@pytest.mark.parametrize("setup, args, exit_code, message", [
    ("missing", [], 2, "does not exist"),
    ("no-config", [], 2, "has no config.pbtxt"),
    ("no-version", [], 2, "has no version folder"),
    ("mismatch", [], 2, 'says name: "other" but the model is added as'),
    ("syntax", [], 2, "is not a valid Triton model configuration"),
    ("unknown-field", [], 2, 'has no field named "future_option"'),  # staging would drop it
    ("ok", ["--artifact", "ftp://x/"], 2, "no cold store handles"),
])
def test_add_from_dir_refuses_what_triton_would_refuse(admin, tmp_path, setup, args, exit_code, message):
    folder = tmp_path / "simple"
    if setup == "no-config":
        (folder / "1").mkdir(parents=True)
    elif setup == "no-version":
        simple_folder(tmp_path, version_dir="")
    elif setup == "mismatch":
        simple_folder(tmp_path, config_name='name: "other"')
    elif setup == "syntax":
        simple_folder(tmp_path, config_name="name: simple {")
    elif setup == "unknown-field":
        simple_folder(tmp_path, config_name='name: "simple"\nfuture_option: 1')
    elif setup == "ok":
        simple_folder(tmp_path)
    code, out = mmctl(admin.url, "add", "simple", "--from-dir", str(folder), *args)
    assert code == exit_code and message in out, out
    assert admin.registry.versions("simple") == []
    assert not (tmp_path / "cold" / "simple").exists()  # nothing half-published


def test_add_accepts_the_config_name_of_the_folder_or_none(admin, tmp_path):
    folder = simple_folder(tmp_path / "a")
    code, out = mmctl(admin.url, "add", "adder", "--from-dir", str(folder))  # config says "simple"
    assert code == 0, out
    folder = simple_folder(tmp_path / "b", config_name="")
    code, out = mmctl(admin.url, "add", "adder", "--from-dir", str(folder))
    assert code == 0 and out.startswith("adder.v2"), out


def test_add_refuses_a_name_that_is_already_another_models_version(admin, tmp_path, fleet_template):
    folder = simple_folder(tmp_path)
    admin.registry.add("cust017", 2, "repository://cust017-v2/", "ab" * 32, 10, who="t",
                       triton_name="cust017-v2")
    code, out = mmctl(admin.url, "add", "cust017-v2", "--from-dir", str(folder))
    assert code == 2 and "cust017-v2 is already the name of cust017 version 2" in out
    code, out = mmctl(admin.url, "add", "bad name", "--from-dir", str(folder))
    assert code == 2 and "is invalid" in out


def test_errors_map_to_exit_codes(admin, tmp_path):
    code, out = mmctl(admin.url, "promote", "nope", "--version", "1", "--stage", "canary")
    assert code == 4 and "not in the registry" in out
    code, out = mmctl(admin.url, "add", "bad..name", "--version", "1", "--artifact", "file:///x/")
    assert code == 2 and "'..'" in out
    code, out = mmctl(admin.url, "add", "empty", "--version", "1", "--artifact",
                      (tmp_path / "nothing").as_uri() + "/")
    assert code == 4 and "no artifact" in out
    code, out = mmctl(admin.url, "stage", "ghost", "--version", "1")
    assert code == 4 and "ghost has no version 1 in the registry" in out
    code, out = mmctl(f"http://127.0.0.1:{free_port()}", "list")
    assert code == 3 and "not running" in out


@pytest.mark.parametrize("field", ["artifact_uri", "source_dir", "sha256", "stage", "weights"])
def test_a_field_of_the_wrong_type_is_a_400_that_names_it(admin, field):
    """{"source_dir": 7} was a TypeError deep in the registration, answered 500."""
    import requests

    answer = requests.post(f"{admin.url}/v1/registry/models/m/versions", json={field: 7}, timeout=30)
    assert answer.status_code == 400, answer.text
    assert f"{field} must be a string" in answer.json()["message"]
    assert admin.registry.versions("m") == []


def test_stage_reports_a_corrupt_artifact(admin, fleet_template):
    code, out = mmctl(admin.url, "add", "cust002", "--version", "1", "--from-dir",
                      str(fleet_template / "cust002"))
    assert code == 0, out
    weights = admin.cold.path_of(admin.registry.get("cust002", 1).artifact_uri) / "1" / "weights.safetensors"
    weights.write_bytes(b"\0" * weights.stat().st_size)
    code, out = mmctl(admin.url, "stage", "cust002", "--version", "1", "--poll-interval", "0.05")
    assert code == 6 and "failed verification" in out
    assert not (admin.warm.repository / "cust002.v1").exists()


def test_the_demo_fleet_is_registered_at_first_start_and_only_once(tmp_path):
    from control_plane.runtime.service import Service, ServiceConfig

    store = StateStore(tmp_path / "state.db")
    service = Service(ServiceConfig(state_dir=tmp_path / "state", fleet_size=3, demo=True))
    service.repository = tmp_path / "repository"
    service.registry = Registry(store.db)
    service.prepare_repository()  # what `mmctl up` writes with no --repository
    asyncio.run(service.register_repository())
    rows = {v.name: (v.model, v.version, v.stage) for v in service.registry.versions()}
    assert rows["cust001"] == ("cust001", 1, "production")
    assert rows["cust017-v2"] == ("cust017", 2, "registered")
    assert rows["cust017-faulty"] == ("cust017", 4, "registered")
    assert {"cust002", "cust003", "identity", "tinylm", "recommender_lora"} <= set(rows)
    # One catalogue: every model folder and every variant of the demo family is registered;
    # the family's own folder (the Triton model that holds the variants' slots) is not.
    folders = list(service.repository.iterdir())
    families = {p.name for p in folders if (p / "family.json").is_file()}
    assert families == {"recommender"}
    assert set(rows) == {p.name for p in folders if p.name not in families
                         and ((p / "config.pbtxt").is_file() or (p / "variant.json").is_file())}
    assert {v.name for v in service.registry.versions() if v.family == "recommender"} == {
        "cust001", "cust002", "cust003", "cust017-v2", "cust017-v3"}
    history = len(service.registry.history())
    asyncio.run(service.register_repository())  # a restart registers nothing again
    assert len(service.registry.history()) == history
    store.close()


def test_a_control_plane_without_the_demo_writes_no_demo_model(tmp_path):
    """The control plane of a cluster (and `mmctl up --no-demo`) serves only what the
    repository holds; a folder named like a demo variant is a model of its own."""
    from control_plane.runtime.service import Service, ServiceConfig

    store = StateStore(tmp_path / "state.db")
    service = Service(ServiceConfig(state_dir=tmp_path / "state", fleet_size=3))
    service.repository = tmp_path / "repository"
    service.registry = Registry(store.db)
    service.prepare_repository()
    assert list(service.repository.iterdir()) == []
    shutil.copytree(Path(__file__).resolve().parents[1] / "fixtures" / "models" / "simple",
                    service.repository / "cust017-v2")
    asyncio.run(service.register_repository())
    rows = {v.name: (v.model, v.version) for v in service.registry.versions()}
    assert rows == {"cust017-v2": ("cust017-v2", 1)}


def test_only_mmctl_up_writes_the_demo(monkeypatch):
    from mmctl import serve

    seen = {}
    monkeypatch.setattr(serve, "_run_service", lambda cfg: seen.setdefault("demo", []).append(cfg.demo))
    for args in (["up"], ["up", "--repository", "repo"], ["up", "--repository", "repo", "--demo"],
                 ["up", "--no-demo"], ["control-plane"]):
        command = serve.up if args[0] == "up" else serve.control_plane_command
        result = CliRunner().invoke(command, args[1:])
        assert result.exit_code == 0, result.output
    assert seen["demo"] == [True, False, True, False, False]


@pytest.mark.parametrize("config_name", [
    "name: 'simple'",  # single quotes: Triton accepts them, so does staging
    '# the simple model\n  name: "simple"  # indented, after a comment: any layout Triton reads',
])
def test_the_staged_copy_carries_the_concrete_name(admin, tmp_path, config_name):
    folder = simple_folder(tmp_path, config_name=config_name)
    original = (folder / "config.pbtxt").read_text()
    code, out = mmctl(admin.url, "add", "simple", "--from-dir", str(folder))
    assert code == 0, out
    code, out = mmctl(admin.url, "stage", "simple", "--poll-interval", "0.05")
    assert code == 0 and "simple.v1: warm" in out, out
    staged = (admin.warm.repository / "simple.v1" / "config.pbtxt").read_text()
    assert staged.startswith('name: "simple.v1"\n') and "'simple'" not in staged and '"simple"' not in staged
    assert (folder / "config.pbtxt").read_text() == original  # the user's folder is untouched
