"""Adapter control plane without sockets: names, config parsing, row merging, the registry
table, metrics, ``base:adapter`` routing and the AdapterManager against a fake model."""

from __future__ import annotations

import copy
import pickle
import shutil
import sqlite3
from pathlib import Path
from types import SimpleNamespace

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from tritonclient.grpc import service_pb2

import model_runtime.lora
from control_plane.adapters import (
    AdapterManager,
    AdapterMetrics,
    AdapterStore,
    describe_base,
    hand_slots_to_control_plane,
    merge_rows,
    parse_adapter_ref,
    parse_model_config,
    public_tier,
)
from control_plane.demo.lora import (
    REPO_MODELS,
    LoraDemoSpec,
    write_demo_adapter,
    write_lora_model,
)
from control_plane.tiers.cold import ColdStores, LocalDirStore, folder_sha256
from domain.errors import (
    CapacityExhausted,
    InvalidInput,
    InvalidModelName,
    ModelNotFound,
)
from domain.router_errors import InvalidRequest
from domain.routes import AdapterKey, RouteTable, split_adapter
from model_runtime.lora.manifest import read_manifest
from model_runtime.lora.models import TinyLMConfig
from router.frontends.grpc_inference import Forwarder
from router.rollouts.routing_decisions import Decider
from router.serving.serving_state import LocalState
from tests.conftest import run

SPEC = LoraDemoSpec(tinylm=TinyLMConfig(d_model=32, n_layers=1, n_heads=2, d_ff=64, max_seq_len=64))


# --------------------------------------------------------------------------- names
@pytest.mark.parametrize("ref, expected", [
    ("acme", ("acme", None)),
    ("support-bot/acme", ("acme", "support-bot/acme")),
    ("org/team/acme.v2", ("acme.v2", "org/team/acme.v2")),
])
def test_adapter_refs_and_labels(ref, expected):
    assert parse_adapter_ref(ref) == expected


@pytest.mark.parametrize("ref, words", [
    ("", "non-empty"),
    ("support-bot/", "empty segment"),
    ("../acme", "last part is the adapter's name"),
    ("a b", "adapter name 'a b' is invalid"),
    ("tinylm:acme", "adapter name"),
])
def test_bad_adapter_refs_say_why(ref, words):
    with pytest.raises(InvalidInput, match=words.replace("(", r"\(")):
        parse_adapter_ref(ref)


def test_logical_names_split_into_base_and_adapter():
    assert split_adapter("tinylm:acme") == ("tinylm", "acme")
    assert split_adapter("cust001") == ("cust001", None)
    for bad in ("tinylm:", ":acme", "tinylm:a:b", "tinylm:../x"):
        with pytest.raises(InvalidModelName, match="BASE:ADAPTER"):
            split_adapter(bad)


def test_an_adapter_key_is_parsed_once_and_keeps_its_parts_through_copies():
    key = AdapterKey.parse("tinylm:acme")
    assert key == "tinylm:acme" and (key.base, key.adapter) == ("tinylm", "acme")
    assert AdapterKey.parse(key) is key  # a key is not split again
    assert AdapterKey.parse("cust001") is None  # a model's name is no adapter
    for kept in (copy.copy(key), copy.deepcopy(key), pickle.loads(pickle.dumps(key))):
        assert isinstance(kept, AdapterKey) and (kept.base, kept.adapter) == ("tinylm", "acme")
    assert {key: 1}["tinylm:acme"] == 1  # the same dict entry as the name clients send
    with pytest.raises(InvalidModelName, match="BASE:ADAPTER"):
        AdapterKey.parse("tinylm:../x")


# --------------------------------------------------------------------------- config / base
def test_parse_model_config_reads_inputs_and_parameters():
    text = (REPO_MODELS / "tinylm" / "config.pbtxt").read_text()
    inputs, params = parse_model_config(text)
    assert {"TEXT", "ADAPTER", "ADAPTER_CONTROL"} <= inputs and "GENERATED_TEXT" not in inputs
    assert params["max_lora_rank"] == "16" and params["adapter_dir"] == "adapters"


