"""The adapter cache and serving core: device-slot LRU, pins, host tier, cold loads off the
request path, refusals, per-request errors, manifest and control ops (no sockets)."""

import shutil
import threading

import numpy as np
import pytest

from control_plane.demo.fleet import FleetSpec, base_weights
from control_plane.demo.lora import LoraDemoSpec, write_demo_adapter
from model_runtime.lora.errors import (
    AdapterCapacityExhausted,
    AdapterNotFound,
    AdapterNotLoaded,
    AdapterRefused,
    InvalidRequest,
)
from model_runtime.lora.manifest import Manifest, write_manifest
from model_runtime.lora.models import RecommenderMLP, TinyLMConfig
from model_runtime.lora.peft import read_adapter
from model_runtime.lora.policy import LruTier
from model_runtime.lora.runtime import LoraSettings, build_server, recommender_runner
from model_runtime.lora.server import Job

SPEC = LoraDemoSpec(
    tinylm=TinyLMConfig(d_model=32, n_layers=1, n_heads=2, d_ff=64, max_seq_len=64),
    recommender=FleetSpec(feature_dim=8, hidden_dim=16),
)
NAMES = ["a", "b", "c", "d"]
X = np.linspace(-1, 1, 16, dtype=np.float32).reshape(2, 8)


class Replies:
    def __init__(self):
        self.results = {}
        self.cond = threading.Condition()

    def reply(self, key):
        def send(result, error):
            with self.cond:
                self.results[key] = (result, error)
                self.cond.notify_all()
        return send

    def wait(self, *keys, timeout_s=30):
        with self.cond:
            ok = self.cond.wait_for(lambda: all(k in self.results for k in keys), timeout_s)
        assert ok, f"no reply for {[k for k in keys if k not in self.results]}"
        return [self.results[k] for k in keys]


class GatedReader:
    """read_adapter that blocks on a per-name gate and counts calls."""

    def __init__(self):
        self.gates: dict[str, threading.Event] = {}
        self.calls: list[str] = []

    def __call__(self, path, targets, **kwargs):
        self.calls.append(kwargs["name"])
        gate = self.gates.get(kwargs["name"])
        if gate is not None:
            assert gate.wait(30)
        return read_adapter(path, targets, **kwargs)

    def release_all(self):
        for gate in self.gates.values():
            gate.set()


@pytest.fixture
def adapter_dir(tmp_path):
    path = tmp_path / "adapters"
    path.mkdir()
    for name in NAMES:
        write_demo_adapter(path, "recommender_lora", name, rank=4, spec=SPEC)
    return path


@pytest.fixture
def make_server(tmp_path, adapter_dir):
    made = []

    def make(slots=2, host=8, **params):
        reader = GatedReader()
        model = RecommenderMLP(base_weights(SPEC.recommender))
        settings = LoraSettings.from_parameters(
            {"max_device_adapters": str(slots), "max_host_adapters": str(host),
             "manifest_poll_s": "0", **{k: str(v) for k, v in params.items()}},
            tmp_path,
        )
        server = build_server(model, recommender_runner(model), settings,
                              base_name="recommender_lora", reader=reader)
        made.append((server, reader))
        return server, reader

    yield make
    for server, reader in made:
        reader.release_all()
        server.close()
    leftover = [t.name for t in threading.enumerate() if t.name.startswith("lora-")]
    assert not leftover, f"threads left behind: {leftover}"


def serve(server, *names, rows=2):
    replies = Replies()
    server.submit([Job(n, X[:rows], replies.reply(i), rows=rows) for i, n in enumerate(names)])
    results = replies.wait(*range(len(names)))
    return results


def reference_scores(server, name):
    """The same rows served alone, as a single-adapter batch."""
    [(result, error)] = serve(server, name)
    assert error is None, error
    return result


def test_lru_tier_policy_is_pure_and_skips_pinned_and_protected():
    tier = LruTier(3, "device")
    for key in "abc":
        tier.add(key)
    tier.touch("a")  # order: b, c, a
    assert tier.victim() == "b"
    tier.pin("b")
    assert tier.victim() == "c"
    assert tier.victim(protect={"c"}) == "a"
    assert tier.victim(protect={"c", "a"}) is None
    assert not tier.all_pinned()
    tier.pin("a"), tier.pin("c")
    assert tier.all_pinned()
    with pytest.raises(RuntimeError, match="full"):
        tier.add("d")


