"""Numerics of the batched LoRA path: adapter output == base with merged weights
W + (alpha / r) * B @ A, and a mixed-adapter batch == the single-adapter runs (no sockets).

The reference merges the raw tensors of ``adapter_model.safetensors`` with the config's
``lora_alpha`` and ``r`` directly, independent of the runtime's own loader.
"""

import json
import threading
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from control_plane.demo.fleet import FleetSpec, base_weights
from control_plane.demo.lora import (
    LoraDemoSpec,
    tinylm_base_weights,
    write_demo_adapter,
)
from model_runtime.lora.models import RecommenderMLP, TinyLM, TinyLMConfig
from model_runtime.lora.runtime import (
    LoraSettings,
    TextPayload,
    build_server,
    recommender_runner,
    tinylm_runner,
)
from model_runtime.lora.server import Job

TINY = TinyLMConfig(d_model=32, n_layers=2, n_heads=2, d_ff=64, max_seq_len=64)
SPEC = LoraDemoSpec(tinylm=TINY, recommender=FleetSpec(feature_dim=16, hidden_dim=32))
ADAPTERS = ["acme", "globex", "initech"]


def merged_reference(base: dict, adapter_dir: Path) -> dict:
    config = json.loads((adapter_dir / "adapter_config.json").read_text())
    tensors = load_file(str(adapter_dir / "adapter_model.safetensors"))
    scale = config["lora_alpha"] / config["r"]
    merged = {k: v.to(torch.float64).clone() for k, v in base.items()}
    for key, a in tensors.items():
        if ".lora_A." not in key:
            continue
        module = key[len("base_model.model."): key.index(".lora_A.")]
        b = tensors[key.replace(".lora_A.", ".lora_B.")]
        merged[f"{module}.weight"] += scale * (b.to(torch.float64) @ a.to(torch.float64))
    return merged


class Replies:
    """Collects job replies; ``wait`` blocks until ``n`` arrived."""

    def __init__(self):
        self.results = {}
        self.cond = threading.Condition()

    def reply(self, key):
        def send(result, error):
            with self.cond:
                self.results[key] = (result, error)
                self.cond.notify_all()
        return send

    def wait(self, n, timeout_s=30):
        with self.cond:
            assert self.cond.wait_for(lambda: len(self.results) >= n, timeout_s), self.results
        return self.results


def make_adapters(tmp_path, base, ranks=(4, 8, 16)):
    adapter_dir = tmp_path / "adapters"
    adapter_dir.mkdir()
    targets = {
        "tinylm": [None, ["q_proj", "v_proj"], ["q_proj", "k_proj", "v_proj", "o_proj", "up_proj", "down_proj", "lm_head"]],
        "recommender_lora": [None, ["layers.0"], None],
    }[base]
    for name, rank, target_modules in zip(ADAPTERS, ranks, targets):
        write_demo_adapter(adapter_dir, base, name, rank, SPEC, target_modules=target_modules)
    return adapter_dir


def tinylm_server(tmp_path, dtype="float32", slots=4):
    model = TinyLM(TINY)
    model.load_state_dict(tinylm_base_weights(TINY))
    settings = LoraSettings.from_parameters(
        {"max_device_adapters": str(slots), "dtype": dtype, "manifest_poll_s": "0"}, tmp_path
    )
    return build_server(model, tinylm_runner(model), settings, base_name="tinylm"), model


def recommender_server(tmp_path, dtype="float32", slots=4):
    model = RecommenderMLP(base_weights(SPEC.recommender))
    settings = LoraSettings.from_parameters(
        {"max_device_adapters": str(slots), "dtype": dtype, "manifest_poll_s": "0"}, tmp_path
    )
    return build_server(model, recommender_runner(model), settings, base_name="recommender_lora"), model


def run_rows(server, name, rows, fn):
    """Run ``fn()`` with all ``rows`` rows on ``name``'s slot (None = base), under the lease."""
    if name is not None:
        server.cache.load(name).result(timeout=30)
    with server.cache.lease([name]) as lease, torch.inference_mode():
        slot = lease.slots[name]
        with server.cache.bank.rows(torch.full((rows,), slot)):
            return fn()


