"""The batched runner's decoder layers as PyTorch ops (``runtime.runner.fused`` is the native
kernels' path): the matrix products over the packed tokens, attention per padded block
(``runtime.runner.attention``), each layer's window and norms as its family has them.
"""

from __future__ import annotations

import torch
from torch import nn

from runtime.matrices.weights import Product, multiply, norm_heads
from runtime.runner.attention import rotate
from runtime.runner.layout import Layout
from runtime.runner.stack import Stack


def forward(stack: Stack, batch: Layout, inputs: torch.Tensor | None = None) -> torch.Tensor:
    """The decoder layers over ``batch``'s packed tokens (or the given ``inputs`` rows,
    ``[T, H]``), before the final norm; ``[T, H]``: ``stack``'s modules, matrices and KV
    buffers."""
    inner = stack.inner
    hidden = inner.embed_tokens(batch.ids) if inputs is None else inputs  # [T, H]
    scale = getattr(inner, "embed_scale", None)
    if scale is not None and inputs is None:  # rounded to the rows' dtype first, as
        hidden = hidden * torch.tensor(scale).to(hidden.dtype)  # transformers' Gemma does
    rotary = [_cos_sin(inner.rotary_emb, hidden, batch.positions)]
    local = getattr(inner, "rotary_local", None)  # the sliding-window layers' own
    if local is not None:
        rotary.append(_cos_sin(local, hidden, batch.positions))
    heads, kv, dim = stack.heads, stack.kv_heads, stack.head_dim
    split = batch.bulk_from

    def product(m: Product, x: torch.Tensor) -> torch.Tensor:
        return multiply(m, x, split)

    attention = stack.attention
    masks: dict[int | None, list[torch.Tensor]] = {}
    firsts: dict[int | None, list[int]] = {}  # per group, the first key a layer reads
    for w in stack.weights:
        if w.window not in masks:
            firsts[w.window] = [0 if w.window is None else g.window_start(w.window)
                                for g in batch.groups]
            masks[w.window] = [
                attention.mask((g.mask if w.window is None else g.window_mask(w.window))[
                    ..., first:], g.width, hidden.dtype)
                for g, first in zip(batch.groups, firsts[w.window], strict=True)]
    for index, w in enumerate(stack.weights):
        cos, sin = rotary[1 if w.window is not None and local is not None else 0]
        qkv = product(w.qkv, w.input_norm(hidden))  # [T, (h + 2 kv) D]
        if w.qk_norms is not None:
            qkv = norm_heads(qkv, w.qk_norms, heads, kv, dim)
        qk = rotate(qkv[:, : (heads + kv) * dim].view(-1, heads + kv, dim), cos, sin)
        q, k = qk[:, :heads], qk[:, heads:]
        v = qkv[:, (heads + kv) * dim :].view(-1, kv, dim)
        out = product(w.o, attention.attend_layer(batch, masks[w.window], q, k, v,
                                                  stack.keys[index], stack.values[index],
                                                  firsts[w.window]))
        if w.out_norms is not None:
            out = w.out_norms[0](out)
        hidden = hidden + out
        gate, up = product(w.gate_up, w.post_norm(hidden)).chunk(2, dim=-1)
        out = product(w.down, w.act(gate) * up)
        if w.out_norms is not None:
            out = w.out_norms[1](out)
        hidden = hidden + out
    return hidden


def _cos_sin(rotary: nn.Module, hidden: torch.Tensor, positions: torch.Tensor
             ) -> tuple[torch.Tensor, torch.Tensor]:  # [T, 1, D] each
    cos, sin = rotary(hidden, positions[None])  # [1, T, D]
    return cos[0, :, None], sin[0, :, None]
