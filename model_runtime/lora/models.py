"""The two LoRA base models, as plain torch modules.

* ``TinyLM``: a byte-level causal transformer (vocabulary = 256 bytes + BOS/EOS/PAD), so no
  tokenizer is downloaded.  Pre-LayerNorm blocks, learned positions, greedy generation with
  a KV cache over a left-padded batch.
* ``RecommenderMLP``: the recommender of ``model_repository/recommender`` (same
  ``layers.{i}.weight`` keys, so a fleet base weights file loads unchanged).

Both keep their ``nn.Linear`` layers under the names a PEFT adapter targets
(``blocks.0.attn.q_proj``, ``layers.1``); ``bank.LoraBank.attach`` hooks them, the module
tree itself knows nothing about LoRA.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from torch import nn

from .base_layers import OUTPUT_LAYERS

BYTE_VOCAB = 256


@dataclass(frozen=True)
class TinyLMConfig:
    d_model: int = 64
    n_layers: int = 2
    n_heads: int = 4
    d_ff: int = 256
    max_seq_len: int = 256

    BOS = BYTE_VOCAB
    EOS = BYTE_VOCAB + 1
    PAD = BYTE_VOCAB + 2
    vocab_size = BYTE_VOCAB + 3

    def __post_init__(self):
        if self.d_model % self.n_heads:
            raise ValueError(f"d_model ({self.d_model}) must be a multiple of n_heads ({self.n_heads})")

    def to_metadata(self) -> dict[str, str]:
        return {k: str(v) for k, v in asdict(self).items()}

    @classmethod
    def from_metadata(cls, metadata: Mapping[str, str]) -> TinyLMConfig:
        return cls(**{k: int(metadata[k]) for k in cls.__dataclass_fields__ if k in metadata})


class Attention(nn.Module):
    def __init__(self, cfg: TinyLMConfig):
        super().__init__()
        self.n_heads = cfg.n_heads
        self.head_dim = cfg.d_model // cfg.n_heads
        self.q_proj = nn.Linear(cfg.d_model, cfg.d_model)
        self.k_proj = nn.Linear(cfg.d_model, cfg.d_model)
        self.v_proj = nn.Linear(cfg.d_model, cfg.d_model)
        self.o_proj = nn.Linear(cfg.d_model, cfg.d_model)

    def forward(self, x, mask, cache, start):
        """x [B, T, D]; mask [B, 1, T, start+T] (True = attend); cache (k, v) [B, H, S, hd]
        written in place at columns start..start+T."""
        b, t, d = x.shape
        q = self.q_proj(x).view(b, t, self.n_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, t, self.n_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, t, self.n_heads, self.head_dim).transpose(1, 2)
        k_cache, v_cache = cache
        k_cache[:, :, start : start + t] = k
        v_cache[:, :, start : start + t] = v
        out = F.scaled_dot_product_attention(
            q, k_cache[:, :, : start + t], v_cache[:, :, : start + t], attn_mask=mask
        )
        return self.o_proj(out.transpose(1, 2).reshape(b, t, d))


class MLP(nn.Module):
    def __init__(self, cfg: TinyLMConfig):
        super().__init__()
        self.up_proj = nn.Linear(cfg.d_model, cfg.d_ff)
        self.down_proj = nn.Linear(cfg.d_ff, cfg.d_model)

    def forward(self, x):
        return self.down_proj(F.gelu(self.up_proj(x)))


class Block(nn.Module):
    def __init__(self, cfg: TinyLMConfig):
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.d_model)
        self.attn = Attention(cfg)
        self.ln2 = nn.LayerNorm(cfg.d_model)
        self.mlp = MLP(cfg)

    def forward(self, x, mask, cache, start):
        x = x + self.attn(self.ln1(x), mask, cache, start)
        return x + self.mlp(self.ln2(x))


class TinyLM(nn.Module):
    # Excluded from PEFT's target_modules="all-linear", as PEFT excludes the output head.
    output_layers = OUTPUT_LAYERS["tinylm"]

    def __init__(self, cfg: TinyLMConfig = TinyLMConfig()):
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.pos_embed = nn.Embedding(cfg.max_seq_len, cfg.d_model)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.ln_f = nn.LayerNorm(cfg.d_model)
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size)

    @staticmethod
    def encode(text: bytes) -> list[int]:
        return [TinyLMConfig.BOS, *text]

    @staticmethod
    def decode(tokens: Sequence[int]) -> bytes:
        return bytes(t for t in tokens if t < BYTE_VOCAB)

    def _new_cache(self, batch: int, length: int, like: torch.Tensor):
        shape = (batch, self.cfg.n_heads, length, self.cfg.d_model // self.cfg.n_heads)
        return [
            (like.new_zeros(shape), like.new_zeros(shape)) for _ in range(self.cfg.n_layers)
        ]

    def _step(self, tokens, positions, mask, caches, start):
        x = self.embed(tokens) + self.pos_embed(positions)
        for block, cache in zip(self.blocks, caches):
            x = block(x, mask, cache, start)
        return self.lm_head(self.ln_f(x))

    @staticmethod
    def _left_pad(sequences: Sequence[Sequence[int]], device) -> tuple[torch.Tensor, torch.Tensor]:
        length = max(len(s) for s in sequences)
        tokens = torch.full((len(sequences), length), TinyLMConfig.PAD, dtype=torch.long)
        for i, seq in enumerate(sequences):
            if seq:
                tokens[i, length - len(seq) :] = torch.tensor(list(seq), dtype=torch.long)
        pad = torch.tensor([length - len(s) for s in sequences], dtype=torch.long)
        return tokens.to(device), pad.to(device)

    @staticmethod
    def _mask(pad: torch.Tensor, q_start: int, q_len: int, k_len: int) -> torch.Tensor:
        """[B, 1, q_len, k_len]: a query at column c sees valid keys at columns <= c.  A padding
        query also sees itself, so no softmax row is empty (an empty one gives NaN, which would
        reach real rows through 0 * NaN in the value product)."""
        q_cols = torch.arange(q_start, q_start + q_len, device=pad.device)
        k_cols = torch.arange(k_len, device=pad.device)
        causal = k_cols[None, :] <= q_cols[:, None]
        valid = k_cols[None, :] >= pad[:, None]
        own = k_cols[None, None, :] == q_cols[None, :, None]
        return ((causal[None] & valid[:, None, :]) | own)[:, None]

    def forward(self, sequences: Sequence[Sequence[int]]) -> torch.Tensor:
        """Logits ``[B, L, vocab]`` for token sequences (left-padded to the longest)."""
        device = self.lm_head.weight.device
        tokens, pad = self._left_pad(sequences, device)
        b, length = tokens.shape
        positions = (torch.arange(length, device=device)[None, :] - pad[:, None]).clamp(min=0)
        caches = self._new_cache(b, length, self.lm_head.weight)
        return self._step(tokens, positions, self._mask(pad, 0, length, length), caches, 0)

    def generate(
        self, prompts: Sequence[bytes], max_new_tokens: Sequence[int] | int
    ) -> list[bytes]:
        """Greedy continuation of each prompt; a row stops at EOS or its own token budget.

        Every row of the batch runs the same steps (finished rows are ignored, not removed),
        so one call is one batch through the model however many adapters it mixes.
        """
        if isinstance(max_new_tokens, int):
            max_new_tokens = [max_new_tokens] * len(prompts)
        sequences = [self.encode(p) for p in prompts]
        longest = max(len(s) + n for s, n in zip(sequences, max_new_tokens))
        if longest > self.cfg.max_seq_len:
            raise ValueError(
                f"prompt + max_new_tokens is {longest} tokens; the context length is "
                f"{self.cfg.max_seq_len}"
            )
        device = self.lm_head.weight.device
        tokens, pad = self._left_pad(sequences, device)
        b, length = tokens.shape
        steps = max(max_new_tokens)
        out = [[] for _ in range(b)]
        if steps == 0:
            return [b""] * b
        caches = self._new_cache(b, length + steps, self.lm_head.weight)
        positions = (torch.arange(length, device=device)[None, :] - pad[:, None]).clamp(min=0)
        logits = self._step(tokens, positions, self._mask(pad, 0, length, length), caches, 0)
        budget = torch.tensor(max_new_tokens, device=device)
        done = budget <= 0
        last_pos = positions[:, -1]
        for step in range(steps):
            next_tokens = logits[:, -1].argmax(-1)
            for i, tok in enumerate(next_tokens.tolist()):
                if not done[i]:
                    out[i].append(tok)
            done = done | (next_tokens == TinyLMConfig.EOS) | (budget <= step + 1)
            if bool(done.all()):
                break
            col = length + step
            last_pos = last_pos + 1
            mask = self._mask(pad, col, 1, col + 1)
            logits = self._step(next_tokens[:, None], last_pos[:, None], mask, caches, col)
        return [self.decode(seq) for seq in out]


def tinylm_random_weights(cfg: TinyLMConfig, seed: int) -> dict[str, torch.Tensor]:
    """Deterministic weights (same seed, same bytes): unit-variance-preserving init so the
    logits have spread and adapters visibly change the greedy output."""
    gen = torch.Generator().manual_seed(seed)
    weights = {}
    for name, module in TinyLM(cfg).named_modules():
        if isinstance(module, nn.LayerNorm):
            weights[f"{name}.weight"] = torch.ones(module.normalized_shape)
            weights[f"{name}.bias"] = torch.zeros(module.normalized_shape)
        elif isinstance(module, nn.Embedding):
            weights[f"{name}.weight"] = torch.randn(module.weight.shape, generator=gen)
        elif isinstance(module, nn.Linear):
            shape = module.weight.shape
            weights[f"{name}.weight"] = torch.randn(shape, generator=gen) / math.sqrt(shape[1])
            weights[f"{name}.bias"] = torch.randn(shape[0], generator=gen) * 0.02
    # Favour printable ASCII so the demo's "generated text" reads as text, not random bytes.
    weights["lm_head.bias"][32:127] += 4.0
    return weights


def save_tinylm(path: Path | str, weights: Mapping[str, torch.Tensor], cfg: TinyLMConfig) -> None:
    save_file({k: v.contiguous() for k, v in weights.items()}, str(path), metadata=cfg.to_metadata())


def load_tinylm(path: Path | str, dtype: torch.dtype = torch.float32) -> TinyLM:
    with safe_open(str(path), framework="pt") as f:
        metadata = f.metadata() or {}
    model = TinyLM(TinyLMConfig.from_metadata(metadata))
    model.load_state_dict(load_file(str(path)))
    return model.to(dtype).eval()


class RecommenderMLP(nn.Module):
    """features -> [Linear -> ReLU] * n -> Linear(1) -> sigmoid score."""

    output_layers = OUTPUT_LAYERS["recommender"]

    def __init__(self, weights: Mapping[str, torch.Tensor]):
        super().__init__()
        count = len([k for k in weights if k.endswith(".weight")])
        self.layers = nn.ModuleList()
        for i in range(count):
            w = weights[f"layers.{i}.weight"]
            self.layers.append(nn.Linear(w.shape[1], w.shape[0]))
        self.load_state_dict(dict(weights))

    @property
    def feature_dim(self) -> int:
        return self.layers[0].in_features

    def forward(self, x):
        for layer in self.layers[:-1]:
            x = torch.relu(layer(x))
        return torch.sigmoid(self.layers[-1](x))


def load_recommender(path: Path | str, dtype: torch.dtype = torch.float32) -> RecommenderMLP:
    return RecommenderMLP(load_file(str(path))).to(dtype).eval()


def linear_targets(model: nn.Module) -> dict[str, tuple[int, int]]:
    """``module name -> (out_features, in_features)`` of every nn.Linear: what LoRA can target."""
    return {
        name: (m.out_features, m.in_features)
        for name, m in model.named_modules()
        if isinstance(m, nn.Linear)
    }