@pytest.mark.parametrize("name", ADAPTERS)
def test_tinylm_adapter_equals_merged_weights(tmp_path, name):
    adapter_dir = make_adapters(tmp_path, "tinylm")
    server, model = tinylm_server(tmp_path, dtype="float64")
    try:
        prompts = [b"hello", b"a longer prompt", b"x", b"LoRA!"]
        seqs = [TinyLM.encode(p) for p in prompts]
        got = run_rows(server, name, 4, lambda: model(seqs))
        merged = TinyLM(TINY).to(torch.float64)
        merged.load_state_dict(merged_reference(tinylm_base_weights(TINY), adapter_dir / name))
        with torch.inference_mode():
            want = merged(seqs)
            base = run_rows(server, None, 4, lambda: model(seqs))
        assert torch.allclose(got, want, rtol=0, atol=1e-10), (got - want).abs().max()
        assert (got - base).abs().max() > 1e-2  # the adapter does change the output
    finally:
        server.close()


def test_tinylm_generation_with_adapter_equals_merged_model(tmp_path):
    adapter_dir = make_adapters(tmp_path, "tinylm")
    server, model = tinylm_server(tmp_path)
    try:
        prompts = [b"hello", b"the quick brown fox", b"x", b"abc"]
        got = run_rows(server, "initech", 4, lambda: model.generate(prompts, [12, 5, 20, 0]))
        merged = TinyLM(TINY)
        merged.load_state_dict({k: v.float() for k, v in merged_reference(
            tinylm_base_weights(TINY), adapter_dir / "initech").items()})
        with torch.inference_mode():
            want = merged.eval().generate(prompts, [12, 5, 20, 0])
        assert got == want
        assert [len(t) for t in got][3] == 0
    finally:
        server.close()


