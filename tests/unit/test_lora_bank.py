"""The LoRA bank's per-row kernels against a straightforward reference (no sockets).

Reference, per row n of a batch: ``base(x_n) + x_n @ A^T @ B^T * scale`` with the weights of
row n's adapter, or ``base(x_n)`` for a base row or a layer its adapter does not target.
Every kernel the bank picks is covered: the dense single-adapter matmul, embedding_bag BGMV
(1 to 3 positions per row), gather + bmm (prefill, from 4 positions), and the merged
per-slot weights of a narrow layer; with several ranks padded to max_rank, base rows mixed
in, and both demo bases end to end.
"""

import math

import pytest
import torch
from torch import nn

from control_plane.demo.fleet import FleetSpec, base_weights
from control_plane.demo.lora import tinylm_base_weights
from model_runtime.lora.bank import LoraBank, _zeroed_storage
from model_runtime.lora.models import RecommenderMLP, TinyLM, TinyLMConfig, linear_targets
from model_runtime.lora.peft import LoraAdapter, LoraConfig
from model_runtime.lora.policy import LruTier

MAX_RANK = 16
DTYPE = torch.float64


def make_adapter(name, targets, rank, seed, skip=()):
    """Random A ``[r, in]`` and B ``[out, r]`` for every target but ``skip``, alpha = 2r."""
    gen = torch.Generator().manual_seed(seed)
    scale = 2.0
    weights = {}
    for module, (out, inp) in targets.items():
        if module in skip:
            continue
        a = torch.randn(rank, inp, generator=gen, dtype=DTYPE) / math.sqrt(inp)
        b = torch.randn(out, rank, generator=gen, dtype=DTYPE) / math.sqrt(rank)
        weights[module] = (a, scale * b)
    config = LoraConfig(r=rank, lora_alpha=scale * rank, target_modules=tuple(weights))
    return LoraAdapter(name, config, weights)


def reference_update(adapter, module, x):
    """``x @ A^T @ (scale * B)^T`` of one row's adapter, or 0 where it does not apply."""
    if adapter is None or module not in adapter.weights:
        return x.new_zeros(())
    a, b_scaled = adapter.weights[module]
    return x @ a.t() @ b_scaled.t()


# A wide layer (factored kernels) and two narrow ones (out * 4 <= max_rank: merged weights).
LAYERS = {"wide": (24, 16), "score": (1, 16), "narrow": (4, 16)}


@pytest.fixture
def bank_and_adapters():
    bank = LoraBank(LAYERS, num_slots=6, max_rank=MAX_RANK, dtype=DTYPE)
    adapters = {
        1: make_adapter("r2", LAYERS, 2, seed=1),
        2: make_adapter("r4", LAYERS, 4, seed=2, skip=("score",)),
        3: make_adapter("r8", LAYERS, 8, seed=3),
        4: make_adapter("r16", LAYERS, 16, seed=4, skip=("wide",)),
    }
    for slot, adapter in adapters.items():
        bank.write(slot, adapter)
    return bank, {0: None, **adapters}


def assert_rows_match(bank, adapters, index, module, x):
    out_features = LAYERS[module][0]
    base = torch.randn(*x.shape[:-1], out_features, dtype=DTYPE)
    with torch.inference_mode(), bank.rows(torch.tensor(index)):
        got = bank.add_update(module, x, base.clone())
    for n, slot in enumerate(index):
        want = base[n] + reference_update(adapters[slot], module, x[n])
        torch.testing.assert_close(got[n], want, rtol=0, atol=1e-12, msg=f"row {n} (slot {slot})")


MIXED = [1, 0, 2, 3, 1, 4, 0, 3]  # four ranks, base rows, repeated adapters, unsorted


@pytest.mark.parametrize("module", list(LAYERS))
@pytest.mark.parametrize(
    "positions", [None, 1, 2, 3, 4, 7],
    ids=["2d", "1-position", "2-positions", "3-positions", "4-positions-bmm", "7-positions-bmm"],
)
def test_mixed_batch_matches_the_per_row_reference(bank_and_adapters, module, positions):
    bank, adapters = bank_and_adapters
    gen = torch.Generator().manual_seed(7)
    shape = (len(MIXED), LAYERS[module][1]) if positions is None else (len(MIXED), positions, LAYERS[module][1])
    x = torch.randn(*shape, generator=gen, dtype=DTYPE)
    assert_rows_match(bank, adapters, MIXED, module, x)


