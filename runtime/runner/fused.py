"""The batched runner's decoder layers through the fused CPU kernels
(``runtime.native.kernels``): per layer four kernel calls and the four matrix products.

Every kernel treats a token on its own and attention reads exactly the keys each token
sees, so no attention blocks, padding or masks are built (``Layout.build(native=True)``).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from types import ModuleType
from typing import Protocol, cast

import torch
from torch import nn

from runtime.matrices.kquants import KQuantMatrix
from runtime.matrices.quantized import ACTIVATIONS, BlockEmbedding, BlockMatrix, Int4Matrix
from runtime.matrices.weights import Matrix, Product, multiply, norm_heads
from runtime.models.causal_model import CausalModel, decoder_layers
from runtime.models.families import GEMMA_FAMILIES, activation
from runtime.models.skeleton import ConvertedEmbedding
from runtime.native import kernels
from runtime.runner.layout import Layout
from runtime.runner.stack import NativeLoop, Norm, Stack

KQUANT_KIND = 64  # LayerStack's kind for a K-quant matrix (csrc/kernels.h kKQuant)


def unsupported(model: CausalModel) -> str | None:
    """Why the fused kernels cannot run ``model``'s layers, or None when they can (RMS
    norms, a SiLU-gated MLP)."""
    config = model.config
    if config.model_type in GEMMA_FAMILIES:
        return "Gemma's layers norm attention's and the MLP's outputs and slide windows"
    if any(getattr(layer.self_attn, "window", None) for layer in decoder_layers(model)):
        return f"its layers attend within a sliding window of {config.sliding_window}"
    if activation(config) != "silu":
        return f"activation {activation(config)!r} is not silu"
    if not all(hasattr(m, "variance_epsilon") and hasattr(m, "weight") for m in _norms(model)):
        return "its norms are not RMS norms"
    return None


def load(model: CausalModel, choice: str, name: str, device: torch.device) -> ModuleType | None:
    """The kernels module for ``model`` on ``device`` by ``choice`` (``kernels.resolve``),
    or None."""
    reason = unsupported(model)
    if reason is None:
        return kernels.resolve(choice, device)
    kernels.check_choice(choice)
    if choice == "native":
        raise kernels.KernelsUnavailable(f"{name}: {reason}")
    return None


def _norms(model: CausalModel) -> list[nn.Module]:
    """Each layer's input and post-attention norms in order, then the final norm."""
    return [*(m for layer in decoder_layers(model)
              for m in (layer.input_layernorm, layer.post_attention_layernorm)),
            model.model.norm]


class _RMSNorm(Protocol):
    @property
    def weight(self) -> torch.Tensor: ...

    @property
    def variance_epsilon(self) -> float: ...


def norm_weights(model: CausalModel, dtype: torch.dtype) -> list[Norm]:
    """Each norm's weight in ``dtype`` and its eps; the weights are copies of their own
    (a view would keep alive whatever holds the model's parameter: the weights file's
    whole mapping, as a ``LayerStack`` holds its norms)."""
    norms = cast(list[_RMSNorm], _norms(model))  # RMS norms: ``unsupported`` checked
    return [(m.weight.detach().to(dtype, copy=True).contiguous(), float(m.variance_epsilon))
            for m in norms]