def test_describe_base_refuses_plain_and_unknown_models(tmp_path):
    write_lora_model(tmp_path, "tinylm", SPEC, parameters={"max_lora_rank": "8"})
    base = describe_base(tmp_path, "tinylm")
    assert (base.kind, base.max_rank, base.adapter_dir) == ("tinylm", 8, tmp_path / "tinylm" / "adapters")
    (tmp_path / "plain" / "1").mkdir(parents=True)
    (tmp_path / "plain" / "config.pbtxt").write_text('name: "plain"\ninput [\n  { name: "FEATURES" }\n]\n')
    with pytest.raises(InvalidInput, match="not a LoRA base"):
        describe_base(tmp_path, "plain")
    with pytest.raises(ModelNotFound, match="unknown base model 'nope'"):
        describe_base(tmp_path, "nope")


# --------------------------------------------------------------------------- merging
LIVE = {
    "device": "cpu",
    "adapters": [
        {"name": "acme", "tier": "device", "pinned": True, "slot": 1, "rank": 8, "bytes": 4096,
         "requests": 5, "device_hits": 3, "host_hits": 1, "misses": 1, "cold_loads": 1,
         "load_time_s": 0.02, "swap_in_s": 0.001, "last_used_unix": 200.0, "error": None},
        {"name": "globex", "tier": "host", "pinned": False, "slot": None, "rank": 4, "bytes": 2048,
         "requests": 1, "device_hits": 0, "host_hits": 0, "misses": 1, "cold_loads": 1,
         "load_time_s": 0.01, "swap_in_s": None, "last_used_unix": 100.0, "error": None},
        {"name": "ghost", "tier": "missing", "requests": 0},
    ],
}


def test_merge_rows_prefers_live_status_and_falls_back_to_registry_and_disk():
    registered = {"acme": {"name": "acme", "label": "support-bot/acme", "uri": "file:///c/acme/",
                           "rank": 8, "bytes": 4000, "pinned": True, "last_used": 250.0},
                  "gone": {"name": "gone", "uri": "file:///c/gone/", "rank": 2, "bytes": 10}}
    rows = {r["name"]: r for r in merge_rows("tinylm", registered, ["acme", "globex", "initech"],
                                             {"pinned": ["acme"], "disabled": ["initech"]}, LIVE,
                                             summary=lambda n: (16, 99))}
    assert set(rows) == {"acme", "globex", "initech", "gone"}  # ghost: nobody knows it
    acme = rows["acme"]
    assert (acme["tier"], acme["pinned"], acme["label"], acme["bytes"]) == ("device", True, "support-bot/acme", 4096)
    assert (acme["requests"], acme["hits"], acme["misses"], acme["last_used"]) == (5, 4, 1, 250.0)
    assert rows["globex"]["tier"] == "host" and not rows["globex"]["registered"]
    assert rows["initech"]["tier"] == "disabled" and rows["initech"]["rank"] == 16
    assert rows["gone"]["tier"] == "missing" and "restored from file:///c/gone/" in rows["gone"]["error"]
    cold = {r["name"]: r["tier"] for r in merge_rows("tinylm", {}, ["acme"], {}, None)}
    assert cold == {"acme": "cold"}


def test_cold_summary_matches_the_loaded_adapter(tmp_path):
    from control_plane.adapters import _peft_summary
    from control_plane.demo.lora import base_targets
    from model_runtime.lora.peft import read_adapter

    path = write_demo_adapter(tmp_path, "tinylm", "acme", rank=4, spec=SPEC)
    adapter = read_adapter(path, base_targets("tinylm", SPEC))
    assert _peft_summary(path) == (4, adapter.nbytes)
    assert _peft_summary(tmp_path / "nothing") == (None, None)


def test_device_tier_is_gpu_on_a_gpu():
    assert public_tier("device", "cuda:0") == "gpu"
    assert public_tier("device", "cpu") == "device"
    assert public_tier("host", "cuda:0") == "host"