def test_third_adapter_evicts_the_least_recently_used(make_server):
    server, _ = make_server(slots=2)
    serve(server, "a")
    serve(server, "b")
    serve(server, "a")  # b is now least recently used
    assert server.cache.resident() == ["b", "a"]
    serve(server, "c")
    assert server.cache.resident() == ["a", "c"]
    assert server.cache.tier_of("b") == "host"  # evicted from its slot, still in host memory
    [(_, error)] = serve(server, "b")  # comes back from host memory
    assert error is None and server.cache.resident() == ["c", "b"]
    status = {a["name"]: a for a in server.cache.status()["adapters"]}
    assert status["b"]["host_hits"] == 1 and status["b"]["cold_loads"] == 1
    assert status["a"]["device_hits"] == 1


def test_pinned_adapters_stay_resident(make_server, adapter_dir):
    server, _ = make_server(slots=2)
    write_manifest(adapter_dir, Manifest(generation=1, pinned=("a",)))
    for future in server.sync():
        future.result(timeout=30)
    assert server.cache.resident() == ["a"]
    for name in ["b", "c", "d", "b", "c"]:
        [(_, error)] = serve(server, name)
        assert error is None
        assert "a" in server.cache.resident()
    assert server.cache.resident()[-1] == "c"
    status = server.cache.status()
    assert status["manifest_generation"] == 1
    assert {a["name"]: a["pinned"] for a in status["adapters"]}["a"] is True
    # unpinned through the manifest: a becomes evictable again
    write_manifest(adapter_dir, Manifest(generation=2))
    server.sync()
    serve(server, "d")
    serve(server, "b")
    assert server.cache.resident() == ["d", "b"]


def test_all_slots_pinned_fails_only_the_requests_that_need_a_slot(make_server, adapter_dir):
    server, _ = make_server(slots=2)
    for name in ("a", "b"):
        server.cache.pin(name).result(timeout=30)
    with pytest.raises(AdapterCapacityExhausted, match="already pinned"):
        server.cache.pin("c").result(timeout=30)
    serve(server, "c")  # c cold-loads, then finds no slot
    (a, _), (_, c_error), (base, _) = serve(server, "a", "c", None)
    assert a is not None and base is not None
    assert isinstance(c_error, AdapterCapacityExhausted)
    assert "hold pinned adapters (a, b)" in c_error.message


def test_mixed_batch_with_more_adapters_than_slots_runs_in_waves(make_server):
    server, _ = make_server(slots=2)
    single = {n: reference_scores(server, n) for n in ["a", "b", "c", None]}
    calls = []
    run = server.run
    server.run = lambda jobs: calls.append([j.adapter for j in jobs]) or run(jobs)
    results = serve(server, "a", "b", "c", None)
    for name, (scores, error) in zip(["a", "b", "c", None], results):
        assert error is None
        np.testing.assert_allclose(scores, single[name], rtol=0, atol=1e-6)
    assert len(calls) == 2
    assert sorted(str(name) for wave in calls for name in wave) == ["None", "a", "b", "c"]


def test_unknown_adapter_fails_only_its_request(make_server):
    server, _ = make_server()
    (_, base_error), (_, error), (_, a_error) = serve(server, None, "nobody", "a")
    assert base_error is None and a_error is None
    assert isinstance(error, AdapterNotFound)
    assert "adapter 'nobody' not found for recommender_lora" in error.message
    assert "nobody" not in {a["name"] for a in server.cache.status()["adapters"]}