def layer_stack(native: ModuleType, norms: list[Norm], stack: Stack,
                layers: range | None = None) -> NativeLoop | None:
    """The kernels' whole-stack loop (``LayerStack``) over ``stack``'s layers (or those of
    ``layers``, with ``norms`` their own: 2 per layer and the one after) when every
    layer matrix runs natively (4- and 8-bit ``BlockMatrix``, a dense ``Matrix`` in the
    model's dtype: a GGUF's tensors, ``--quantize int4``, a bfloat16 or float32 model), or
    every one is PyTorch's packed int4 of one group size in bfloat16; else None. It makes
    the calls ``forward`` makes, in C++."""
    chosen = stack.weights if layers is None else stack.weights[layers.start:layers.stop]
    mats = [m for w in chosen for m in (w.qkv, w.o, w.gate_up, w.down)]
    if (stack.dtype not in (ACTIVATIONS, torch.float32)
            or any(w.qk_norms is not None for w in chosen)):
        return None  # (its loop has no per-head q/k norms)
    kinds = [stack_kind(m, stack.dtype) for m in mats]
    if all(kinds):  # (then every one is a BlockMatrix, a KQuantMatrix or a Matrix)
        found = [m for m in mats if isinstance(m, (BlockMatrix, KQuantMatrix, Matrix))]
        packed = [m.dense if isinstance(m, Matrix) else m.packed for m in found]
        # (a K-quant matrix's segments go where PyTorch's int4 has its scales)
        layouts = [m.layout if isinstance(m, KQuantMatrix) else p
                   for m, p in zip(found, packed, strict=True)]
        return native.LayerStack(packed, layouts, [m.out_features for m in found],
                                 [m.bias for m in found], [w for w, _ in norms],
                                 [e for _, e in norms], 32, stack.heads, stack.kv_heads,
                                 stack.scaling, kinds)
    int4 = [m for m in mats if type(m) is Int4Matrix]
    if (stack.dtype != ACTIVATIONS or len(int4) != len(mats)
            or len({m.group for m in int4}) != 1):
        return None
    return native.LayerStack([m.packed for m in int4], [m.scales_zeros for m in int4],
                             [m.out_features for m in int4], [m.bias for m in int4],
                             [w for w, _ in norms], [e for _, e in norms], int4[0].group,
                             stack.heads, stack.kv_heads, stack.scaling, [0] * len(int4))


# a norm that hands its input on unchanged: x * rsqrt(mean(x^2) + 2^100) is x * 2^-50
# exactly (mean(x^2) < 2^76 vanishes beside 2^100), and the weight 2^50 undoes it
_PASS_EPS = 2.0**100
_PASS_WEIGHT = 2.0**50


def layer_segments(native: ModuleType, norms: list[Norm], stack: Stack,
                   capture: Sequence[int]) -> list[tuple[range, NativeLoop]] | None:
    """``LayerStack``s over runs of ``stack``'s layers, cut after each layer of ``capture``:
    a run cut there ends with a pass-through norm (``_PASS_EPS``), so it returns the
    residual stream after that layer, which the next run takes as its input; the last run
    ends with the final norm, or none when the last layer is captured. None where the
    whole stack does not run natively."""
    count = len(stack.weights)
    cuts = sorted({int(i) for i in capture})
    if not cuts or cuts[0] < 0 or cuts[-1] >= count:
        raise ValueError(f"captured layers must lie in 0..{count - 1}: {list(capture)}")
    identity = (torch.full_like(norms[0][0], _PASS_WEIGHT), _PASS_EPS)
    bounds = [0, *(i + 1 for i in cuts)]
    if bounds[-1] < count:
        bounds.append(count)
    out = []
    for start, stop in itertools.pairwise(bounds):
        last = identity if stop - 1 in cuts else norms[2 * count]  # else: the final norm
        loop = layer_stack(native, [*norms[2 * start:2 * stop], last], stack,
                           range(start, stop))
        if loop is None:
            return None
        out.append((range(start, stop), loop))
    return out


def embedding_source(module: nn.Module, dtype: torch.dtype) -> tuple[torch.Tensor, int] | None:
    """What ``DraftChain`` reads an input embedding from, where a lookup of ``module`` in a
    model of ``dtype`` is a row of a table or of a block matrix, rounded once to
    ``dtype``: (the table, 0) or (the packed matrix, its bits); else None."""
    allowed = {dtype}
    if isinstance(module, ConvertedEmbedding):  # another's rows, converted to dtype
        if module.weight.dtype != dtype:
            return None
        module, allowed = module.source[0], {torch.float32, dtype}
    if isinstance(module, BlockEmbedding) and module.dtype in allowed:
        return module.matrix.packed, module.matrix.bits
    if (isinstance(module, torch.nn.Embedding) and getattr(module, "rows", None) is None
            and module.weight.dim() == 2 and module.weight.dtype in allowed):
        return module.weight.detach().contiguous(), 0  # (a table, not rows read elsewhere)
    return None