def test_registry_table_keeps_last_used_and_registers_pins():
    store = AdapterStore(sqlite3.connect(":memory:"))
    store.put("tinylm", "acme", label=None, uri="u", sha256="s", rank=8, nbytes=1, added_by="ann", added_at=1.0)
    store.touch("tinylm", {"acme": 50.0})
    store.touch("tinylm", {"acme": 40.0})  # older: ignored
    store.put("tinylm", "acme", label="x/acme", uri="u2", sha256="s2", rank=8, nbytes=1, added_by="bob", added_at=2.0)
    row = store.get("tinylm", "acme")
    assert (row["last_used"], row["label"], row["added_by"], row["pinned"]) == (50.0, "x/acme", "bob", False)
    store.set_pinned("tinylm", "found", True, now=3.0)  # only in the directory until now
    assert store.get("tinylm", "found")["pinned"] is True
    store.delete("tinylm", "acme")
    assert [r["name"] for r in store.rows("tinylm")] == ["found"]


def test_metrics_come_from_the_latest_status():
    registry = CollectorRegistry()
    metrics = AdapterMetrics(registry)
    metrics.update("tinylm", dict(LIVE, device_slots_used=1))
    text = generate_latest(registry).decode()
    assert 'mms_adapter_requests_total{adapter="acme",base="tinylm"} 5.0' in text
    assert 'mms_adapter_cache_hits_total{adapter="acme",base="tinylm",tier="device"} 3.0' in text
    assert 'mms_adapter_cache_misses_total{adapter="globex",base="tinylm"} 1.0' in text
    assert 'mms_adapter_load_seconds{adapter="acme",base="tinylm"} 0.02' in text
    assert 'mms_adapter_device_slots_used{base="tinylm"} 1.0' in text


def test_adapters_past_the_series_cap_are_summed_under_other():
    from domain.series import BoundedLabel

    registry = CollectorRegistry()
    metrics = AdapterMetrics(registry, label=BoundedLabel(cap=2))
    adapters = [{"name": f"a{i}", "requests": i, "device_hits": 1, "host_hits": 0, "misses": 1,
                 "cold_loads": 1, "tier": "host", "load_time_s": 0.5} for i in range(10)]
    metrics.update("tinylm", {"adapters": adapters, "device_slots_used": 0})
    text = generate_latest(registry).decode()
    series = [line for line in text.splitlines() if line.startswith("mms_adapter_requests_total")]
    assert len(series) == 3  # a0, a1 and _other
    assert 'mms_adapter_requests_total{adapter="_other",base="tinylm"} 44.0' in text  # 2 + ... + 9
    assert 'mms_adapter_resident{adapter="_other",base="tinylm",tier="host"} 8.0' in text
    assert 'mms_adapter_load_seconds{adapter="_other"' not in text  # no meaningful sum
    total = sum(float(line.rsplit(" ", 1)[1]) for line in series)
    assert total == sum(range(10))  # the sum over adapters stays exact


# --------------------------------------------------------------------------- router
def test_base_adapter_names_resolve_through_the_base_route_and_limit_per_adapter():
    table = RouteTable(default_target={"tinylm": "tinylm.v2"}.get)
    d = table.resolve("tinylm:acme", None)
    assert (d.logical, d.model, d.adapter, d.scope) == ("tinylm:acme", "tinylm.v2", "acme", "model:tinylm:acme")
    assert table.resolve("tinylm", None).adapter is None
    table.set_alias("lm", "tinylm")
    assert (table.resolve("lm:acme", None).model, table.resolve("lm:acme", None).adapter) == ("tinylm", "acme")
    table.set_limit("tinylm:acme", 5)
    assert table.limits == {"tinylm:acme": {"qps": 5.0, "burst": 5.0}}
    with pytest.raises(InvalidModelName):
        table.set_limit("tinylm:a/b", 5)


def test_appended_request_bytes_set_model_and_adapter_parameter():
    # Re-addressing needs only the state (no model families): no decision, send or shadow.
    forwarder = Forwarder(LocalState(None), decider=None, sender=None, shadow=None,
                          shared_memory=None)
    request = service_pb2.ModelInferRequest(model_name="tinylm:acme", id="r1")
    request.parameters["max_new_tokens"].int64_param = 4
    raw = request.SerializeToString() + forwarder._model_override("tinylm", "acme")
    merged = service_pb2.ModelInferRequest.FromString(raw)
    assert merged.model_name == "tinylm" and merged.id == "r1"
    assert merged.parameters["adapter"].string_param == "acme"
    assert merged.parameters["max_new_tokens"].int64_param == 4
    decision = RouteTable().resolve("tinylm:acme", None)
    request.parameters["adapter"].string_param = "other"
    with pytest.raises(InvalidRequest, match="selects adapter 'acme'"):
        Decider.check_adapter_parameter(request, decision)