def test_statistics_count_each_request_of_a_mixed_batch_once(tmp_path, adapter_dir):
    """Resident adapters (counted in bulk), a swap-in from host memory, base rows and an
    unknown name in one batch; a request retried in a later wave counts once."""
    now = [100.0]
    model = RecommenderMLP(base_weights(SPEC.recommender))
    settings = LoraSettings.from_parameters(
        {"max_device_adapters": "3", "manifest_poll_s": "0"}, tmp_path
    )
    server = build_server(model, recommender_runner(model), settings, base_name="r",
                          wall_clock=lambda: now[0])
    try:
        for name in ("a", "b", "c"):
            server.cache.load(name).result(timeout=30)
        server.cache.unload("c")
        server.cache.load("c").result(timeout=30)  # in a slot again
        assert server.cache.resident() == ["a", "b", "c"]
        now[0] = 200.0
        results = serve(server, "b", "a", None, "b", "nobody", "a", "b")
        assert [error is None for _, error in results] == [True, True, True, True, False, True, True]
        assert server.cache.resident() == ["c", "b", "a"]  # touched in the batch's order
        status = {x["name"]: x for x in server.cache.status()["adapters"]}
        assert (status["a"]["requests"], status["a"]["device_hits"]) == (2, 2)
        assert (status["b"]["requests"], status["b"]["device_hits"]) == (3, 3)
        assert status["a"]["last_used_unix"] == status["b"]["last_used_unix"] == 200.0
        assert status["c"]["requests"] == 0 and status["c"]["last_used_unix"] is None
        assert "nobody" not in status

        # c, now in host memory only, takes b's slot (the least recently used one that the
        # batch does not use) in the same batch that a is served from its own.
        server.cache.load("d").result(timeout=30)  # evicts c, the least recently used
        assert server.cache.tier_of("c") == "host" and server.cache.resident() == ["b", "a", "d"]
        now[0] = 300.0
        serve(server, "c", "a", "c")
        assert server.cache.resident() == ["d", "a", "c"]
        status = {x["name"]: x for x in server.cache.status()["adapters"]}
        assert (status["c"]["requests"], status["c"]["host_hits"], status["c"]["device_hits"]) == (2, 2, 0)
        assert (status["a"]["requests"], status["a"]["device_hits"]) == (3, 3)
        assert status["c"]["last_used_unix"] == status["a"]["last_used_unix"] == 300.0
        assert status["b"]["last_used_unix"] == 200.0
    finally:
        server.close()


def test_malformed_adapter_is_refused_and_the_model_keeps_serving(make_server, adapter_dir):
    server, reader = make_server()
    bad = adapter_dir / "broken"
    write_demo_adapter(adapter_dir, "recommender_lora", "broken", rank=4, spec=SPEC)
    (bad / "adapter_model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00not a header")
    (_, error), (_, a_error), (_, base_error) = serve(server, "broken", "a", None)
    assert isinstance(error, AdapterRefused) and "not a readable safetensors file" in error.message
    assert a_error is None and base_error is None
    status = {x["name"]: x for x in server.cache.status()["adapters"]}
    assert status["broken"]["tier"] == "refused"
    assert "safetensors" in status["broken"]["error"]
    # the refusal is remembered: no second read of the same files
    [(_, again)] = serve(server, "broken")
    assert isinstance(again, AdapterRefused) and reader.calls.count("broken") == 1
    # re-staged with good files: retried and served
    write_demo_adapter(adapter_dir, "recommender_lora", "broken", rank=4, spec=SPEC)
    [(scores, fixed)] = serve(server, "broken")
    assert fixed is None and scores.shape == (2, 1)


def test_adapter_for_another_base_is_refused_at_load(make_server, adapter_dir):
    server, _ = make_server()
    write_demo_adapter(adapter_dir, "tinylm", "lm-adapter", rank=4, spec=SPEC)
    [(_, error)] = serve(server, "lm-adapter")
    assert isinstance(error, AdapterRefused)
    assert "name no linear layer of recommender_lora" in error.message
    with pytest.raises(AdapterRefused):
        server.cache.load("lm-adapter").result(timeout=30)


def test_cold_load_does_not_block_requests_for_resident_adapters(make_server):
    server, reader = make_server(slots=2)
    server.cache.load("a").result(timeout=30)
    reader.gates["b"] = threading.Event()
    replies = Replies()
    server.submit([Job("b", X, replies.reply("b1"), rows=2), Job("a", X, replies.reply("a1"), rows=2)])
    # submit returned with the resident request answered and the cold one still loading
    assert "a1" in replies.results and "b1" not in replies.results
    assert server.cache.tier_of("b") == "loading"
    server.submit([Job("a", X, replies.reply("a2"), rows=2), Job(None, X, replies.reply("base"), rows=2)])
    assert {"a2", "base"} <= set(replies.results) and "b1" not in replies.results
    server.submit([Job("b", X, replies.reply("b2"), rows=2)])  # joins the load in flight
    reader.gates["b"].set()
    (b1, e1), (b2, e2) = replies.wait("b1", "b2")
    assert e1 is None and e2 is None and np.array_equal(b1, b2)
    assert reader.calls.count("b") == 1
    assert not np.array_equal(b1, replies.results["a1"][0])
    stats = {x["name"]: x for x in server.cache.status()["adapters"]}["b"]
    assert stats["requests"] == 2 and stats["misses"] == 2 and stats["cold_loads"] == 1