class DraftChain(Protocol):
    """The kernels' greedy draft steps over a stack (``draft_chain``): what
    ``BatchedLM.draft_chain`` calls."""

    def run(self, ids: torch.Tensor, positions: torch.Tensor, tables: torch.Tensor,
            rows: torch.Tensor, slots: torch.Tensor, limits: torch.Tensor, extras: torch.Tensor,
            last: torch.Tensor, steps: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
            keys: list[torch.Tensor], values: list[torch.Tensor],
            carried: torch.Tensor | None) -> tuple[torch.Tensor, ...]:
        """Each sequence's drafted tokens ``[B, k]``, their probabilities ``[B, k]``, the
        first step's second choice ``[B]`` and its probability ``[B]``, the state after
        the last fed token ``[B, H]``."""
        ...


def draft_chain(native: ModuleType, stack: Stack, vocab: int,
                fusion: tuple[Product, int] | None = None) -> DraftChain | None:
    """The kernels' ``DraftChain`` over ``stack``'s layers, input embedding and head
    (tokens from ``vocab`` on never drafted), where all of them run natively and the
    rotary tables depend on the position alone; else None. ``fusion`` (the product and
    its input width): each step's rows are that product of [embedding | carried state],
    as a feature head's are, where it runs natively in the model's dtype."""
    loop = stack.layer_stack
    if loop is None or stack.captured or not stack.rotary.static:
        return None
    source = embedding_source(stack.inner.embed_tokens, stack.dtype)
    head = stack.head
    kind = stack_kind(head, stack.dtype)
    if source is None or not kind or kind == KQUANT_KIND:  # (the chain's heads: no K-quant)
        return None
    assert isinstance(head, (BlockMatrix, Matrix))  # (what stack_kind takes)
    fuse: tuple[torch.Tensor | None, int, int, torch.Tensor | None] = (None, 0, 0, None)
    if fusion is not None:
        product, width = fusion
        fuse_kind = stack_kind(product, stack.dtype)
        # (a block matrix multiplies bfloat16 activations: the chain's are the model's)
        if (not fuse_kind or fuse_kind == KQUANT_KIND
                or (fuse_kind in (4, 8) and stack.dtype != torch.bfloat16)):
            return None
        assert isinstance(product, (BlockMatrix, Matrix))  # (what stack_kind takes)
        fuse = (product.packed if isinstance(product, BlockMatrix) else product.dense,
                fuse_kind, width, product.bias)
    return native.DraftChain(loop, source[0], source[1],
                             head.packed if isinstance(head, BlockMatrix) else head.dense,
                             kind, head.out_features, head.bias, stack.head_ids, vocab,
                             None, 0.0, *fuse)


def stack_kind(m: Product, dtype: torch.dtype) -> int:
    """What ``LayerStack`` takes ``m`` as in a model of ``dtype``: 4 or 8 (a block
    matrix of those bits), 64 (a K-quant matrix, in a bfloat16 model), 16 or 32 (a
    bfloat16 or float32 matrix on the native ``dense_product``, in the model's dtype), or
    0 (none of them)."""
    if type(m) is BlockMatrix:
        return m.bits
    if isinstance(m, KQuantMatrix) and dtype == torch.bfloat16:  # (bfloat16 activations)
        return KQUANT_KIND
    if isinstance(m, Matrix) and m.dense is not None and m.dense.dtype == dtype:
        return {torch.bfloat16: 16, torch.float32: 32}[dtype]
    return 0


Embedded = tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # the tokens' rows, cos, sin


def embed(stack: Stack, batch: Layout, inputs: torch.Tensor | None = None) -> Embedded:
    """What a pass computes before its layers: ``batch``'s tokens embedded ``[T, H]``
    (or the given ``inputs`` rows), and their rotary tables ``[T, D]``."""
    hidden = stack.inner.embed_tokens(batch.ids) if inputs is None else inputs
    return (hidden, *stack.rotary(hidden, batch.positions, batch.positions_end))