# --------------------------------------------------------------------------- manager
class FakeModel:
    """The LoRA model's control answers, from the adapter directory: pins beyond ``slots``
    fail the way the real cache reports them (an error in the status, not a failed sync)."""

    def __init__(self, adapter_dir, slots=2):
        self.adapter_dir = adapter_dir
        self.slots = slots
        self.commands = []
        self.loaded = set()  # loaded by a load command, beside the pins

    async def adapter_control(self, model, command, key=None):
        self.commands.append(command)
        manifest = read_manifest(self.adapter_dir)
        names = sorted(p.name for p in self.adapter_dir.iterdir() if p.is_dir() and not p.name.startswith("."))
        pinned = list(manifest.pinned)[: self.slots]
        if command["op"] == "load":
            self.loaded -= set(command.get("evict", ()))
            self.loaded.add(command["adapter"])
        adapters = []
        for n in names:
            error = "pin failed: cannot pin: all device slots are already pinned" if (
                n in manifest.pinned and n not in pinned) else None
            adapters.append({"name": n, "tier": "device" if n in pinned or n in self.loaded else "cold",
                             "pinned": n in pinned, "error": error, "requests": 0})
        return {"device": "cpu", "device_slots_used": len(pinned), "max_device_adapters": self.slots,
                "adapters": adapters}


class FakeManager:
    def __init__(self, admin=None):
        self.server = SimpleNamespace(name="triton0", admin=admin) if admin else None
        self.records = {"tinylm": SimpleNamespace(last_inference_ms=0)}
        self.store = SimpleNamespace(db=sqlite3.connect(":memory:"))
        self.metrics = SimpleNamespace(registry=CollectorRegistry())
        self.config = SimpleNamespace(policy="lru", on_its_way_s=10.0)
        self.ensured = []
        self.moved = []  # entries whose placement was announced
        self.answered = []

    def ready_server_of(self, name):
        return self.server if name == "tinylm" else None

    def copy_servers_of(self, name):
        return [self.server.name] if self.server is not None and name == "tinylm" else []

    def on_state_change(self, listener):
        self.listener = listener

    def announce_moved(self, name):
        self.moved.append(name)

    async def ensure_for_request(self, name, unreachable=None, owner=None):
        self.ensured.append(name)
        return self.server

    def requests_answered(self, name, count=1, owner=None):
        self.answered.append((name, count))
        return count

    def not_use(self, name, until_ms):
        rec = self.records.get(name)
        if rec is not None:
            rec.last_inference_ms = max(rec.last_inference_ms, until_ms)

    async def ensure(self, name):
        self.ensured.append(name)


@pytest.fixture
def lora_repo(tmp_path):
    repo = tmp_path / "repository"
    write_lora_model(repo, "tinylm", SPEC)
    write_lora_model(repo, "recommender_lora", SPEC)
    src = tmp_path / "src"
    write_demo_adapter(src, "tinylm", "acme", rank=4, spec=SPEC)
    write_demo_adapter(src, "tinylm", "globex", rank=4, spec=SPEC)
    write_demo_adapter(src, "recommender_lora", "wrongbase", rank=4, spec=SPEC)
    broken = write_demo_adapter(src, "tinylm", "broken", rank=4, spec=SPEC)
    (broken / "adapter_config.json").write_text('{"r": "eight"}')
    (src / "acme" / "README.md").write_text("trained on acme tickets\n")
    return SimpleNamespace(repo=repo, src=src, cold=LocalDirStore(tmp_path / "cold"))


