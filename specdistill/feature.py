"""A feature draft: one Llama decoder layer that reads the target's hidden states.

EAGLE-style. With committed tokens t_0..t_n and f_i the target's final hidden state at
position i after its final RMS norm (what its output head reads to predict t_{i+1}),
the draft's row j (j >= 1) reads ``x_j = fc(cat([embed(t_j), g_{j-1}]))`` (``embed``:
the target's input embedding), runs one Llama decoder layer over its rows (rotary
positions are consecutive integers; causal) and its own final RMS norm, giving
``yhat_j``, trained toward ``f_j``. Its logits are ``yhat_j @ head_rows.T`` over the
target's output-head rows for the K tokens of ``lm_head.ids``. Drafting a further
token feeds the draft's own output back: ``x = fc(cat([embed(drafted), yhat_prev]))``.

The target's feature ``g_i`` is ``f_i`` itself (``feature: final_norm``), or EAGLE-3's
fused feature (``feature: layers``; Li et al. 2025, arXiv 2503.01840): the outputs of a
low, a middle and a high layer at position i (the residual stream after each), each
RMS-normed with its own weight (``fuse_norm.weight`` ``[L*H]``: their scales differ by
tens), through one linear layer ``fuse.weight`` ``[H, L*H]``.

Training unrolls several drafting steps at once (EAGLE-3's training-time test): at step
s the row j sees the step-1 keys (real features) of rows <= j - s + 1 and the step-r keys
of row j - s + r for r = 2..s, which is what it sees when drafting its s-th token after
the real context ending at row j - s + 1 (``ttt_mask``).

A draft directory holds ``draft.json`` and ``draft.safetensors`` (float16:
``fc.weight``, ``model.layers.0.*`` with transformers' Llama names, ``model.norm.weight``,
and ``lm_head.ids``); the embedding and the head rows are the target's, never stored.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from runtime.drafts.draft_format import CONFIG_NAME, VOCAB_IDS, WEIGHTS_NAME
from runtime.drafts.feature_draft import FORMAT, FUSE, FUSE_NORM, VERSION, feature_layers, write

LAYER = "model.layers.0."
LAYER_KEYS = ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
              "self_attn.o_proj.weight", "mlp.gate_proj.weight", "mlp.up_proj.weight",
              "mlp.down_proj.weight", "input_layernorm.weight", "post_attention_layernorm.weight")


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x


class Attention(nn.Module):
    def __init__(self, c: dict[str, Any]) -> None:
        super().__init__()
        h, d = c["hidden_size"], c["head_dim"]
        self.heads, self.kv_heads, self.head_dim = (c["num_attention_heads"],
                                                    c["num_key_value_heads"], d)
        self.q_proj = nn.Linear(h, self.heads * d, bias=False)
        self.k_proj = nn.Linear(h, self.kv_heads * d, bias=False)
        self.v_proj = nn.Linear(h, self.kv_heads * d, bias=False)
        self.o_proj = nn.Linear(self.heads * d, h, bias=False)


class MLP(nn.Module):
    def __init__(self, c: dict[str, Any]) -> None:
        super().__init__()
        h, i = c["hidden_size"], c["intermediate_size"]
        self.gate_proj = nn.Linear(h, i, bias=False)
        self.up_proj = nn.Linear(h, i, bias=False)
        self.down_proj = nn.Linear(i, h, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Layer(nn.Module):
    def __init__(self, c: dict[str, Any]) -> None:
        super().__init__()
        self.self_attn = Attention(c)
        self.mlp = MLP(c)
        self.input_layernorm = RMSNorm(c["hidden_size"], c["rms_norm_eps"])
        self.post_attention_layernorm = RMSNorm(c["hidden_size"], c["rms_norm_eps"])


class Inner(nn.Module):
    def __init__(self, c: dict[str, Any]) -> None:
        super().__init__()
        self.layers = nn.ModuleList([Layer(c)])
        self.norm = RMSNorm(c["hidden_size"], c["rms_norm_eps"])


def rope_theta(config: dict[str, Any]) -> float:
    params = config.get("rope_parameters") or {}
    if params.get("rope_type", "default") != "default":
        raise ValueError(f"feature drafts support default rotary embeddings, not "
                         f"{params.get('rope_type')!r}")
    return float(params.get("rope_theta", config.get("rope_theta", 10000.0)))


def rotary(positions: torch.Tensor, head_dim: int, theta: float
           ) -> tuple[torch.Tensor, torch.Tensor]:  # [n, head_dim] each
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    freqs = positions.float()[:, None] * inv[None, :]
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos(), emb.sin()


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    turned = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + turned * sin


def ttt_mask(rows: int, step: int) -> torch.Tensor:  # [rows, step * rows] bool
    """Which keys the queries of drafting step ``step`` (1-based) see, over the keys of
    steps 1..step laid side by side: step-1 keys (real features) of rows <= j - step + 1,
    and the step-r key of row j - step + r for r = 2..step (always its own)."""
    j = torch.arange(rows)[:, None]
    i = torch.arange(rows)[None, :]
    blocks = [i <= j - step + 1] + [i == j - step + r for r in range(2, step + 1)]
    return torch.cat(blocks, dim=1)


class LayerNorms(nn.Module):
    """An RMS norm of each of ``count`` side-by-side ``size``-wide parts, with its own
    weight (``[count * size]``)."""

    def __init__(self, count: int, size: int, eps: float) -> None:
        super().__init__()
        self.count, self.size, self.eps = count, size, eps
        self.weight = nn.Parameter(torch.ones(count * size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., count * size]
        parts = x.unflatten(-1, (self.count, self.size))
        parts = parts * torch.rsqrt(parts.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * parts.flatten(-2)


class FeatureDraft(nn.Module):
    """The draft for training: ``fc``, ``model.layers.0``, ``model.norm`` (and with
    ``layers``, ``fuse_norm`` and ``fuse``); the target's embedding table and head rows
    are frozen buffers, not stored."""

    embedding: torch.Tensor
    head_table: torch.Tensor
    head_ids: torch.Tensor
    head_rows: torch.Tensor

    def __init__(self, config: dict[str, Any], embedding: torch.Tensor, head_ids: torch.Tensor,
                 head_table: torch.Tensor | None = None, layers: Sequence[int] = ()) -> None:
        super().__init__()
        self.config = dict(config)
        h = config["hidden_size"]
        self.layers = tuple(int(i) for i in layers)  # the target's fused layers, or none
        self.fc = nn.Linear(2 * h, h, bias=False)
        if self.layers:
            self.fuse_norm = LayerNorms(len(self.layers), h, config["rms_norm_eps"])
            self.fuse = nn.Linear(len(self.layers) * h, h, bias=False)
        self.model = Inner(config)
        self.theta = rope_theta(config)
        table = embedding if head_table is None else head_table
        self.register_buffer("embedding", embedding, persistent=False)  # [vocab, H]
        self.register_buffer("head_table", table, persistent=False)  # [vocab, H]
        self.register_buffer("head_ids", head_ids.long(), persistent=False)  # [K]
        self.register_buffer("head_rows", table[head_ids].clone(), persistent=False)  # [K, H]

    def inputs(self, tokens: torch.Tensor, feats: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.cat([self.embedding[tokens], feats], dim=-1))

    def target_feature(self, feats: torch.Tensor) -> torch.Tensor:  # [..., L*H or H] -> [..., H]
        """The target's feature as the draft reads it: fused from its layers, or as is."""
        return self.fuse(self.fuse_norm(feats)) if self.layers else feats

    def logits(self, yhat: torch.Tensor) -> torch.Tensor:  # [..., H] -> [..., K]
        return yhat @ self.head_rows.T

    def layer(self) -> Layer:
        layer = self.model.layers[0]
        assert isinstance(layer, Layer)
        return layer

    def _qkv(self, x: torch.Tensor, positions: torch.Tensor
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        a = self.layer().self_attn
        b, n, _ = x.shape
        h = self.layer().input_layernorm(x)
        q = a.q_proj(h).view(b, n, a.heads, a.head_dim).transpose(1, 2)
        k = a.k_proj(h).view(b, n, a.kv_heads, a.head_dim).transpose(1, 2)
        v = a.v_proj(h).view(b, n, a.kv_heads, a.head_dim).transpose(1, 2)
        cos, sin = rotary(positions, a.head_dim, self.theta)
        cos, sin = cos.to(x.device), sin.to(x.device)
        return _rotate(q, cos, sin), _rotate(k, cos, sin), v

    def _finish(self, x: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                mask: torch.Tensor) -> torch.Tensor:
        layer = self.layer()
        a = layer.self_attn
        groups = a.heads // a.kv_heads
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask.to(q.device))
        b, _, n, _ = out.shape
        x = x + a.o_proj(out.transpose(1, 2).reshape(b, n, -1))
        x = x + layer.mlp(layer.post_attention_layernorm(x))
        return self.model.norm(x)

    def unroll(self, tokens: torch.Tensor, feats: torch.Tensor, steps: int
               ) -> list[torch.Tensor]:
        """Drafting steps 1..``steps`` over every row at once. ``tokens`` [B, N]: each row's
        token (t_j); ``feats`` [B, N, H]: the real feature before it (f_{j-1}). Returns each
        step's outputs [B, N, H]; step s's output at row j is the s-th token's hidden state
        drafted after the real context ending at row j - s + 1 (rows j < s - 1: none).
        With ``layers``, ``feats`` holds the target's layers' outputs, [B, N, L*H]."""
        n = tokens.shape[1]
        positions = torch.arange(n)
        prev = self.target_feature(feats)
        keys: list[torch.Tensor] = []
        values: list[torch.Tensor] = []
        outs = []
        for s in range(1, steps + 1):
            x = self.inputs(tokens, prev)
            q, k, v = self._qkv(x, positions)
            keys.append(k)
            values.append(v)
            y = self._finish(x, q, torch.cat(keys, 2), torch.cat(values, 2), ttt_mask(n, s))
            outs.append(y)
            prev = torch.cat([torch.zeros_like(y[:, :1]), y[:, :-1]], dim=1)
        return outs

    def cached_step(self, tokens: torch.Tensor, feats: torch.Tensor, past_key: torch.Tensor,
                    past_value: torch.Tensor
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Rows ``tokens`` [B, n] beside ``feats`` [B, n, H] (the feature each reads as the
        draft reads it: ``target_feature``'s, or the draft's own output) after ``past``
        cached keys and values [B, kv_heads, p, head_dim]: their outputs [B, n, H] and the
        keys and values grown by n."""
        n, p = tokens.shape[1], past_key.shape[2]
        x = self.inputs(tokens, feats)
        q, k, v = self._qkv(x, torch.arange(n) + p)
        k, v = torch.cat([past_key, k], 2), torch.cat([past_value, v], 2)
        mask = torch.arange(p + n)[None, :] <= torch.arange(n)[:, None] + p  # [n, p + n]
        return self._finish(x, q, k, v, mask), k, v

    @torch.no_grad()
    def draft_sequential(self, tokens: list[int], feats: torch.Tensor, count: int,
                         feed: Sequence[int] | None = None
                         ) -> tuple[list[int], list[torch.Tensor]]:
        """Serving's arithmetic, step by step with a KV cache: the rows of ``tokens`` with
        the target's ``feats`` before each (``[len, H]``, or ``[len, L*H]`` with
        ``layers``), then ``count`` tokens drafted greedily, each fed back with the draft's
        own output (``feed``: these tokens fed instead of the drafted ones). Returns the
        drafted vocabulary ids and the output of each drafting step."""
        x = self.inputs(torch.tensor([tokens]), self.target_feature(feats[None]))
        n = len(tokens)
        q, k, v = self._qkv(x, torch.arange(n))
        y = self._finish(x, q, k, v, torch.ones(n, n, dtype=torch.bool).tril())
        last = y[:, -1:]
        drafted, outs = [], []
        for step in range(count):
            outs.append(last[0, 0])
            token = int(self.head_ids[self.logits(last[0, 0]).argmax()])
            drafted.append(token)
            if step == count - 1:
                break
            fed = token if feed is None else int(feed[step])
            x = self.inputs(torch.tensor([[fed]]), last)
            q, k1, v1 = self._qkv(x, torch.tensor([n + step]))
            k, v = torch.cat([k, k1], 2), torch.cat([v, v1], 2)
            last = self._finish(x, q, k, v, torch.ones(1, k.shape[2], dtype=torch.bool))
        return drafted, outs

    def stored_state(self) -> dict[str, torch.Tensor]:
        state = {k: v for k, v in self.state_dict().items()}
        state[VOCAB_IDS] = self.head_ids
        return state


def layer_config(target_config: Any, vocab_size: int) -> dict[str, Any]:
    """The draft's one-layer Llama config, from the target's (a namespace or transformers
    config)."""
    c = target_config if isinstance(target_config, dict) else dict(vars(target_config))
    hidden, heads = int(c["hidden_size"]), int(c["num_attention_heads"])
    out: dict[str, Any] = {
        "hidden_size": hidden, "intermediate_size": int(c["intermediate_size"]),
        "num_attention_heads": heads, "num_key_value_heads": int(c["num_key_value_heads"]),
        "head_dim": int(c.get("head_dim") or hidden // heads),
        "rms_norm_eps": float(c["rms_norm_eps"]),
        "max_position_embeddings": int(c["max_position_embeddings"]),
        "vocab_size": vocab_size, "num_hidden_layers": 1, "hidden_act": "silu",
    }
    if c.get("rope_parameters"):
        out["rope_parameters"] = dict(c["rope_parameters"])
    out["rope_theta"] = rope_theta(c)
    return out


def save_draft(draft: FeatureDraft, info: dict[str, Any], directory: Path) -> None:
    """Write the draft's directory (``runtime.drafts.feature_draft.write``: float16, ids int64)."""
    write(directory, info, draft.stored_state())