def test_host_tier_is_an_lru_behind_the_slots(make_server):
    server, reader = make_server(slots=1, host=2)
    for name in ["a", "b", "c"]:
        serve(server, name)
    assert server.cache.tier_of("c") == "device"
    assert server.cache.tier_of("b") == "host"
    assert server.cache.tier_of("a") == "cold"  # dropped from host memory, still on disk
    serve(server, "a")
    assert reader.calls == ["a", "b", "c", "a"]


def test_manifest_disable_preload_and_bad_manifest(make_server, adapter_dir):
    server, _ = make_server(slots=2)
    write_manifest(adapter_dir, Manifest(generation=4, preload=("c",), disabled=("b",)))
    for future in server.sync():
        future.result(timeout=30)
    assert server.cache.resident() == ["c"]
    [(_, error)] = serve(server, "b")
    assert isinstance(error, AdapterNotFound) and "disabled" in error.message
    (adapter_dir / "manifest.json").write_text("{oops")
    with pytest.raises(InvalidRequest):
        server.sync()
    status = server.cache.status()
    assert "not valid JSON" in status["manifest_error"] and status["manifest_generation"] == 4
    [(_, still)] = serve(server, "b")
    assert isinstance(still, AdapterNotFound)  # the last good manifest still applies
    write_manifest(adapter_dir, Manifest(generation=5))
    server.sync()
    [(_, enabled)] = serve(server, "b")
    assert enabled is None and server.cache.status()["manifest_error"] is None


def test_pin_of_a_missing_adapter_reports_the_error_in_status(make_server, adapter_dir):
    server, _ = make_server()
    write_manifest(adapter_dir, Manifest(generation=1, pinned=("ghost",)))
    futures = server.sync()
    with pytest.raises(AdapterNotFound):
        futures[0].result(timeout=30)
    ghost = {a["name"]: a for a in server.cache.status()["adapters"]}["ghost"]
    assert ghost["pinned"] is False and "pin failed" in ghost["error"]


def control(server, command):
    replies = Replies()
    server.control(command, replies.reply(0))
    return replies.wait(0)[0]


def test_control_ops_load_report_and_unload_adapters_and_refuse_unknown_ones(make_server):
    server, _ = make_server(slots=2)
    status, error = control(server, {"op": "load", "adapter": "a"})
    assert error is None and {x["name"]: x["tier"] for x in status["adapters"]}["a"] == "device"
    status, error = control(server, {"op": "status"})
    assert error is None and status["device_slots_used"] == 1 and status["base"] == "recommender_lora"
    status, error = control(server, {"op": "unload", "adapter": "a"})
    assert error is None and {x["name"]: x["tier"] for x in status["adapters"]}["a"] == "cold"
    _, error = control(server, {"op": "load", "adapter": "zzz"})
    assert isinstance(error, AdapterNotFound)
    _, error = control(server, {"op": "explode"})
    assert isinstance(error, InvalidRequest) and "op in" in error.message
    server.cache.pin("b").result(timeout=30)
    _, error = control(server, {"op": "unload", "adapter": "b"})
    assert isinstance(error, InvalidRequest) and "unpin it first" in error.message
    status, error = control(server, {"op": "sync"})
    assert error is None and status["manifest_generation"] == 0


def test_last_used_comes_from_the_injected_clock(tmp_path, adapter_dir):
    model = RecommenderMLP(base_weights(SPEC.recommender))
    settings = LoraSettings.from_parameters({"manifest_poll_s": "0"}, tmp_path)
    server = build_server(model, recommender_runner(model), settings, base_name="r",
                          wall_clock=lambda: 1234.5)
    try:
        serve(server, "a")
        assert {x["name"]: x for x in server.cache.status()["adapters"]}["a"]["last_used_unix"] == 1234.5
    finally:
        server.close()