def test_add_validates_publishes_and_lists_cold_adapters(lora_repo):
    adapters = AdapterManager(FakeManager(), lora_repo.repo, stores=ColdStores([lora_repo.cold]), clock=lambda: 7.0)
    row = run(adapters.add("tinylm", "support-bot/acme", str(lora_repo.src / "acme"), who="ann"))
    assert (row["name"], row["label"], row["tier"], row["rank"], row["added_by"]) == ("acme", "support-bot/acme", "cold", 4, "ann")
    folder = lora_repo.repo / "tinylm" / "adapters" / "acme"
    assert sorted(p.name for p in folder.iterdir()) == ["adapter_config.json", "adapter_model.safetensors"]
    assert row["uri"] == (lora_repo.cold.root / "adapters" / "tinylm" / "acme").as_uri() + "/"
    assert row["sha256"] == folder_sha256(folder)
    assert not [p for p in folder.parent.iterdir() if p.name.startswith(".")]  # no staging left
    # from the cold-store URI it was published to
    run(adapters.add("tinylm", "acme2", row["uri"]))
    assert (lora_repo.repo / "tinylm" / "adapters" / "acme2" / "adapter_model.safetensors").is_file()
    with pytest.raises(InvalidInput, match="already exists"):
        run(adapters.add("tinylm", "acme", str(lora_repo.src / "acme")))
    listed = run(adapters.list("tinylm"))
    assert not listed["loaded"] and [(a["name"], a["tier"]) for a in listed["adapters"]] == [
        ("acme", "cold"), ("acme2", "cold")]


# Adds adapters in a Python that cannot import torch (the control plane's own install and
# image): argv: repository, cold store, then base name source ... triples.
NO_TORCH_ADD = """
import asyncio, json, sqlite3, sys
from pathlib import Path
from types import SimpleNamespace

class NoTorch:
    def find_spec(self, name, path=None, target=None):
        if name == "torch" or name.startswith("torch."):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)

sys.meta_path.insert(0, NoTorch())
from prometheus_client import CollectorRegistry
from control_plane.adapters import AdapterManager
from control_plane.tiers.cold import ColdStores, LocalDirStore
from domain.errors import InvalidInput

manager = SimpleNamespace(config=SimpleNamespace(policy="lru", on_its_way_s=10.0),
                          metrics=SimpleNamespace(registry=CollectorRegistry()),
                          ready_server_of=lambda _n: None,
                          copy_servers_of=lambda _n: [], announce_moved=lambda _n: None,
                          on_state_change=lambda _listener: None)
adapters = AdapterManager(manager, sys.argv[1], stores=ColdStores([LocalDirStore(Path(sys.argv[2]))]),
                          db=sqlite3.connect(":memory:"))
answers = []
for i in range(3, len(sys.argv), 3):
    try:
        row = asyncio.run(adapters.add(sys.argv[i], sys.argv[i + 1], sys.argv[i + 2]))
        answers.append([row["name"], row["tier"], row["rank"], row["bytes"]])
    except InvalidInput as exc:
        answers.append(["refused", exc.message])
print(json.dumps({"answers": answers, "torch": "torch" in sys.modules}))
"""


def test_adapters_are_checked_and_added_where_torch_is_not_installed(lora_repo):
    """The control plane's install and image carry no torch: an adapter is checked against
    its base's layers all the same (its bytes as the model serves them), and a bad one is
    refused in the model's words."""
    import json
    import subprocess
    import sys

    from control_plane.adapters import _peft_summary

    added = subprocess.run(
        [sys.executable, "-c", NO_TORCH_ADD, str(lora_repo.repo), str(lora_repo.cold.root),
         "tinylm", "acme", str(lora_repo.src / "acme"),
         "tinylm", "x", str(lora_repo.src / "wrongbase"),
         "recommender_lora", "y", str(lora_repo.src / "acme")],
        check=False, capture_output=True, text=True, timeout=120,
        cwd=Path(__file__).resolve().parents[2])
    assert added.returncode == 0, added.stderr
    result = json.loads(added.stdout.splitlines()[-1])
    acme, wrong_base, wrong_kind = result["answers"]
    rank, nbytes = _peft_summary(lora_repo.src / "acme")
    assert acme == ["acme", "cold", rank, nbytes] and rank == 4
    assert wrong_base[0] == "refused" and "name no linear layer of tinylm" in wrong_base[1]
    assert wrong_kind[0] == "refused" and "name no linear layer of recommender_lora" in wrong_kind[1]
    assert result["torch"] is False
    assert (lora_repo.repo / "tinylm" / "adapters" / "acme" / "adapter_model.safetensors").is_file()


