"""The target as a batched runner: many sequences' tokens in one forward pass.

``BatchedLM`` runs Llama-family models (Llama, Mistral without a sliding window,
Qwen2, Qwen3) with its own forward over the model's modules and its own weight matrices
(``runtime.matrices.weights``; quantized: ``runtime.matrices.quantized``), so that
several sequences, each adding a different number of tokens at a different position,
share one pass over the weights. At small batch a step is bound by reading the weights, so
verifying eight streams' drafts costs little more than verifying one.

The KV cache lies in blocks of positions from one pool per layer, read through each
sequence's block table; a sequence takes blocks as it grows, gives them back on a
roll-back past them, and shares a published prompt's blocks
(``runtime.runner.kv_blocks.KVBlocks``).

A forward packs every sequence's new tokens into one list for the matrix
products (a ragged batch costs its real tokens, not the longest row times the
rows). The norms, rotary embedding, attention and activation run in fused CPU
kernels (``runtime.runner.fused``), or as PyTorch ops that pad the tokens to
``[rows, width]`` for attention, where a mask lets each query see its own row's
cached keys and the new keys up to itself.

The runner composes three parts, each with one job: the KV blocks (``KVBlocks``), the
forward pass (here) and the native draft chain (``runtime.runner.chains.DraftChains``), all
over one ``Stack``. ``forward_batch`` is the batched call; ``CausalLM``'s one-sequence
calls (``prefill``, ``score``) are passes of one item.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, cast

import torch

from runtime.matrices.kquants import KQuantMatrix
from runtime.matrices.quantized import BlockMatrix, block_kernels, load_quantized
from runtime.matrices.weights import ONEDNN_ROWS, LayerWeights, Matrix, Product, head_product
from runtime.models import checkpoints, skeleton
from runtime.models.causal_model import CausalModel, decoder_layers
from runtime.models.families import needs_skeleton, supports
from runtime.native.kernels import resolve
from runtime.runner import fused, layers
from runtime.runner.attention import GroupedAttention
from runtime.runner.causal_lm import CausalLM, TransformersLM, head_subset
from runtime.runner.chains import DraftChains, Fusion
from runtime.runner.kv_blocks import BatchedState, KVBlocks
from runtime.runner.layout import Layout, check_items
from runtime.runner.memory import release_plain_weights
from runtime.runner.passes import BatchItem, DraftSteps, KVUsage, PreparedPass, TargetCapabilities
from runtime.runner.stack import Rotary, Stack

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class PassWork:
    """What ``prepare_pass`` builds of a pass before its long call."""

    layout: Layout
    inputs: torch.Tensor | None  # [T, H]: rows items gave (the others' embedded), or None
    embedded: fused.Embedded | None  # the native path's rows and rotary tables, else None


class BatchedLM(CausalLM[BatchedState]):
    """A Llama-family causal LM whose sequences can share one forward pass."""

    @property
    def capabilities(self) -> TargetCapabilities:
        # PyTorch's attention gives an alternative's row (its own key at another index of
        # the span than a one-token step has it) only to rounding, so batch invariance
        # takes none there; the native kernels read its keys in a step's order: exact
        return TargetCapabilities(batched=True, branches=(not self.batch_invariant
                                                          or self.stack.kernels is not None),
                                  features=True, draft_chain=True)

    def __init__(self, model: CausalModel, tokenizer: PreTrainedTokenizerBase,
                 name: str = "model", *,
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
        layers = decoder_layers(model)
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
        self.kv_blocks = KVBlocks(self.stack, self.device)
        self.chains = DraftChains(self.stack, self.kv_blocks, name, self.max_context,
                                  self.hidden_size)
        self.use_kernels(kernels)
        dtype_name = str(self.dtype).removeprefix("torch.")  # or int8, int4, gguf-<types>:
        self.weights_format = weights_format or (quantize if quantize != "none" else dtype_name)
        # every pass's logits bitwise a one-token step's (docs/performance.md); off: the
        # cheapest attention blocks, exact only to rounding (--no-batch-invariance)
        self.batch_invariant = True

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
            raise ValueError(f"{path} is a GGUF file: runtime.loaders.loading.load_model loads one")
        if quantize in ("none", "auto"):
            return cls.wrap(*checkpoints.pretrained(path, dtype, device), name=str(path),
                            kernels=kernels)
        return cls(*load_quantized(path, quantize, device), name=str(path), quantize=quantize,
                   kernels=kernels, int8_activations=int8_activations)

    @classmethod
    def wrap(cls, model: CausalModel, tokenizer: PreTrainedTokenizerBase, name: str,
             kernels: str = "auto") -> CausalLM:
        """Batched when the model's architecture allows, else ``TransformersLM``
        (``BatchedLM.load`` loads either)."""
        if (needs_skeleton(model.config) and not isinstance(model, skeleton.Skeleton)
                and skeleton.unbuildable(model.config) is None):
            model = skeleton.rebuilt(cast("PreTrainedModel", model), name)  # transformers'
        reason = supports(model)
        if reason is not None:
            log.warning("%s runs one sequence per forward pass: %s", name, reason)
            return TransformersLM(model, tokenizer, name=name)
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
        self.chains.forget()
        self.capture_layers(stack.captured)

    def capture_layers(self, layers: Sequence[int]) -> None:
        """Give, beside the final hidden states, the outputs of ``layers`` (the residual
        stream after each, EAGLE-3's low, middle and high features) for every item that
        asks for features (``PreparedPass.layers``); ``()``: none. The native kernels
        only; the logits stay bitwise the same."""
        stack = self.stack
        stack.captured = tuple(sorted({int(i) for i in layers}))
        stack.segments = None
        self.chains.forget()
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

    def adopt_alternative(self, state: BatchedState, start: int, n: int) -> None:
        self.kv_blocks.adopt_alternative(state, start, n)

    @property
    def rows_in_use(self) -> int:
        """Sequences not yet released."""
        return self.kv_blocks.states

    def new_state(self) -> BatchedState:
        return self.kv_blocks.new_state()

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

    def set_kv_budget(self, max_bytes: int | None) -> None:
        super().set_kv_budget(max_bytes)
        self.kv_blocks.limit = self._kv_limit

    def kv_usage(self) -> KVUsage:
        return self.kv_blocks.usage()

    def kv_needed(self, state: BatchedState, positions: int) -> int:
        return self.kv_blocks.needed(state, positions)

    def share_prefix(self, state: BatchedState, token_ids: Sequence[int]) -> int:
        return self.kv_blocks.share(state, token_ids)

    def publish_prefix(self, state: BatchedState, token_ids: Sequence[int]) -> None:
        self.kv_blocks.publish(state, token_ids)

    def release(self, state: BatchedState) -> None:
        self.kv_blocks.release(state)

    def rollback(self, state: BatchedState, length: int) -> None:
        self.kv_blocks.rollback(state, length)

    def load_kv(self, state: BatchedState,
                kv: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> None:
        self.kv_blocks.load_kv(state, kv)

    def kv(self, state: BatchedState) -> list[tuple[torch.Tensor, torch.Tensor]]:
        return self.kv_blocks.kv(state)

    # -- forward passes -----------------------------------------------------------------

    @torch.inference_mode()
    def prepare_pass(self, items: Sequence[BatchItem[BatchedState]]
                     ) -> PreparedPass[BatchedState]:
        """A pass checked and made ready up to its long call: the layout and, on the
        native kernels, the embedded tokens and their rotary tables. Between this and
        ``run_pass`` the caller may let other Python threads run (the engine hands its
        events over): the pass itself then releases the GIL for milliseconds."""
        if not items:
            return PreparedPass(items)
        check_items(items, self.max_context, self.hidden_size)
        for item in items:
            self.kv_blocks.reserve(item.state, item.state.length + len(item.token_ids))
        native = self.stack.kernels is not None
        batch = Layout.build(items, self.device, self.batch_invariant, native=native)
        inputs = batch.inputs(items, self.model.model.embed_tokens, self.dtype)
        return PreparedPass(items, PassWork(batch, inputs, fused.embed(self.stack, batch, inputs)
                                                     if native else None))

    @torch.inference_mode()
    def run_pass(self, prepared: PreparedPass[BatchedState]) -> list[torch.Tensor]:
        """Run a prepared pass: each item's kept logits; every sequence's cache grows by
        its tokens."""
        items = prepared.items
        if not items:
            return []
        work = prepared.work
        if not isinstance(work, PassWork):
            raise ValueError(f"{self.name}: a pass this runner did not prepare")
        batch, inputs, embedded = work.layout, work.inputs, work.embedded
        native = embedded is not None
        # [T, H]: every real token, packed (normed by the final norm when native)
        captured: list[torch.Tensor] = []
        capture = self.stack.captured if any(item.features for item in items) else ()
        hidden = (fused.forward(self.stack, batch, embedded, capture, captured)
                  if embedded is not None else layers.forward(self.stack, batch, inputs))
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

    def chain(self, vocab: int, fusion: Fusion | None = None) -> fused.DraftChain | None:
        """The native draft chain from the first ``vocab`` tokens (``DraftChains.chain``),
        or None where it cannot run."""
        return self.chains.chain(vocab, fusion)

    def draft_chain(self, states: Sequence[BatchedState], feeds: Sequence[Sequence[int]],
                    steps: Sequence[int], vocab: int,
                    carried: Sequence[torch.Tensor] | None = None,
                    fusion: Fusion | None = None) -> list[DraftSteps]:
        """Greedy drafting in one native call (``DraftChains.draft``)."""
        return self.chains.draft(states, feeds, steps, vocab, self.batch_invariant, carried,
                                 fusion)