def test_requests_after_close_are_answered_with_unavailable(make_server):
    server, _ = make_server()
    server.close()
    [(_, error)] = serve(server, "a")
    assert error is not None and error.code == "unavailable"


def managed(server, adapter_dir, **fields):
    """The manifest hands the slots to the control plane (as `mmctl up` writes it)."""
    write_manifest(adapter_dir, Manifest(generation=9, residency="control_plane", **fields))
    for future in server.sync():
        future.result(timeout=30)


def test_where_the_control_plane_decides_a_request_never_loads_or_evicts_an_adapter(make_server, adapter_dir):
    server, reader = make_server(slots=2)
    serve(server, "a")  # loaded on demand before the control plane took over: it stays
    managed(server, adapter_dir)
    assert server.cache.status()["residency"] == "control_plane"
    [(_, error)] = serve(server, "b")
    assert isinstance(error, AdapterNotLoaded) and error.message.startswith("Request for unknown model")
    [(_, unknown)] = serve(server, "zzz")
    assert isinstance(unknown, AdapterNotFound) and not isinstance(unknown, AdapterNotLoaded)
    assert reader.calls == ["a"] and server.cache.resident() == ["a"]
    [(scores, error)] = serve(server, "a")
    assert error is None and scores.shape == (2, 1)


def test_a_load_takes_the_slots_the_control_plane_names_and_no_other(make_server, adapter_dir):
    server, _ = make_server(slots=2)
    managed(server, adapter_dir, pinned=("a",))
    expected = {}
    for name in ("b", "c"):
        status, error = control(server, {"op": "load", "adapter": name})
        if name == "b":
            assert error is None
            expected["b"] = reference_scores(server, "b")
        else:  # both slots hold adapters and none was named: refused, nothing evicted
            assert isinstance(error, AdapterCapacityExhausted) and "named none" in error.message
    assert sorted(server.cache.resident()) == ["a", "b"]
    status, error = control(server, {"op": "load", "adapter": "c", "evict": ["a", "b"]})
    assert error is None  # the pinned one is kept whatever the victims say
    assert sorted(server.cache.resident()) == ["a", "c"]
    tiers = {x["name"]: x["tier"] for x in status["adapters"]}
    assert tiers["b"] == "host" and tiers["c"] == "device"
    status, error = control(server, {"op": "load", "adapter": "b", "evict": ["c"], "answer": "slots"})
    assert error is None and sorted(server.cache.resident()) == ["a", "b"]
    assert status["partial"] and [(x["name"], x["pinned"]) for x in status["adapters"]] == [
        ("a", True), ("b", False)]  # the slots alone, not every adapter on disk
    np.testing.assert_array_equal(reference_scores(server, "b"), expected["b"])  # its own weights
    _, error = control(server, {"op": "load", "adapter": "c", "evict": "b"})
    assert isinstance(error, InvalidRequest) and "'evict' is a list" in error.message


def test_a_load_after_the_adapter_was_replaced_on_disk_reads_the_new_files(make_server, adapter_dir):
    """`mmctl adapter add --replace` told one server to unload the old weights; a server it
    did not tell (another copy of the base, an unload that failed) took its host copy on the
    next load and answered with the old weights for as long as it kept it."""
    server, reader = make_server(slots=2)
    assert control(server, {"op": "load", "adapter": "a"})[1] is None
    before = reference_scores(server, "a")
    assert control(server, {"op": "load", "adapter": "b"})[1] is None
    b_scores = reference_scores(server, "b")
    assert not np.allclose(before, b_scores)
    staged = adapter_dir / ".a.new"
    shutil.copytree(adapter_dir / "b", staged)  # what install does: a new folder, renamed in
    shutil.rmtree(adapter_dir / "a")
    staged.rename(adapter_dir / "a")
    assert control(server, {"op": "load", "adapter": "a"})[1] is None
    np.testing.assert_allclose(reference_scores(server, "a"), b_scores, rtol=1e-6)
    assert reader.calls.count("a") == 2


def test_a_refused_adapter_is_not_read_again_by_each_load(make_server, adapter_dir):
    server, reader = make_server()
    (adapter_dir / "a" / "adapter_model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00not a header")
    for _ in range(3):
        _, error = control(server, {"op": "load", "adapter": "a"})
        assert isinstance(error, AdapterRefused) and "not a readable safetensors file" in error.message
    assert reader.calls.count("a") == 1