@pytest.mark.parametrize("dense", [True, False], ids=["dense", "per-row-kernel"])
@pytest.mark.parametrize("index", [[3, 3, 3, 3], [0, 3, 3, 0, 3]], ids=["all-rows", "with-base-rows"])
@pytest.mark.parametrize("positions", [None, 1, 5])
def test_single_adapter_batch_matches_the_reference(bank_and_adapters, dense, index, positions):
    bank, adapters = bank_and_adapters
    bank.dense_uniform = dense
    for module, (_, in_features) in LAYERS.items():
        shape = (len(index), in_features) if positions is None else (len(index), positions, in_features)
        assert_rows_match(bank, adapters, index, module, torch.randn(*shape, dtype=DTYPE))


def test_base_rows_are_bit_exact_base_output(bank_and_adapters):
    bank, _ = bank_and_adapters
    for module, (out_features, in_features) in LAYERS.items():
        for positions in (1, 5):
            x = torch.randn(len(MIXED), positions, in_features, dtype=DTYPE)
            base = torch.randn(len(MIXED), positions, out_features, dtype=DTYPE)
            with torch.inference_mode(), bank.rows(torch.tensor(MIXED)):
                got = bank.add_update(module, x, base.clone())
            for n, slot in enumerate(MIXED):
                if slot == 0:
                    assert torch.equal(got[n], base[n])


@pytest.mark.parametrize("dense", [True, False], ids=["dense", "per-row-kernel"])
def test_a_base_row_beside_an_adapter_whose_update_overflows_gets_the_base_answer(dense):
    """One adapter and base rows in a batch: the adapter's update was multiplied by a 0/1
    row mask, and infinity times 0 is NaN, so another client's base answer came back NaN."""
    bank = LoraBank(LAYERS, num_slots=2, max_rank=MAX_RANK, dtype=DTYPE)
    bank.dense_uniform = dense
    huge = {m: (torch.full((MAX_RANK, inp), 1e200, dtype=DTYPE), torch.full((out, MAX_RANK), 1e200, dtype=DTYPE))
            for m, (out, inp) in LAYERS.items()}
    bank.write(1, LoraAdapter("huge", LoraConfig(r=MAX_RANK, lora_alpha=MAX_RANK, target_modules=tuple(LAYERS)), huge))
    for module, (out_features, in_features) in LAYERS.items():
        x = torch.ones(2, in_features, dtype=DTYPE)
        base = torch.randn(2, out_features, dtype=DTYPE)
        with torch.inference_mode(), bank.rows(torch.tensor([0, 1])):
            got = bank.add_update(module, x, base.clone())
        assert torch.equal(got[0], base[0]), module
        assert not torch.isfinite(got[1]).all(), module  # the adapter's own row overflowed


def test_layer_no_batch_adapter_targets_is_left_alone(bank_and_adapters):
    bank, _ = bank_and_adapters
    x = torch.randn(3, 16, dtype=DTYPE)
    base = torch.randn(3, 24, dtype=DTYPE)
    with torch.inference_mode(), bank.rows(torch.tensor([4, 4, 0])):  # r16 skips "wide"
        assert bank.add_update("wide", x, base) is base
        assert bank.delta("wide", x) is None
    with torch.inference_mode(), bank.rows(torch.zeros(3, dtype=torch.long)):
        assert bank.add_update("wide", x, base) is base


def test_output_that_autograd_needs_is_not_changed_in_place(bank_and_adapters):
    bank, adapters = bank_and_adapters
    x = torch.randn(len(MIXED), 16, dtype=DTYPE)
    base = torch.randn(len(MIXED), 24, dtype=DTYPE, requires_grad=True)
    kept = base.detach().clone()
    with bank.rows(torch.tensor(MIXED)):
        got = bank.add_update("wide", x, base)
    assert torch.equal(base.detach(), kept)
    for n, slot in enumerate(MIXED):
        want = kept[n] + reference_update(adapters[slot], "wide", x[n])
        torch.testing.assert_close(got[n].detach(), want, rtol=0, atol=1e-12)


def test_delta_is_the_update_alone(bank_and_adapters):
    bank, adapters = bank_and_adapters
    x = torch.randn(len(MIXED), 2, 16, dtype=DTYPE)
    with torch.inference_mode(), bank.rows(torch.tensor(MIXED)):
        got = bank.delta("narrow", x)
    for n, slot in enumerate(MIXED):
        want = reference_update(adapters[slot], "narrow", x[n]).expand(2, 4)
        torch.testing.assert_close(got[n], want, rtol=0, atol=1e-12)