def forward(stack: Stack, batch: Layout, embedded: Embedded, capture: Sequence[int] = (),
            captured: list[torch.Tensor] | None = None) -> torch.Tensor:
    """The decoder layers and the final norm over ``batch``'s packed tokens, ``embedded``
    (``embed``); ``[T, H]``. ``stack``'s ``layer_stack``, where it has one, runs the same
    loop in one call (not for bulk products). ``capture``: layers whose output (the
    residual stream after the layer, ``[T, H]``) is appended to ``captured``, in order;
    ``stack.segments`` run the loop in one call per run of layers cut after them."""
    native, norms = stack.kernels, stack.norms
    if native is None:
        raise ValueError("the fused layers need the native kernels")
    hidden, cos, sin = embedded
    split, dtype = batch.bulk_from, stack.dtype
    cuts = sorted({int(i) for i in capture})
    if cuts and captured is None:
        raise ValueError("captured layers need a list to go to")
    if split >= hidden.shape[0] and cuts and stack.segments is not None:
        return _forward_segments(native, stack, batch, embedded, stack.segments, cuts,
                                 captured)
    loop = stack.layer_stack
    if loop is not None and split >= hidden.shape[0] and not cuts:  # the whole pass: one call
        return loop.forward(hidden, cos, sin, stack.keys, stack.values, batch.tables,
                            batch.cache_rows, batch.cache_slots, batch.limits, batch.extras)

    def product(m: Product, x: torch.Tensor) -> torch.Tensor:
        return multiply(m, x, split).to(dtype).contiguous()

    rows, slots = batch.cache_rows, batch.cache_slots
    hidden, x = native.add_rms_norm(hidden.contiguous(), None, *norms[0])
    for index, w in enumerate(stack.weights):
        keys, values = stack.keys[index], stack.values[index]
        qkv = product(w.qkv, x)  # [T, (h + 2 kv) D]
        if w.qk_norms is not None:
            qkv = norm_heads(qkv, w.qk_norms, stack.heads, stack.kv_heads, stack.head_dim)
        q = native.rope_store(qkv, cos, sin, keys, values, batch.tables, rows, slots,
                              stack.heads, stack.kv_heads)  # [T, h, D]
        out = native.attend(q, keys, values, batch.tables, rows, batch.limits, batch.extras,
                            stack.scaling)  # [T, h * D]
        hidden, x = native.add_rms_norm(hidden, product(w.o, out), *norms[2 * index + 1])
        gated = native.silu_mul(product(w.gate_up, x))  # [T, I]
        # the residual addition and the next layer's norm (the final norm after the last)
        hidden, x = native.add_rms_norm(hidden, product(w.down, gated), *norms[2 * index + 2])
        if index in cuts:
            assert captured is not None
            captured.append(hidden)
    return x


def _forward_segments(native: ModuleType, stack: Stack, batch: Layout, embedded: Embedded,
                      segments: list[tuple[range, NativeLoop]], cuts: list[int],
                      captured: list[torch.Tensor] | None) -> torch.Tensor:
    """``forward`` as one ``LayerStack`` call per run of layers (``layer_segments``)."""
    hidden, cos, sin = embedded
    if [r.stop - 1 for r, _ in segments if r.stop - 1 in cuts] != cuts:
        raise ValueError("the runs of layers were cut for other captured layers")
    out = hidden
    for layers, loop in segments:
        out = loop.forward(hidden, cos, sin, stack.keys[layers.start:layers.stop],
                           stack.values[layers.start:layers.stop], batch.tables,
                           batch.cache_rows,
                           batch.cache_slots, batch.limits, batch.extras)
        if layers.stop - 1 in cuts:
            assert captured is not None
            captured.append(out)
            hidden = out
    if segments[-1][0].stop - 1 in cuts:  # the last layer captured: its final norm here
        out = native.add_rms_norm(hidden.contiguous(), None, *stack.norms[-1])[1]
    return out