@pytest.mark.parametrize("source, base, words", [
    ("broken", "tinylm", "adapter 'x' refused: 'r' must be a positive integer"),
    ("wrongbase", "tinylm", "name no linear layer of tinylm"),
    ("acme", "recommender_lora", "name no linear layer of recommender_lora"),
    ("nothing-here", "tinylm", "is not a directory"),
])
def test_bad_adapters_are_refused_with_the_reason_and_leave_nothing(lora_repo, source, base, words):
    adapters = AdapterManager(FakeManager(), lora_repo.repo, stores=ColdStores([lora_repo.cold]))
    with pytest.raises(InvalidInput, match=words):
        run(adapters.add(base, "x", str(lora_repo.src / source)))
    adapter_dir = lora_repo.repo / base / "adapters"
    assert list(adapter_dir.iterdir()) == [] and adapters.store.rows() == []


def test_pin_is_confirmed_by_the_model_and_undone_when_it_cannot_pin(lora_repo):
    model = FakeModel(lora_repo.repo / "tinylm" / "adapters", slots=1)
    manager = FakeManager(admin=model)
    adapters = AdapterManager(manager, lora_repo.repo, stores=ColdStores([lora_repo.cold]))
    for name in ("acme", "globex"):
        run(adapters.add("tinylm", name, str(lora_repo.src / name)))
    row = run(adapters.pin("tinylm", "acme"))
    assert row["pinned"] and row["tier"] == "device" and adapters.store.get("tinylm", "acme")["pinned"]
    assert {"op": "sync"} in model.commands
    with pytest.raises(CapacityExhausted, match=r"slot\(s\) hold pinned adapters \(acme\)"):
        run(adapters.pin("tinylm", "globex"))
    manifest = read_manifest(model.adapter_dir)
    assert manifest.pinned == ("acme",) and not adapters.store.get("tinylm", "globex")["pinned"]
    with pytest.raises(InvalidInput, match="pinned"):
        run(adapters.unload("tinylm", "acme"))
    with pytest.raises(InvalidInput, match="unpin it first"):
        run(adapters.remove("tinylm", "acme"))
    manager.records["tinylm"].last_inference_ms = 0
    assert not run(adapters.unpin("tinylm", "acme"))["pinned"]
    assert read_manifest(model.adapter_dir).pinned == ()
    assert manager.records["tinylm"].last_inference_ms == 0  # an explicit op counts as use
    run(adapters.list("tinylm"))
    assert manager.records["tinylm"].last_inference_ms > 0  # a status poll is not use
    run(adapters.load("tinylm", "globex"))
    assert manager.ensured == ["tinylm"] and model.commands[-1] == {"op": "load", "adapter": "globex", "evict": ["acme"], "answer": "slots"}  # its one slot, by the policy
    with pytest.raises(ModelNotFound, match="unknown adapter 'ghost'"):
        run(adapters.load("tinylm", "ghost"))


def test_remove_disables_while_deleting_and_keeps_the_cold_copy(lora_repo):
    model = FakeModel(lora_repo.repo / "tinylm" / "adapters")
    adapters = AdapterManager(FakeManager(admin=model), lora_repo.repo, stores=ColdStores([lora_repo.cold]))
    row = run(adapters.add("tinylm", "acme", str(lora_repo.src / "acme")))
    out = run(adapters.remove("tinylm", "acme"))
    assert out == {"base": "tinylm", "name": "acme", "removed": True, "uri": row["uri"]}
    assert not (model.adapter_dir / "acme").exists() and adapters.store.rows() == []
    assert read_manifest(model.adapter_dir).disabled == ()  # re-adding works
    assert lora_repo.cold.path_of(row["uri"]).is_dir()
    with pytest.raises(ModelNotFound):
        run(adapters.remove("tinylm", "acme"))