def test_row_count_mismatch_fails_loudly(bank_and_adapters):
    bank, _ = bank_and_adapters
    with bank.rows(torch.tensor([1, 2])), pytest.raises(RuntimeError, match="3 rows"):
        bank.add_update("wide", torch.zeros(3, 16, dtype=DTYPE), torch.zeros(3, 24, dtype=DTYPE))


def test_rewritten_slot_keeps_nothing_of_its_previous_adapter():
    """A slot's merged weights follow its adapter: one that does not target the narrow layer
    written over one that does leaves them zero."""
    bank = LoraBank(LAYERS, num_slots=2, max_rank=MAX_RANK, dtype=DTYPE)
    bank.write(1, make_adapter("all", LAYERS, 16, seed=1))
    replacement = make_adapter("no-score", LAYERS, 4, seed=2, skip=("score",))
    bank.write(1, replacement)
    fresh = LoraBank(LAYERS, num_slots=2, max_rank=MAX_RANK, dtype=DTYPE)
    fresh.write(1, replacement)
    for stacks, fresh_stacks in [(bank.a_t, fresh.a_t), (bank.b_t, fresh.b_t), (bank.merged_t, fresh.merged_t)]:
        for module in stacks:
            assert torch.equal(stacks[module], fresh_stacks[module]), module
    bank.clear(1)
    assert not any(t.any() for t in (*bank.a_t.values(), *bank.b_t.values(), *bank.merged_t.values()))


def test_bank_storage_is_zeroed_and_writable_large_or_small():
    for numel in (1000, 3 << 20):  # under and over a 2 MB huge page
        storage = _zeroed_storage(numel, torch.device("cpu"), torch.float32)
        assert storage.shape == (numel,) and not storage.any()
        storage[-1] = 1.0
        assert storage.sum() == 1.0


def test_large_bank_stacks_are_views_of_one_storage():
    targets = {"a": (512, 512), "b": (2, 512)}
    bank = LoraBank(targets, num_slots=64, max_rank=16)
    assert bank.nbytes >= 2 << 20
    adapter = make_adapter("x", targets, 16, seed=3)
    bank.write(64, LoraAdapter("x", adapter.config, {m: (a.float(), b.float()) for m, (a, b) in adapter.weights.items()}))
    x = torch.randn(2, 512)
    with torch.inference_mode(), bank.rows(torch.tensor([64, 0])):
        got = bank.add_update("b", x, torch.zeros(2, 2))
    a, b = adapter.weights["b"]
    torch.testing.assert_close(got[0], (x[0].double() @ a.t() @ b.t()).float(), rtol=1e-5, atol=1e-5)
    assert torch.equal(got[1], torch.zeros(2))


def test_touch_all_orders_like_touching_each_key():
    tier, each = LruTier(4, "device"), LruTier(4, "device")
    for key in "abcd":
        tier.add(key)
        each.add(key)
    tier.touch_all(["c", "x", "a"])  # "x" is not resident: ignored, as touch ignores it
    for key in ["c", "x", "a"]:
        each.touch(key)
    assert list(tier) == list(each) == ["b", "d", "c", "a"]


# ---------------------------------------------------------------------- both bases end to end

RECOMMENDER = FleetSpec(feature_dim=16, hidden_dim=32)
TINY = TinyLMConfig(d_model=32, n_layers=2, n_heads=2, d_ff=64, max_seq_len=64)


def merged_copy(model, adapter):
    """``model`` with every targeted weight replaced by ``W + scale * B @ A``."""
    merged = {k: v.clone() for k, v in model.state_dict().items()}
    for module, (a, b_scaled) in (adapter.weights if adapter else {}).items():
        merged[f"{module}.weight"] += b_scaled @ a
    return merged


def adapters_for(model, skip_of):
    targets = linear_targets(model)
    return {
        slot: make_adapter(f"a{slot}", targets, rank, seed=slot, skip=skip_of(slot))
        for slot, rank in zip(range(1, 7), (2, 4, 8, 16, 16, 3))
    }


def banked(model, adapters):
    bank = LoraBank(linear_targets(model), num_slots=8, max_rank=MAX_RANK, dtype=DTYPE)
    bank.attach(model)
    for slot, adapter in adapters.items():
        bank.write(slot, adapter)
    return bank


