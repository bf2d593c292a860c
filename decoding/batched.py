"""The target as a batched runner: many sequences' tokens in one forward pass.

``BatchedLM`` runs Llama-family models (Llama, Mistral without a sliding
window, Qwen2) with its own forward over the model's own modules, so that
several sequences, each adding a different number of tokens at a different
position, share one pass over the weights. On a CPU or a GPU at small batch a
decoding step is bound by reading the weights, so verifying eight streams'
drafts costs little more than verifying one.

The KV cache is preallocated: one tensor per layer for keys and one for values,
``[rows, kv_heads, capacity, head_dim]``, where every sequence owns a row and a
length. Rolling a sequence back is setting its length; nothing is copied or
freed per round. Capacity and rows grow by doubling when needed. Released rows
are refilled from the end, so the rows in use stay dense and one forward covers
a contiguous block of them. When the last sequence leaves, the buffers shrink
back to their first size. The buffers hold rows x the longest sequence's
positions: with 16 requests and an 8k context, up to 6 GB for the default
model in float32 (``max_active`` bounds the rows).

A forward packs every sequence's new tokens into one list for the matrix
products (a ragged batch costs its real tokens, not the longest row times the
rows) and pads them to ``[rows, width]`` only for attention, where the mask
lets each query see its own row's cached keys and the new keys up to itself.

For one sequence it offers the same calls as ``CausalLM`` (``new_state``,
``prefill``, ``score``, ``rollback``, ``load_kv``, ``kv``), so everything that
drives a single sequence keeps working; ``forward_batch`` is the batched call.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.nn import functional as F

from decoding.target import BatchItem, CausalLM, head_subset

log = logging.getLogger(__name__)

SUPPORTED_MODEL_TYPES = frozenset({"llama", "mistral", "qwen2"})
_INITIAL_CAPACITY = 256
_INITIAL_ROWS = 4
_CAPACITY_ALIGN = 64
_GROUP_WIDTH = 16  # additions up to this many tokens may share one padded attention block
# What one more attention block per layer costs, in (query, key) pairs. A 2-core CPU with the
# default model measured ~44 us per call against ~0.03 us per pair (1,500 pairs), but with
# that figure a batch where every stream drafts split into many blocks and decoded 2-3% slower
# end to end; at 4,000 it stays one block, while one long draft among one-token rows and
# short drafts over long contexts are still split.
_BLOCK_OVERHEAD = 4000
# On a GPU a call costs its kernel launches (about ten per block and layer) while the
# pairs themselves are nearly free, so blocks merge far more readily there: with many
# sequences, several prompts joining in one pass share one block instead of a call each.
# On an H200 (default model, float32), 1,024 rows decoding while ten ~100-token prompts
# joined took 54 ms a pass this way, with one-token rows folded (see ``_folds``); 81 ms
# with a block per prompt, 96 ms without the fold; 512 rows 36 ms, and 49 ms with neither.
_GPU_BLOCK_OVERHEAD = 250_000


@dataclass(eq=False)
class BatchedState:
    """One sequence: its row in the KV buffers and how many positions it holds."""

    row: int
    length: int = 0
    released: bool = False


def supports(model: Any) -> str | None:
    """Why ``model`` cannot run batched, or None when it can."""
    config = model.config
    model_type = getattr(config, "model_type", None)
    if model_type not in SUPPORTED_MODEL_TYPES:
        return f"model type {model_type!r} is not one of {sorted(SUPPORTED_MODEL_TYPES)}"
    window = getattr(config, "sliding_window", None)
    longest = getattr(config, "max_position_embeddings", None) or 1 << 30
    if window and getattr(config, "use_sliding_window", True) and window < longest:
        return "sliding-window attention is not supported"
    inner = getattr(model, "model", None)
    if inner is None or not hasattr(inner, "layers") or not hasattr(inner, "rotary_emb"):
        return "the model does not have the usual decoder layout"
    return None


class BatchedLM(CausalLM):
    """A Llama-family causal LM whose sequences can share one forward pass."""

    def __init__(self, model: Any, tokenizer: Any, name: str = "model") -> None:
        super().__init__(model, tokenizer, name)
        reason = supports(model)
        if reason is not None:
            raise ValueError(f"{name}: cannot run batched: {reason}")
        self._inner = model.model
        self._layers = list(self._inner.layers)
        self.scaling = float(self._layers[0].self_attn.scaling)
        self._qkv_sizes = [self.heads * self.head_dim, self.kv_heads * self.head_dim,
                           self.kv_heads * self.head_dim]
        self._weights = [_LayerWeights.of(layer) for layer in self._layers]
        head = model.get_output_embeddings()
        bias = getattr(head, "bias", None)
        self._head = _Matrix(head.weight.detach(), bias.detach() if bias is not None else None)
        self._head_ids = head_subset(model)  # [K]: a head over part of the vocabulary
        # see _folds
        self._fold_single = self.device.type != "cpu" or self.dtype != torch.float32
        self._keys: list[torch.Tensor] = []
        self._values: list[torch.Tensor] = []
        self._rows: list[BatchedState | None] = []
        self._capacity = 0
        self._allocate(_INITIAL_ROWS, _INITIAL_CAPACITY)

    @classmethod
    def wrap(cls, model: Any, tokenizer: Any, name: str) -> CausalLM:
        """Batched when the model's architecture allows, else a plain ``CausalLM``
        (``BatchedLM.load`` loads either)."""
        reason = supports(model)
        if reason is not None:
            log.warning("%s runs one sequence per forward pass: %s", name, reason)
            return CausalLM(model, tokenizer, name=name)
        return cls(model, tokenizer, name=name)

    # -- sequences --------------------------------------------------------------------

    @property
    def batched(self) -> bool:
        return True

    @property
    def branches(self) -> bool:
        return True

    @torch.inference_mode()
    def adopt_alternative(self, state: Any, start: int, n: int) -> None:
        for buffer in (*self._keys, *self._values):
            buffer[state.row, :, start + 1].copy_(buffer[state.row, :, start + n - 1])
        state.length = start + 2

    @property
    def capacity(self) -> int:
        return self._capacity

    @property
    def rows_in_use(self) -> int:
        return sum(1 for s in self._rows if s is not None)

    @torch.inference_mode()
    def new_state(self) -> BatchedState:  # type: ignore[override]
        row = self.rows_in_use
        if row == len(self._rows):
            self._allocate(2 * len(self._rows), self._capacity)
        state = BatchedState(row=row)
        self._rows[row] = state
        return state

    @torch.inference_mode()
    def warmup(self) -> None:
        """Run a pass of every token count up to ``_ONEDNN_MAX_TOKENS``: oneDNN builds a
        primitive per shape on first use, which would otherwise cost time and memory
        while serving."""
        state = self.new_state()
        try:
            for tokens in range(1, _ONEDNN_MAX_TOKENS + 1):
                self.forward_batch([BatchItem(state, [0] * tokens, tokens)])
                self.rollback(state, 0)
        finally:
            self.release(state)

    def kv_bytes(self, rows: int, positions: int) -> int:
        """The KV buffers' size for ``rows`` sequences of up to ``positions`` tokens."""
        return super().kv_bytes(max(rows, _INITIAL_ROWS),
                                _aligned(max(positions, _INITIAL_CAPACITY)))

    def fit(self, rows: int, positions: int) -> None:
        """Size the buffers for ``rows`` sequences of up to ``positions`` tokens: grow to
        it at once, or shrink when they are more than twice that (what the sequences
        hold is kept)."""
        rows = max(rows, _INITIAL_ROWS, self.rows_in_use)
        longest = max((s.length for s in self._rows if s is not None), default=0)
        capacity = _aligned(max(positions, _INITIAL_CAPACITY, longest))
        if (rows > len(self._rows) or capacity > self._capacity
                or len(self._rows) > 2 * rows or self._capacity > 2 * capacity):
            self._allocate(rows, capacity)

    @torch.inference_mode()
    def release(self, state: Any) -> None:
        """Give the sequence's row back; the last row in use moves into the gap."""
        if state.released:
            return
        state.released = True
        state.length = 0
        last = self.rows_in_use - 1
        hole = state.row
        self._rows[hole] = None
        if hole != last:
            moved = self._rows[last]
            assert moved is not None
            n = moved.length
            for buffer in (*self._keys, *self._values):
                buffer[hole, :, :n].copy_(buffer[last, :, :n])
            self._rows[last] = None
            self._rows[hole] = moved
            moved.row = hole
        if last == 0 and (self._capacity > _INITIAL_CAPACITY or len(self._rows) > _INITIAL_ROWS):
            self._keys, self._values, self._rows = [], [], []  # idle: give the memory back
            self._allocate(_INITIAL_ROWS, _INITIAL_CAPACITY)

    def rollback(self, state: Any, length: int) -> None:
        state.length = min(state.length, length)

    @torch.inference_mode()
    def load_kv(self, state: Any, kv: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> None:
        if state.length:
            raise ValueError("load_kv needs an empty cache")
        if not kv:
            return
        n = int(kv[0][0].shape[2])
        self._ensure_capacity(n)
        for layer, (keys, values) in enumerate(kv):
            self._keys[layer][state.row, :, :n].copy_(keys[0])
            self._values[layer][state.row, :, :n].copy_(values[0])
        state.length = n

    def kv(self, state: Any) -> list[tuple[torch.Tensor, torch.Tensor]]:
        n, row = state.length, state.row
        return [(k[row : row + 1, :, :n], v[row : row + 1, :, :n])
                for k, v in zip(self._keys, self._values, strict=True)]

    # -- forward passes -----------------------------------------------------------------

    @torch.inference_mode()
    def prefill(self, state: Any, token_ids: Sequence[int]) -> torch.Tensor:
        return self.forward_batch([BatchItem(state, token_ids, 1)])[0][0]

    @torch.inference_mode()
    def score(self, state: Any, token_ids: Sequence[int]) -> torch.Tensor:
        return self.forward_batch([BatchItem(state, token_ids, len(token_ids))])[0]

    @torch.inference_mode()
    def forward_batch(self, items: Sequence[BatchItem]) -> list[torch.Tensor]:
        """One forward pass over every item's new tokens; the kept logits of each,
        ``[keep, vocab]``, in the order given. Every sequence's cache grows by its
        tokens."""
        if not items:
            return []
        rows = [item.state.row for item in items]
        if len(set(rows)) != len(rows):
            raise ValueError("a sequence appears twice in one batch")
        if any(item.state.released for item in items):
            raise ValueError("a released sequence cannot run")
        if any(not item.token_ids for item in items):
            raise ValueError("every sequence in a batch needs at least one new token")
        if any(item.alternative and len(item.token_ids) < 3 for item in items):
            raise ValueError("an alternative needs the pending token and a draft before it")
        for item in items:
            if item.state.length + len(item.token_ids) > self.max_context:
                raise ValueError(f"{len(item.token_ids)} tokens after {item.state.length} "
                                 f"exceed the context of {self.max_context}")
        self._ensure_capacity(max(item.state.length + len(item.token_ids) for item in items))
        batch = _Layout.build(items, self.device)
        hidden = self._forward_layers(batch)  # [T, H]: every real token, packed

        kept = [i for i, item in zip(batch.offsets, items, strict=True)
                for i in range(i + len(item.token_ids) - min(item.keep, len(item.token_ids)),
                               i + len(item.token_ids))]
        logits = (self._logits(self._inner.norm(hidden[kept])) if kept
                  else hidden.new_empty((0, self.vocab_size)))  # [K, V]
        outputs: list[torch.Tensor] = []
        offset = 0
        for item in items:
            keep = min(item.keep, len(item.token_ids))
            outputs.append(logits[offset : offset + keep])
            offset += keep
            item.state.length += len(item.token_ids)
        return outputs

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [K, H] -> [K, vocab]
        rows = self._head(hidden)
        if self._head_ids is None:
            return rows
        # tokens outside the head's set get the lowest finite logit: never proposed
        full = rows.new_full((rows.shape[0], self.vocab_size), torch.finfo(rows.dtype).min)
        full[:, self._head_ids] = rows
        return full

    def _forward_layers(self, batch: _Layout) -> torch.Tensor:
        """The decoder layers over packed tokens; attention per group over padded rows."""
        hidden = self._inner.embed_tokens(batch.ids)  # [T, H]
        cos, sin = self._inner.rotary_emb(hidden, batch.positions[None])  # [1, T, D]
        cos, sin = cos[0, :, None], sin[0, :, None]  # [T, 1, D]
        rows, at = batch.cache_rows, batch.cache_slots
        width = self.heads * self.head_dim
        single = len(batch.groups) == 1
        masks = [self._fold_mask(group.mask) if self._folds(group.width) else group.mask
                 for group in batch.groups]
        for index, w in enumerate(self._weights):
            x = w.input_norm(hidden)
            q, k, v = w.qkv(x).split(self._qkv_sizes, dim=-1)
            q = q.view(-1, self.heads, self.head_dim)
            k = k.reshape(-1, self.kv_heads, self.head_dim)
            v = v.reshape(-1, self.kv_heads, self.head_dim)
            q = q * cos + _rotate_half(q) * sin
            k = k * cos + _rotate_half(k) * sin
            keys, values = self._keys[index], self._values[index]
            keys[rows, :, at] = k  # buffer[row, :, position] for each token: [T, kv, D]
            values[rows, :, at] = v
            out = q.new_empty((q.shape[0], width)) if not single else None
            for group, mask in zip(batch.groups, masks, strict=True):
                group_q = q if single else q[group.tokens]
                padded = q.new_zeros((group.n_rows * group.width, self.heads, self.head_dim))
                padded[group.slots] = group_q
                hi = group.lo + group.n_rows
                attended = self._attend(
                    padded.view(group.n_rows, group.width, self.heads, self.head_dim),
                    keys[group.lo : hi, :, : group.span], values[group.lo : hi, :, : group.span],
                    mask)  # [R, W, h, D]
                attended = attended.reshape(-1, width)[group.slots]
                if out is None:
                    out = attended
                else:
                    out[group.tokens] = attended
            assert out is not None
            hidden = hidden + w.o(out)
            gate, up = w.gate_up(w.post_norm(hidden)).chunk(2, dim=-1)
            hidden = hidden + w.down(w.act(gate) * up)
        return hidden

    def _folds(self, width: int) -> bool:
        """Whether a block this wide attends with its query heads folded onto their
        shared key/value heads (grouped-query attention, more than one query per row;
        for one query too on a GPU, where PyTorch's masked grouped-query attention takes
        the reference path, which copies every key and value once per query head, and on
        a CPU in bfloat16, where a one-token pass of the default model at a 300-token
        context spent 253 us per layer in it against 78 folded: 27.6 -> 24.7 ms a pass.
        In float32 a CPU's grouped-query path is the faster for one query)."""
        return self.heads != self.kv_heads and (width > 1 or self._fold_single)

    def _fold_mask(self, mask: torch.Tensor) -> torch.Tensor:  # [R, 1, W, S] -> [R, 1, g*W, S]
        rows, _, queries, span = mask.shape
        group = self.heads // self.kv_heads
        return (mask.unsqueeze(2).expand(rows, 1, group, queries, span)
                .reshape(rows, 1, group * queries, span))

    def _attend(self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                mask: torch.Tensor) -> torch.Tensor:  # q [R, W, h, D] -> [R, W, h, D]
        """Attention of a padded block. With several queries per row and grouped-query
        attention, the query heads that share a key/value head become extra queries of
        that head (``[R, kv, g*W, D]``, ``mask`` folded the same way): the keys and
        values are then read once per key/value head, not once per query head. On a
        2-core CPU the attention call of a block of 8 rows x 2-5 queries over 300-800
        cached positions took 1.6-1.7x less time (9 queries: 1.1x); for one query per row
        PyTorch's grouped-query path is as fast."""
        rows, queries, heads, dim = q.shape
        if not self._folds(queries):
            return F.scaled_dot_product_attention(
                q.transpose(1, 2), keys, values, attn_mask=mask, scale=self.scaling,
                enable_gqa=self.heads != self.kv_heads).transpose(1, 2)
        group = heads // self.kv_heads
        folded = (q.view(rows, queries, self.kv_heads, group, dim).permute(0, 2, 3, 1, 4)
                  .reshape(rows, self.kv_heads, group * queries, dim))
        out = F.scaled_dot_product_attention(folded, keys, values, attn_mask=mask,
                                             scale=self.scaling)  # [R, kv, g*W, D]
        return (out.view(rows, self.kv_heads, group, queries, dim).permute(0, 3, 1, 2, 4)
                .reshape(rows, queries, heads, dim))

    # -- buffers ------------------------------------------------------------------------

    def _ensure_capacity(self, needed: int) -> None:
        if needed > self._capacity:
            self._allocate(len(self._rows), _aligned(max(needed, 2 * self._capacity)))

    @torch.inference_mode()
    def _allocate(self, rows: int, capacity: int) -> None:
        shape = (rows, self.kv_heads, capacity, self.head_dim)
        keys = [torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in self._layers]
        values = [torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in self._layers]
        used = self.rows_in_use if self._rows else 0
        longest = max((s.length for s in self._rows if s is not None), default=0)
        for old, new in zip((*self._keys, *self._values), (*keys, *values), strict=False):
            new[:used, :, :longest].copy_(old[:used, :, :longest])
        self._keys, self._values = keys, values
        self._rows = (self._rows + [None] * rows)[:rows]
        self._capacity = capacity
        log.debug("KV buffers: %d rows x %d positions", rows, capacity)


class _Matrix:
    """A weight matrix kept in the layout a CPU multiplies fastest. On a CPU with oneDNN:
    packed once into oneDNN's blocked layout, for products of up to
    ``_ONEDNN_MAX_TOKENS`` tokens (a decode step, a verify pass, a batch of streams). A
    plain ``[out, in]`` matrix is reordered on every call, and MKL's small products read
    the weights far below the memory's speed; packed, a product of 2-8 tokens costs
    little more than one token's (a verify pass of several drafts about a single step),
    and one token runs faster than MKL's matrix-vector product too. Larger products
    (prefill chunks) take the default product of the ``[out, in]`` matrix, as on a GPU.
    Without oneDNN, in float32: ``[in, out]`` for a single token (one pass streams it,
    well faster than the usual product)."""

    def __init__(self, rows: torch.Tensor, bias: torch.Tensor | None) -> None:
        self.rows = rows  # [out, in], contiguous
        self.bias = bias
        cpu = rows.device.type == "cpu"
        self.packed = _pack(rows) if cpu else None  # oneDNN's opaque blocked copy
        self.cols = (rows.t().contiguous()
                     if cpu and self.packed is None and rows.dtype == torch.float32 else None)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is not None and x.shape[0] <= _ONEDNN_MAX_TOKENS:
            assert _ONEDNN_LINEAR is not None
            return _ONEDNN_LINEAR(x, self.packed, self.bias, "none", [], "")
        if self.cols is not None and x.shape[0] == 1:
            if self.bias is not None:
                return torch.addmm(self.bias, x, self.cols)
            return x @ self.cols
        return F.linear(x, self.rows, self.bias)


def _onednn_linear() -> tuple[Any, frozenset[torch.dtype]]:
    """oneDNN's linear over a packed weight where this PyTorch build has it (CPU builds
    with mkldnn), and the dtypes in which it computes what the plain product does."""
    op = getattr(torch.ops.mkldnn, "_linear_pointwise", None)
    reorder = getattr(torch.ops.mkldnn, "_reorder_linear_weight", None)
    if op is None or reorder is None or not torch.backends.mkldnn.is_available():
        return None, frozenset()
    x = torch.arange(6.0).view(2, 3)
    w = torch.arange(12.0).view(4, 3)
    dtypes = set()
    for dtype in (torch.float32, torch.bfloat16):
        try:
            got = op(x.to(dtype), reorder(w.to(dtype), _PACK_TOKENS), None, "none", [], "")
        except (RuntimeError, NotImplementedError):
            continue
        if torch.equal(got.float(), x @ w.t()):
            dtypes.add(dtype)
    return (op, frozenset(dtypes)) if dtypes else (None, frozenset())


def _pack(rows: torch.Tensor) -> torch.Tensor | None:
    """``rows`` in oneDNN's blocked layout for products of a few tokens; None where oneDNN
    is missing or does not take this dtype."""
    if _ONEDNN_LINEAR is None or rows.dtype not in _ONEDNN_DTYPES:
        return None
    try:
        packed: torch.Tensor = torch.ops.mkldnn._reorder_linear_weight(rows, _PACK_TOKENS)
    except (RuntimeError, NotImplementedError):
        return None
    return packed


# the product size oneDNN's layout is chosen for: on the 2-core CPU here, packed for 4 to 32
# tokens, products of 1 to 8 cost about the same (packed for 1, 8 tokens cost 1.5-1.6x 1)
_PACK_TOKENS = 8
_ONEDNN_LINEAR, _ONEDNN_DTYPES = _onednn_linear()
# oneDNN keeps a primitive per shape it has run: used for a bounded range of token counts,
# its memory stays bounded too; larger products go to the default product
_ONEDNN_MAX_TOKENS = 32


@dataclass(frozen=True)
class _LayerWeights:
    """One decoder layer's matrices, fused (q, k and v as one; gate and up as one).
    The fused ``[out, in]`` tensors become the modules' own weights (each module
    sees its rows), so only the ``[in, out]`` copies take extra memory. The norms
    and the activation are the layer's own."""

    input_norm: Any
    post_norm: Any
    act: Any
    qkv: _Matrix
    o: _Matrix
    gate_up: _Matrix
    down: _Matrix

    @classmethod
    def of(cls, layer: Any) -> _LayerWeights:
        attention, mlp = layer.self_attn, layer.mlp
        return cls(input_norm=layer.input_layernorm, post_norm=layer.post_attention_layernorm,
                   act=mlp.act_fn,
                   qkv=_fuse((attention.q_proj, attention.k_proj, attention.v_proj)),
                   o=_fuse((attention.o_proj,)), gate_up=_fuse((mlp.gate_proj, mlp.up_proj)),
                   down=_fuse((mlp.down_proj,)))


def _fuse(linears: Sequence[Any]) -> _Matrix:
    """One ``[sum(out), in]`` matrix for ``linears``; each module's weight (and bias)
    becomes a view of its rows."""
    weights = [m.weight.detach() for m in linears]
    fused = torch.cat(weights, dim=0) if len(weights) > 1 else weights[0].contiguous()
    biases = [getattr(m, "bias", None) for m in linears]
    bias = None
    if any(b is not None for b in biases):
        bias = torch.cat([b.detach() if b is not None else w.new_zeros(w.shape[0])
                          for b, w in zip(biases, weights, strict=True)])
    start = 0
    for module, weight, own_bias in zip(linears, weights, biases, strict=True):
        rows = weight.shape[0]
        if len(linears) > 1:
            module.weight = torch.nn.Parameter(fused[start : start + rows], requires_grad=False)
            if bias is not None and own_bias is not None:
                module.bias = torch.nn.Parameter(bias[start : start + rows], requires_grad=False)
        start += rows
    return _Matrix(fused, bias)


@dataclass(frozen=True)
class _Group:
    """Sequences whose attention runs as one padded ``[rows, width]`` block over the
    contiguous cache rows ``lo .. lo + n_rows`` (rows in the block but not in the
    group get zero queries whose output is dropped)."""

    tokens: torch.Tensor  # [t] the group's tokens' indexes in the packed order
    slots: torch.Tensor  # [t] each token's index in the padded [n_rows * width] layout
    mask: torch.Tensor  # [n_rows, 1, width, span] which positions each padded query sees
    lo: int
    n_rows: int
    width: int
    span: int

    @classmethod
    def build(cls, items: Sequence[BatchItem], members: list[int], offsets: list[int],
              device: torch.device) -> _Group:
        rows = [items[i].state.row for i in members]
        lo, n_rows = min(rows), max(rows) + 1 - min(rows)
        width = max(len(items[i].token_ids) for i in members)
        tokens: list[int] = []
        slots: list[int] = []
        starts = [0] * n_rows
        span = 0
        for i in members:
            item = items[i]
            row, start, n = item.state.row - lo, item.state.length, len(item.token_ids)
            tokens.extend(range(offsets[i], offsets[i] + n))
            slots.extend(range(row * width, row * width + n))
            starts[row] = start
            span = max(span, start + n)
        query_pos = torch.tensor(starts)[:, None] + torch.arange(width)[None, :]  # [R, W]
        keys = torch.arange(span)
        mask = keys[None, None, :] <= query_pos[:, :, None]  # causal, per row
        for i in members:  # an alternative sees the cache and the pending token, and itself
            item = items[i]
            if item.alternative:
                start, n = item.state.length, len(item.token_ids)
                mask[item.state.row - lo, n - 1] = (keys <= start) | (keys == start + n - 1)
        return cls(tokens=torch.tensor(tokens, dtype=torch.long, device=device),
                   slots=torch.tensor(slots, dtype=torch.long, device=device),
                   mask=mask[:, None].to(device), lo=lo, n_rows=n_rows, width=width, span=span)


@dataclass(frozen=True)
class _Layout:
    """Where a batch's tokens go: packed for the matrix products, padded per group
    for attention, in blocks as ``attention_blocks`` decides. Long additions (prompt
    chunks) never share a block with short ones (decoding rounds), so a prompt riding
    along in a decoding pass does not pad every other row to its length."""

    ids: torch.Tensor  # [T] token ids, packed
    positions: torch.Tensor  # [T] position of each token in its sequence
    cache_slots: torch.Tensor  # [T] where its keys and values go in its row (its position,
    # but for an alternative: after the tokens before it, at the position of the second)
    cache_rows: torch.Tensor  # [T] the cache row of each token
    offsets: list[int]  # where each item's tokens start in the packed order
    groups: list[_Group]

    @classmethod
    def build(cls, items: Sequence[BatchItem], device: torch.device) -> _Layout:
        ids: list[int] = []
        positions: list[int] = []
        cache_slots: list[int] = []
        cache_rows: list[int] = []
        offsets: list[int] = []
        for item in items:
            start, n = item.state.length, len(item.token_ids)
            offsets.append(len(ids))
            ids.extend(item.token_ids)
            cache_slots.extend(range(start, start + n))
            positions.extend(range(start, start + n - 1) if item.alternative
                             else range(start, start + n))
            if item.alternative:
                positions.append(start + 1)
            cache_rows.extend([item.state.row] * n)
        overhead = _BLOCK_OVERHEAD if device.type == "cpu" else _GPU_BLOCK_OVERHEAD
        groups = [_Group.build(items, members, offsets, device)
                  for members in attention_blocks(items, overhead)]

        def as_tensor(values: list[int]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.long, device=device)

        return cls(ids=as_tensor(ids), positions=as_tensor(positions),
                   cache_slots=as_tensor(cache_slots),
                   cache_rows=as_tensor(cache_rows), offsets=offsets, groups=groups)


def attention_blocks(items: Sequence[BatchItem], overhead: int = _BLOCK_OVERHEAD
                     ) -> list[list[int]]:
    """How a pass's additions (indexes into ``items``) are split into padded attention
    blocks. A block pads every cache row in its range to its widest addition, and
    attention reads each row's keys and values once per query, so one stream verifying
    8 drafts among 7 one-token streams would make all 8 rows attend with 9 queries.
    Short additions (decoding rounds): of three layouts (one block; one-token rows apart
    from the rest; each longer addition alone) the cheapest by ``_block_cost`` is used
    (the first on ties). Long ones (prompt chunks): each alone, or all in one block when
    that is cheaper (several prompts joining at once, where calls cost more than padding)."""
    short = [i for i, item in enumerate(items) if len(item.token_ids) <= _GROUP_WIDTH]
    long = [i for i, item in enumerate(items) if len(item.token_ids) > _GROUP_WIDTH]
    blocks: list[list[int]] = []
    if short:
        ones = [i for i in short if len(items[i].token_ids) == 1]
        more = [i for i in short if len(items[i].token_ids) > 1]
        layouts = [[short]]
        if ones and more:
            layouts.append([ones, more])
        if len(more) > 1 or (ones and more):
            layouts.append(([ones] if ones else []) + [[i] for i in more])
        blocks += _cheapest(items, layouts, overhead)
    if long:
        blocks += _cheapest(items, [[[i] for i in long], [long]], overhead)
    return blocks


def _cheapest(items: Sequence[BatchItem], layouts: list[list[list[int]]], overhead: int
              ) -> list[list[int]]:
    return min(layouts, key=lambda blocks: sum(_block_cost(items, b, overhead) for b in blocks))


def _block_cost(items: Sequence[BatchItem], members: list[int], overhead: int) -> int:
    """(query, key) pairs a padded block computes, plus one call's overhead."""
    rows = [items[i].state.row for i in members]
    width = max(len(items[i].token_ids) for i in members)
    span = max(items[i].state.length + len(items[i].token_ids) for i in members)
    return (max(rows) + 1 - min(rows)) * width * span + overhead


def _aligned(positions: int) -> int:
    return -(-positions // _CAPACITY_ALIGN) * _CAPACITY_ALIGN


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)