def test_the_first_start_hands_every_bases_slots_to_the_control_plane_keeping_its_manifest(lora_repo):
    """A manifest written before adapters were the manager's entries (no residency): its model
    decided.  The first start rewrites it for every LoRA base, pins and disabled kept."""
    adapter_dir = lora_repo.repo / "tinylm" / "adapters"
    write_demo_adapter(adapter_dir, "tinylm", "acme", rank=4, spec=SPEC)
    (adapter_dir / "manifest.json").write_text(
        '{"generation": 4, "pinned": ["acme"], "preload": [], "disabled": ["gone"]}')
    (lora_repo.repo / "identity").mkdir()  # a model that is no LoRA base is left alone
    (lora_repo.repo / "identity" / "config.pbtxt").write_text('name: "identity"\nbackend: "python"\n')
    assert read_manifest(adapter_dir).residency == "model"
    # tinylm's copy of the runtime is an earlier version's (whose manifest knew no residency);
    # recommender_lora's is this version's and is not touched.
    old_runtime = lora_repo.repo / "tinylm" / "1" / "_lora"
    (old_runtime / "manifest.py").write_text("# an earlier version\n")
    (old_runtime / "control_socket.py").unlink()
    current = lora_repo.repo / "recommender_lora" / "1" / "_lora"
    untouched = current.stat().st_ino
    hand_slots_to_control_plane(lora_repo.repo)  # what the control plane's start runs
    source = Path(model_runtime.lora.__file__).parent
    assert (old_runtime / "manifest.py").read_bytes() == (source / "manifest.py").read_bytes()
    assert (old_runtime / "control_socket.py").is_file()
    assert current.stat().st_ino == untouched
    assert not [p.name for p in old_runtime.parent.iterdir() if p.name.startswith(".")]
    tinylm = read_manifest(adapter_dir)
    assert (tinylm.residency, tinylm.pinned, tinylm.disabled, tinylm.generation) == (
        "control_plane", ("acme",), ("gone",), 5)
    assert read_manifest(lora_repo.repo / "recommender_lora" / "adapters").residency == "control_plane"
    assert not (lora_repo.repo / "identity" / "adapters").exists()


def test_recover_restores_a_wiped_adapter_folder_and_its_pin(lora_repo):
    manager = FakeManager()
    adapters = AdapterManager(manager, lora_repo.repo, stores=ColdStores([lora_repo.cold]))
    run(adapters.add("tinylm", "acme", str(lora_repo.src / "acme")))
    run(adapters.pin("tinylm", "acme"))  # base not loaded: manifest + registry only
    adapter_dir = lora_repo.repo / "tinylm" / "adapters"
    shutil.rmtree(adapter_dir)  # e.g. a tmpfs repository after a reboot
    assert run(adapters.list("tinylm"))["adapters"][0]["tier"] == "missing"
    report = run(AdapterManager(manager, lora_repo.repo, stores=ColdStores([lora_repo.cold])).recover())
    assert report == {"restored": ["tinylm:acme"], "failed": {}}
    assert (adapter_dir / "acme" / "adapter_model.safetensors").is_file()
    assert read_manifest(adapter_dir).pinned == ("acme",)


def test_replacing_an_adapter_unloads_its_old_weights_on_every_copy_of_its_base(lora_repo):
    """The unload went to one server of the base: a second copy kept serving the old
    weights from its device slot or host memory."""
    adapter_dir = lora_repo.repo / "tinylm" / "adapters"
    models = {name: FakeModel(adapter_dir) for name in ("triton0", "triton1")}
    manager = FakeManager(models["triton0"])
    manager.servers = {name: SimpleNamespace(name=name, admin=model, up=True)
                       for name, model in models.items()}
    manager.copy_servers_of = lambda name: sorted(models) if name == "tinylm" else []
    adapters = AdapterManager(manager, lora_repo.repo, stores=ColdStores([lora_repo.cold]))
    run(adapters.add("tinylm", "acme", str(lora_repo.src / "acme")))
    run(adapters.add("tinylm", "acme", str(lora_repo.src / "globex"), replace=True))
    for name, model in models.items():
        assert {"op": "unload", "adapter": "acme"} in model.commands, name