def test_recommender_mixed_batch_matches_per_row_merged_models():
    model = RecommenderMLP(base_weights(RECOMMENDER)).to(DTYPE).eval()
    # "layers.2" is the 1-wide score head (merged kernel); one adapter skips the first layer.
    adapters = adapters_for(model, lambda slot: ("layers.0",) if slot == 2 else ())
    reference = RecommenderMLP(base_weights(RECOMMENDER)).to(DTYPE).eval()
    bank = banked(model, adapters)
    index = [3, 0, 1, 6, 2, 4, 1, 5, 0, 6]
    x = torch.randn(len(index), RECOMMENDER.feature_dim, dtype=DTYPE)
    with torch.inference_mode():
        with bank.rows(torch.tensor(index)):
            got = model(x)
        for n, slot in enumerate(index):
            reference.load_state_dict(merged_copy(model, adapters.get(slot)))
            torch.testing.assert_close(got[n], reference(x[n : n + 1])[0], rtol=0, atol=1e-12)


def tinylm(dtype=DTYPE):
    model = TinyLM(TINY)
    model.load_state_dict(tinylm_base_weights(TINY))
    return model.to(dtype).eval()


def test_tinylm_mixed_batch_matches_per_row_merged_models():
    """Prefill (gather + bmm at 4+ positions), decoding (embedding_bag at 1 position) and a
    short prompt (embedding_bag at 2-3 positions), greedy tokens identical row by row."""
    model = tinylm()
    adapters = adapters_for(model, lambda slot: ("blocks.0.mlp.up_proj", "lm_head") if slot % 2 else ("lm_head",))
    reference = tinylm()
    bank = banked(model, adapters)
    index = [2, 0, 5, 1, 6, 3, 0, 4]
    prompts = [b"hello", b"a much longer prompt", b"x", b"ab", b"LoRA!", b"mixed batch", b"", b"hi"]
    budgets = [6, 3, 8, 5, 0, 7, 4, 6]
    sequences = [TinyLM.encode(p) for p in prompts]
    with torch.inference_mode():
        with bank.rows(torch.tensor(index)):
            logits = model(sequences)
            texts = model.generate(prompts, budgets)
        for n, slot in enumerate(index):
            reference.load_state_dict(merged_copy(model, adapters.get(slot)))
            want = reference([sequences[n]])[0]
            torch.testing.assert_close(logits[n, -len(sequences[n]):], want, rtol=0, atol=1e-10)
            assert texts[n] == reference.generate([prompts[n]], [budgets[n]])[0], f"row {n}"


def test_tinylm_float32_generation_matches_per_row_merged_models():
    """The bank's default dtype: greedy tokens of a mixed batch equal each row's own model."""
    model = tinylm(torch.float32)
    targets = linear_targets(model)
    adapters = {}
    for slot, rank in zip(range(1, 5), (4, 8, 16, 16)):
        adapter = make_adapter(f"a{slot}", targets, rank, seed=10 + slot, skip=("lm_head",))
        adapters[slot] = LoraAdapter(
            adapter.name, adapter.config, {m: (a.float(), b.float()) for m, (a, b) in adapter.weights.items()}
        )
    bank = LoraBank(targets, num_slots=4, max_rank=MAX_RANK)
    bank.attach(model)
    for slot, adapter in adapters.items():
        bank.write(slot, adapter)
    reference = tinylm(torch.float32)
    index = [1, 2, 0, 3, 4, 1, 0, 4]
    prompts = [f"customer request {i:03d}".encode() for i in range(len(index))]
    with torch.inference_mode():
        with bank.rows(torch.tensor(index)):
            texts = model.generate(prompts, 12)
        for n, slot in enumerate(index):
            reference.load_state_dict(merged_copy(model, adapters.get(slot)))
            assert texts[n] == reference.generate([prompts[n]], 12)[0], f"row {n}"


def test_hooks_leave_a_plain_module_tree():
    model = nn.Sequential(nn.Linear(4, 4))
    bank = LoraBank(linear_targets(model), num_slots=1, max_rank=2)
    handles = bank.attach(model)
    x = torch.randn(3, 4)
    with torch.inference_mode():
        plain = model(x)
        for handle in handles:
            handle.remove()
        assert torch.equal(model(x), plain)