def load_feature_draft_weights(path: str | Path) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """``draft.json`` and the tensors of a feature draft directory, after checking the
    format, the tensors' names and their shapes against the config."""
    from safetensors.torch import load_file

    directory = Path(path)
    info = json.loads((directory / CONFIG_NAME).read_text(encoding="utf-8"))
    if info.get("format") != FORMAT or info.get("version") != VERSION:
        raise ValueError(f"{directory}: not a {FORMAT} v{VERSION} draft "
                         f"(format={info.get('format')!r}, version={info.get('version')!r})")
    for key in ("target", "model", "vocab_top_k", "feature"):
        if key not in info:
            raise ValueError(f"{directory}: {CONFIG_NAME} lacks {key!r}")
    layers = feature_layers(info, directory)
    tensors = load_file(str(directory / WEIGHTS_NAME))
    c = info["model"]
    h, i, d = c["hidden_size"], c["intermediate_size"], c["head_dim"]
    q, kv = c["num_attention_heads"] * d, c["num_key_value_heads"] * d
    shapes = {"fc.weight": (h, 2 * h), "model.norm.weight": (h,),
              VOCAB_IDS: (int(info["vocab_top_k"]),)}
    if layers:
        shapes.update({FUSE: (h, len(layers) * h), FUSE_NORM: (len(layers) * h,)})
    for key, shape in zip(LAYER_KEYS, [(q, h), (kv, h), (kv, h), (h, q), (i, h), (i, h),
                                       (h, i), (h,), (h,)], strict=True):
        shapes[LAYER + key] = shape
    if set(tensors) != set(shapes):
        raise ValueError(f"{directory}: tensors {sorted(set(tensors) ^ set(shapes))} are "
                         "missing or unexpected")
    for key, shape in shapes.items():
        if tuple(tensors[key].shape) != shape:
            raise ValueError(f"{directory}: {key} is {tuple(tensors[key].shape)}, not {shape}")
    if tensors[VOCAB_IDS].dtype != torch.int64:
        raise ValueError(f"{directory}: {VOCAB_IDS} must be int64")
    ids = tensors[VOCAB_IDS]
    if int(ids.min()) < 0 or int(ids.max()) >= int(info["target"]["vocab_size"]):
        raise ValueError(f"{directory}: {VOCAB_IDS} outside the target's vocabulary")
    return info, tensors