@pytest.mark.parametrize("name", ADAPTERS)
def test_recommender_adapter_equals_merged_weights(tmp_path, name):
    adapter_dir = make_adapters(tmp_path, "recommender_lora")
    server, model = recommender_server(tmp_path, dtype="float64")
    try:
        x = torch.randn(4, 16, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
        got = run_rows(server, name, 4, lambda: model(x))
        reference = merged_reference(base_weights(SPEC.recommender), adapter_dir / name)
        merged = RecommenderMLP(reference).to(torch.float64)
        merged.load_state_dict(reference)  # again, now into float64 parameters
        with torch.inference_mode():
            want = merged(x)
            base = run_rows(server, None, 4, lambda: model(x))
        assert torch.allclose(got, want, rtol=0, atol=1e-12), (got - want).abs().max()
        assert (got - base).abs().max() > 1e-4
    finally:
        server.close()


def counting(runner):
    calls = []

    def run(jobs):
        calls.append([job.adapter for job in jobs])
        return runner(jobs)

    return run, calls


@pytest.mark.parametrize("dtype,atol", [("float64", 1e-12), ("float32", 1e-5)])
def test_recommender_mixed_batch_equals_single_adapter_batches(tmp_path, dtype, atol):
    make_adapters(tmp_path, "recommender_lora")
    server, _ = recommender_server(tmp_path, dtype=dtype)
    server.run, calls = counting(server.run)
    names = [None, *ADAPTERS]
    gen = np.random.default_rng(1)
    features = {n: gen.standard_normal((3, 16)).astype(np.float32) for n in names}
    try:
        for n in ADAPTERS:  # resident first, so the mixed batch is one forward
            server.cache.load(n).result(timeout=30)
        single = Replies()
        for n in names:
            server.submit([Job(n, features[n], single.reply(n), rows=3)])
        single.wait(4)
        calls.clear()
        mixed = Replies()
        server.submit([Job(n, features[n], mixed.reply(n), rows=3) for n in names])
        mixed.wait(4)
        assert calls == [names]  # one forward for the whole mixed batch
        for n in names:
            assert mixed.results[n][1] is None
            np.testing.assert_allclose(mixed.results[n][0], single.results[n][0], rtol=0, atol=atol)
        assert len({mixed.results[n][0].tobytes() for n in names}) == 4
    finally:
        server.close()


def test_tinylm_mixed_batch_equals_single_adapter_batches(tmp_path):
    make_adapters(tmp_path, "tinylm")
    server, _ = tinylm_server(tmp_path)
    server.run, calls = counting(server.run)
    names = [None, *ADAPTERS]
    prompts = {None: [b"hello"], "acme": [b"hello", b"good morning"], "globex": [b"hi"],
               "initech": [b"hello there, world"]}
    try:
        for n in ADAPTERS:
            server.cache.load(n).result(timeout=30)
        single = Replies()
        for n in names:
            p = prompts[n]
            server.submit([Job(n, TextPayload(p, [10] * len(p)), single.reply(n), rows=len(p))])
        single.wait(4)
        calls.clear()
        mixed = Replies()
        server.submit([
            Job(n, TextPayload(prompts[n], [10] * len(prompts[n])), mixed.reply(n), rows=len(prompts[n]))
            for n in names
        ])
        mixed.wait(4)
        assert calls == [names]
        for n in names:
            assert mixed.results[n] == single.results[n]
        # same prompt, different adapters: different continuations
        assert len({single.results[n][0][0] for n in (None, "acme")}) == 2
    finally:
        server.close()


def test_all_base_batch_skips_lora_and_matches_plain_model(tmp_path):
    make_adapters(tmp_path, "recommender_lora")
    server, model = recommender_server(tmp_path)
    try:
        server.cache.load("acme").result(timeout=30)
        x = torch.randn(5, 16)
        got = run_rows(server, None, 5, lambda: model(x))
        plain = RecommenderMLP(base_weights(SPEC.recommender))
        with torch.inference_mode():
            assert torch.equal(got, plain(x))
    finally:
        server.close()


@pytest.mark.parametrize("with_base_rows", [False, True])
@pytest.mark.parametrize(
    "prompts",
    [[b"hello", b"dense or not", b"x", b"abc"], [b"hi", b"yo", b"a", b"ok"]],
    ids=["long-prompts-bmm", "short-prompts-embedding-bag"],
)
def test_single_adapter_dense_path_equals_per_row_path(tmp_path, with_base_rows, prompts):
    """A batch whose adapted rows share one adapter takes the dense path; forcing the
    per-row (BGMV) kernel gives the same numbers, base rows included, through both per-row
    variants (gather + bmm from 4 positions per row, embedding_bag below)."""
    make_adapters(tmp_path, "tinylm")
    server, model = tinylm_server(tmp_path, dtype="float64")
    try:
        server.cache.load("initech").result(timeout=30)
        seqs = [TinyLM.encode(p) for p in prompts]
        with server.cache.lease(["initech"]) as lease, torch.inference_mode():
            slot = lease.slots["initech"]
            index = torch.tensor([slot, 0, slot, 0] if with_base_rows else [slot] * 4)
            with server.cache.bank.rows(index):
                dense = model(seqs)
            server.cache.bank.dense_uniform = False
            with server.cache.bank.rows(index):
                per_row = model(seqs)
            with server.cache.bank.rows(torch.zeros(4, dtype=torch.long)):
                base = model(seqs)
        assert torch.allclose(dense, per_row, rtol=0, atol=1e-10)
        if with_base_rows:
            assert torch.equal(dense[1], base[1]) and torch.equal(dense[3], base[3])
            assert not torch.allclose(dense[0], base[0])
    finally:
        server.close()


def test_reused_slot_keeps_nothing_of_its_previous_adapter(tmp_path):
    """globex (rank 8, q/v only) written over initech (rank 16, every layer) in the same
    slot computes exactly what globex computes in a fresh bank."""
    from model_runtime.lora.bank import LoraBank
    from model_runtime.lora.models import linear_targets
    from model_runtime.lora.peft import read_adapter

    adapter_dir = make_adapters(tmp_path, "tinylm")
    model = TinyLM(TINY).to(torch.float64)
    model.load_state_dict(tinylm_base_weights(TINY))
    targets = linear_targets(model)
    initech, globex = (read_adapter(adapter_dir / n, targets, dtype=torch.float64) for n in ("initech", "globex"))
    reused = LoraBank(targets, 2, 16, dtype=torch.float64)
    reused.write(1, initech)
    reused.write(1, globex)
    fresh = LoraBank(targets, 2, 16, dtype=torch.float64)
    fresh.write(1, globex)
    for module in targets:
        assert torch.equal(reused.a_t[module], fresh.a_t[module]), module
        assert torch.equal(reused.b_t[module], fresh.b_t[module]), module
        assert reused.module_slots[module] == fresh.module_slots[module]
    reused.clear(1)
    assert all(not t.any() for t in reused.a_t.values()) and not any(reused.module_slots.values())
