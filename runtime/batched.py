"""The target as a batched runner: many sequences' tokens in one forward pass.

``BatchedLM`` runs Llama-family models (Llama, Mistral without a sliding window,
Qwen2, Qwen3) with its own forward over the model's modules and its own weight matrices
(``runtime.weights``; quantized: ``runtime.quantized``), so that several sequences,
each adding a different number of tokens at a different position, share one pass
over the weights. At small batch a step is bound by reading the weights, so
verifying eight streams' drafts costs little more than verifying one.

The KV cache is preallocated: one tensor per layer for keys and one for values,
``[rows, kv_heads, capacity, head_dim]``, where every sequence owns a row and a
length. Rolling a sequence back is setting its length; nothing is copied or
freed per round. Capacity and rows grow by doubling when needed; released rows
are refilled from the end (the rows in use stay dense); the buffers shrink back
when the last sequence leaves.

A forward packs every sequence's new tokens into one list for the matrix
products (a ragged batch costs its real tokens, not the longest row times the
rows). The norms, rotary embedding, attention and activation run in fused CPU
kernels (``runtime.fused``), or as PyTorch ops that pad the tokens to
``[rows, width]`` for attention, where a mask lets each query see its own row's
cached keys and the new keys up to itself.

For one sequence it offers ``CausalLM``'s calls (``new_state``, ``prefill``, ``score``,
``rollback``, ``load_kv``, ``kv``); ``forward_batch`` is the batched call.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from runtime import fused, layers, skeleton
from runtime.attention import GroupedAttention
from runtime.causal_lm import CausalLM, head_subset
from runtime.families import needs_skeleton, supports
from runtime.kernels import resolve
from runtime.kquants import KQuantMatrix
from runtime.layout import SPAN_ALIGN, Layout, check_items
from runtime.memory import release_plain_weights
from runtime.passes import BatchItem, DraftSteps, PreparedPass, TargetCapabilities
from runtime.quantized import BlockMatrix, block_kernels, load_quantized
from runtime.stack import Rotary, Stack
from runtime.weights import ONEDNN_ROWS, LayerWeights, Matrix, Product, head_product

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

log = logging.getLogger(__name__)

_INITIAL_CAPACITY = SPAN_ALIGN
_INITIAL_ROWS = 1  # grown as requests are admitted (Engine._fit_kv)
_CAPACITY_ALIGN = SPAN_ALIGN  # an attention span never passes the capacity


@dataclass(eq=False)
class BatchedState:
    """One sequence: its row in the KV buffers and how many positions it holds."""

    row: int
    length: int = 0
    released: bool = False


class BatchedLM(CausalLM):
    """A Llama-family causal LM whose sequences can share one forward pass."""

    @property
    def capabilities(self) -> TargetCapabilities:  # type: ignore[override]
        # PyTorch's attention gives an alternative's row (its own key at another index of
        # the span than a one-token step has it) only to rounding, so batch invariance
        # takes none there; the native kernels read its keys in a step's order: exact
        return TargetCapabilities(batched=True, branches=(not self.batch_invariant
                                                          or self.stack.kernels is not None),
                                  features=True, draft_chain=True)

    def __init__(self, model: Any, tokenizer: PreTrainedTokenizerBase, name: str = "model", *,
                 quantize: str = "none", weights: Sequence[LayerWeights] | None = None,
                 head: Product | None = None, weights_format: str | None = None,
                 kernels: str = "auto", int8_activations: bool = True) -> None:
        """``quantize`` (int4, int8) quantizes the matrices at load; or ``weights`` and
        ``head`` come ready-made (a GGUF file's; the model's own linears unused).
        ``kernels``: see ``use_kernels``; ``int8_activations``: int4 matrices quantized
        here run the native kernels' block products (``quantized.BlockMatrix``) where
        those run."""
        super().__init__(model, tokenizer, name)
        reason = supports(model)
        if reason is not None:
            raise ValueError(f"{name}: cannot run batched: {reason}")
        if quantize != "none" and self.device.type != "cpu":  # the kernels are CPU ones
            raise ValueError(f"{name}: --quantize {quantize} runs on a CPU only")
        layers = list(model.model.layers)
        self.scaling = float(layers[0].self_attn.scaling)
        blocks = None
        if weights is None and quantize == "int4":
            blocks = block_kernels(resolve(kernels, self.device), int8_activations)
        # the modules, matrices, KV buffers and kernels the layer paths read: held there
        self.stack = Stack(
            model=model, layers=layers,
            weights=list(weights or [LayerWeights.of(x, quantize, blocks) for x in layers]),
            head=head if head is not None else head_product(model, quantize, blocks),
            head_ids=head_subset(model),  # [K]: a head over part of the vocabulary
            rotary=Rotary(model.model.rotary_emb),  # cos/sin for the kernels
            attention=GroupedAttention(  # see GroupedAttention.folds
                self.heads, self.kv_heads, self.head_dim, self.scaling,
                fold_single=self.device.type != "cpu" or self.dtype != torch.float32),
            heads=self.heads, kv_heads=self.kv_heads, head_dim=self.head_dim,
            scaling=self.scaling, dtype=self.dtype)
        # DraftChain by the vocabulary it drafts from and the input fusion it runs
        self._chains: dict[tuple[int, int], fused.DraftChain | None] = {}
        self.use_kernels(kernels)
        dtype_name = str(self.dtype).removeprefix("torch.")  # or int8, int4, gguf-<types>:
        self.weights_format = weights_format or (quantize if quantize != "none" else dtype_name)
        # every pass's logits bitwise a one-token step's (docs/performance.md); off: the
        # cheapest attention blocks, exact only to rounding (--no-batch-invariance)
        self.batch_invariant = True
        self._rows: list[BatchedState | None] = []
        self._capacity = 0
        self._allocate(_INITIAL_ROWS, _INITIAL_CAPACITY)

    @classmethod
    def load(cls, path: str, dtype: str = "float32", device: str = "cpu",
             quantize: str = "auto", kernels: str = "auto",
             int8_activations: bool = True) -> CausalLM:
        """A model directory in ``dtype`` or quantized (int4, int8) (``loading.load_model``
        also loads a GGUF file);
        ``kernels``: ``use_kernels``; ``int8_activations``: 4-bit (and a GGUF's 8-bit)
        matrices multiply int8-quantized activations where the native kernels can
        (``quantized.BlockMatrix``)."""
        if str(path).endswith(".gguf"):
            raise ValueError(f"{path} is a GGUF file: runtime.loading.load_model loads one")
        if quantize in ("none", "auto"):
            return cls.wrap(*skeleton.pretrained(path, dtype, device), name=str(path),
                            kernels=kernels)
        return cls(*load_quantized(path, quantize, device), name=str(path), quantize=quantize,
                   kernels=kernels, int8_activations=int8_activations)

    @classmethod
    def wrap(cls, model: Any, tokenizer: PreTrainedTokenizerBase, name: str,
             kernels: str = "auto") -> CausalLM:
        """Batched when the model's architecture allows, else a plain ``CausalLM``
        (``BatchedLM.load`` loads either)."""
        if (needs_skeleton(model.config) and not isinstance(model, skeleton.Skeleton)
                and skeleton.unbuildable(model.config) is None):
            model = skeleton.rebuilt(model, name)
        reason = supports(model)
        if reason is not None:
            log.warning("%s runs one sequence per forward pass: %s", name, reason)
            return CausalLM(model, tokenizer, name=name)
        return cls(model, tokenizer, name=name, kernels=kernels)

    @property
    def product_activations(self) -> str:
        """What the matrix products multiply: ``int8`` (block and K-quant matrices,
        activations quantized per block of 32) or the activations' dtype."""
        if any(isinstance(p, BlockMatrix | KQuantMatrix) for p in self._products()):
            return "int8"
        return str(self.dtype).removeprefix("torch.")

    def _products(self) -> list[Product]:
        """Every matrix a pass multiplies by (the parts of a ``Stacked`` one), the head's
        last."""
        mats = [m for w in self.stack.weights for m in (w.qkv, w.o, w.gate_up, w.down)]
        return [p for m in [*mats, self.stack.head] for p in getattr(m, "parts", [m])]

    @property
    def kernels(self) -> str:
        """What runs a pass's elementwise work and attention: ``native`` or ``torch``."""
        return "native" if self.stack.kernels is not None else "torch"

    def release_plain_weights(self) -> int:
        """Keep only what the products read (``memory.release_plain_weights``)."""
        return release_plain_weights(self.stack)

    def use_kernels(self, choice: str) -> None:
        """``native`` (the fused CPU kernels; raises where they cannot run), ``torch``,
        or ``auto`` (native where they build). Either is batch invariant on its own, but
        their logits differ in the last bits: choose before any sequence runs."""
        stack = self.stack
        stack.kernels = fused.load(self.model, choice, self.name, self.device)
        # the products run natively wherever the kernels build, whatever the layers
        products = stack.kernels
        if products is None and choice != "torch":
            products = resolve(choice, self.device)
        for m in self._products():
            if isinstance(m, Matrix):
                m.use_native(products)
        if stack.kernels is not None and not stack.norms:
            stack.norms = fused.norm_weights(self.model, self.dtype)
        stack.layer_stack = (fused.layer_stack(stack.kernels, stack.norms, stack)
                             if stack.kernels is not None else None)
        self._chains = {}
        self.capture_layers(stack.captured)

    def capture_layers(self, layers: Sequence[int]) -> None:
        """Give, beside the final hidden states, the outputs of ``layers`` (the residual
        stream after each, EAGLE-3's low, middle and high features) for every item that
        asks for features (``PreparedPass.layers``); ``()``: none. The native kernels
        only; the logits stay bitwise the same."""
        stack = self.stack
        stack.captured = tuple(sorted({int(i) for i in layers}))
        stack.segments = None
        self._chains = {}
        if not stack.captured:
            return
        if stack.kernels is None:
            raise ValueError(f"{self.name}: captured layers need the native kernels")
        stack.segments = fused.layer_segments(stack.kernels, stack.norms, stack,
                                              stack.captured)

    @property
    def captured_layers(self) -> tuple[int, ...]:
        return self.stack.captured

    # -- sequences --------------------------------------------------------------------

    @torch.inference_mode()
    def adopt_alternative(self, state: Any, start: int, n: int) -> None:
        for buffer in (*self.stack.keys, *self.stack.values):
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
        """Run a pass of every token count a packed product runs (``ONEDNN_ROWS``): oneDNN
        builds a primitive per shape on first use, which would otherwise cost time and
        memory while serving."""
        state = self.new_state()
        try:
            for tokens in ONEDNN_ROWS:
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
            for buffer in (*self.stack.keys, *self.stack.values):
                buffer[hole, :, :n].copy_(buffer[last, :, :n])
            self._rows[last] = None
            self._rows[hole] = moved
            moved.row = hole
        if last == 0 and (self._capacity > _INITIAL_CAPACITY or len(self._rows) > _INITIAL_ROWS):
            self.stack.keys, self.stack.values, self._rows = [], [], []  # idle: give it back
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
            self.stack.keys[layer][state.row, :, :n].copy_(keys[0])
            self.stack.values[layer][state.row, :, :n].copy_(values[0])
        state.length = n

    def kv(self, state: Any) -> list[tuple[torch.Tensor, torch.Tensor]]:
        n, row = state.length, state.row
        return [(k[row : row + 1, :, :n], v[row : row + 1, :, :n])
                for k, v in zip(self.stack.keys, self.stack.values, strict=True)]

    # -- forward passes -----------------------------------------------------------------

    @torch.inference_mode()
    def prefill(self, state: Any, token_ids: Sequence[int]) -> torch.Tensor:
        return self.forward_batch([BatchItem(state, token_ids, 1)])[0][0]

    @torch.inference_mode()
    def score(self, state: Any, token_ids: Sequence[int]) -> torch.Tensor:
        return self.forward_batch([BatchItem(state, token_ids, len(token_ids))])[0]

    def forward_batch(self, items: Sequence[BatchItem]) -> list[torch.Tensor]:
        """One forward pass over every item's new tokens; the kept logits of each,
        ``[keep, vocab]``, in the order given. Every sequence's cache grows by its
        tokens."""
        return self.run_pass(self.prepare_pass(items))

    @torch.inference_mode()
    def prepare_pass(self, items: Sequence[BatchItem]) -> PreparedPass:
        """A pass checked and made ready up to its long call: the layout and, on the
        native kernels, the embedded tokens and their rotary tables. Between this and
        ``run_pass`` the caller may let other Python threads run (the engine hands its
        events over): the pass itself then releases the GIL for milliseconds."""
        if not items:
            return PreparedPass(items)
        check_items(items, self.max_context, self.hidden_size)
        self._ensure_capacity(max(item.state.length + len(item.token_ids) for item in items))
        native = self.stack.kernels is not None
        batch = Layout.build(items, self.device, self.batch_invariant, native=native)
        inputs = batch.inputs(items, self.model.model.embed_tokens, self.dtype)
        return PreparedPass(items, (batch, inputs, fused.embed(self.stack, batch, inputs)
                                    if native else None))

    @torch.inference_mode()
    def run_pass(self, prepared: PreparedPass) -> list[torch.Tensor]:
        """Run a prepared pass: each item's kept logits; every sequence's cache grows by
        its tokens."""
        items = prepared.items
        if not items:
            return []
        batch, inputs, embedded = prepared.work
        native = embedded is not None
        # [T, H]: every real token, packed (normed by the final norm when native)
        captured: list[torch.Tensor] = []
        capture = self.stack.captured if any(item.features for item in items) else ()
        hidden = (fused.forward(self.stack, batch, embedded, capture, captured)
                  if native else layers.forward(self.stack, batch, inputs))
        prepared.features = [
            None if not item.features else (  # copies: the native loop reuses its buffer
                hidden[start : start + len(item.token_ids)].clone() if native
                else self.stack.inner.norm(hidden[start : start + len(item.token_ids)]))
            for start, item in zip(batch.offsets, items, strict=True)]
        if capture:
            joined = torch.cat(captured, dim=1)  # [T, layers * H]
            prepared.layers = [None if not item.features
                               else joined[start : start + len(item.token_ids)]
                               for start, item in zip(batch.offsets, items, strict=True)]

        kept = [i for i, item in zip(batch.offsets, items, strict=True)
                for i in range(i + len(item.token_ids) - min(item.keep, len(item.token_ids)),
                               i + len(item.token_ids))]
        if not kept:
            logits = hidden.new_empty((0, self.vocab_size))  # [K, V]
        else:
            # every token's, in order (a plain step): no gather
            kept_hidden = hidden if kept == list(range(hidden.shape[0])) else hidden[kept]
            logits = self._logits(kept_hidden if native
                                  else self.stack.inner.norm(kept_hidden))
        outputs: list[torch.Tensor] = []
        offset = 0
        for item in items:
            keep = min(item.keep, len(item.token_ids))
            outputs.append(logits[offset : offset + keep])
            offset += keep
            item.state.length += len(item.token_ids)
        return outputs

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [K, H] -> [K, vocab]
        rows = self.stack.head(hidden)
        head_ids = self.stack.head_ids
        if head_ids is None:
            return rows
        # tokens outside the head's set get the lowest finite logit: never proposed
        full = rows.new_full((rows.shape[0], self.vocab_size), torch.finfo(rows.dtype).min)
        full[:, head_ids] = rows
        return full

    # -- a draft's greedy steps in one call ----------------------------------------------

    def chain(self, vocab: int, fusion: tuple[Product, int] | None = None
              ) -> fused.DraftChain | None:
        """The native ``DraftChain`` over this model (``fused.draft_chain``; tokens from
        ``vocab`` on never drafted; with ``fusion``, each step's rows that product of
        [embedding | carried state]), or None where it cannot run."""
        if self.stack.kernels is None:
            return None
        key = (vocab, 0 if fusion is None else id(fusion[0]))
        if key not in self._chains:
            self._chains[key] = fused.draft_chain(self.stack.kernels, self.stack, vocab,
                                                  fusion)
        return self._chains[key]

    @torch.inference_mode()
    def draft_chain(self, states: Sequence[BatchedState], feeds: Sequence[Sequence[int]],
                    steps: Sequence[int], vocab: int,
                    carried: Sequence[torch.Tensor] | None = None,
                    fusion: tuple[Product, int] | None = None) -> list[DraftSteps]:
        """Greedy drafting in one native call: each sequence's ``feeds`` appended to its
        cache, then ``steps`` tokens each the first of the largest logits after the one
        before (every token but the last fed back). Bitwise the tokens of the same steps
        through ``forward_batch`` and an argmax over the first ``vocab`` logits; each
        cache grows by its feed and its steps less one. With ``fusion``, a feed's rows
        are the fusion of its tokens' embeddings beside ``carried`` (``[len(feed), H]``
        a sequence, in the model's dtype), and a drafted token's beside the state the
        step before left (``DraftSteps.state``): a feature head's inputs."""
        chain = self.chain(vocab, fusion)
        if chain is None:
            raise ValueError(f"{self.name}: no native draft chain here")
        if any(k < 1 for k in steps):
            raise ValueError("every sequence drafts at least one token")
        if (carried is None) != (fusion is None):
            raise ValueError("carried states go with an input fusion, and only with one")
        # the checks of a pass holding the feeds and every token the steps feed back
        check_items([BatchItem(s, [*f, *[0] * (k - 1)], 1)
                     for s, f, k in zip(states, feeds, steps, strict=True)],
                    self.max_context, self.hidden_size)
        if carried is not None and any(
                tuple(c.shape) != (len(f), self.hidden_size) or c.dtype != self.dtype
                for c, f in zip(carried, feeds, strict=True)):
            raise ValueError(f"carried states are [len(feed), {self.hidden_size}] in "
                             f"{self.dtype}")
        items = [BatchItem(s, f, 1) for s, f in zip(states, feeds, strict=True)]
        reach = max(s.length + len(f) + k - 1 for s, f, k in zip(states, feeds, steps,
                                                                  strict=True))
        self._ensure_capacity(reach)
        batch = Layout.build(items, self.device, self.batch_invariant, native=True)
        rows = None
        if carried is not None:  # in the pass's order of tokens
            order = sorted(range(len(items)), key=lambda i: batch.offsets[i])
            rows = torch.cat([carried[i] for i in order]).contiguous()
        tables = self.stack.rotary.tables(reach, self.stack.keys[0])
        assert tables is not None  # (a chain is built only for tables of positions)
        last = torch.tensor([o + len(f) - 1 for o, f in zip(batch.offsets, feeds, strict=True)])
        tokens, sure, second, second_sure, hidden = chain.run(
            batch.ids, batch.positions, batch.cache_rows, batch.cache_slots, batch.limits,
            batch.extras, last, torch.tensor(list(steps)), *tables, self.stack.keys,
            self.stack.values, rows)
        out = []
        for i, (state, feed, k) in enumerate(zip(states, feeds, steps, strict=True)):
            state.length += len(feed) + k - 1
            out.append(DraftSteps(tuple(tokens[i, :k].tolist()), tuple(sure[i, :k].tolist()),
                                  (int(second[i]), float(second_sure[i])),
                                  hidden[i].clone() if fusion is not None else None))
        return out

    # -- buffers ------------------------------------------------------------------------

    def _ensure_capacity(self, needed: int) -> None:
        if needed > self._capacity:
            self._allocate(len(self._rows), _aligned(max(needed, 2 * self._capacity)))

    @torch.inference_mode()
    def _allocate(self, rows: int, capacity: int) -> None:
        shape = (rows, self.kv_heads, capacity, self.head_dim)
        layers = self.stack.layers
        keys = [torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in layers]
        values = [torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in layers]
        used = self.rows_in_use if self._rows else 0
        longest = max((s.length for s in self._rows if s is not None), default=0)
        for old, new in zip((*self.stack.keys, *self.stack.values), (*keys, *values),
                            strict=False):
            new[:used, :, :longest].copy_(old[:used, :, :longest])
        self.stack.keys, self.stack.values = keys, values
        self._rows = (self._rows + [None] * rows)[:rows]
        self._capacity = capacity
        log.debug("KV buffers: %d rows x %d positions", rows, capacity)


def _aligned(positions: int) -> int:
    return -(-positions // _CAPACITY_ALIGN) * _CAPACITY_ALIGN

