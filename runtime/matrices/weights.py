"""The target's weight matrices, kept in the layout a CPU multiplies fastest.

On a CPU with oneDNN a matrix is packed once into oneDNN's blocked layout for products
of a few tokens (a decode step, a verify pass, a batch of streams): a plain ``[out, in]``
matrix is reordered on every call, and MKL's small products read the weights far below
the memory's speed. Which dtypes oneDNN takes is probed once, when the first matrix is
built (never at import). Figures behind these choices: docs/performance.md.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass
from types import ModuleType
from typing import Any, Protocol

import torch
from torch import nn
from torch.nn import functional as F

from runtime.matrices import dense
from runtime.models.causal_model import CausalModel, LayerModules, Weighted

# the product size oneDNN's layout is chosen for (products of 1 to 8 tokens cost about
# the same packed for 8)
PACK_TOKENS = 8
# oneDNN keeps a primitive per shape it has run: products are cut into calls of at most this
# many tokens, so its primitives (and their memory) stay bounded whatever the batch
ONEDNN_MAX_TOKENS = 32
# and a call's rows are padded with zero rows up to one of these counts: a primitive holds
# ~0.5 MB while cached, so one per row count 1-32 held ~80 MB for the default model's
# five matrix shapes; each row's result is the same at any row count (docs/performance.md,
# "Batch invariance"), and counts up to 8 (one stream's verify passes) run as they are
ONEDNN_ROWS = (1, 2, 3, 4, 5, 6, 7, 8, 10, 12, 16, 20, 24, 28, 32)
# oneDNN's reduction over more inputs than this depends on how many rows a call has (the
# 1,536-input down projection: docs/performance.md, "Batch invariance"); such a matrix is
# multiplied as slices of at most this many inputs, summed in a fixed order
ONEDNN_MAX_INPUTS = 768


class Product(Protocol):
    """A weight matrix as the forward pass uses it: ``x`` ``[T, in]`` -> ``[T, out]``
    (a ``Matrix``, or a quantized one from ``runtime.matrices.quantized``).

    Calling it computes every row on its own: a row's result does not depend on the
    other rows of the call (batch invariance). ``bulk`` is the fastest product of many
    rows (a long prompt chunk), without that promise."""

    def __call__(self, x: torch.Tensor) -> torch.Tensor: ...

    def bulk(self, x: torch.Tensor) -> torch.Tensor: ...


def multiply(m: Product, x: torch.Tensor, bulk_from: int) -> torch.Tensor:
    """``m(x)`` (``[T, in]`` -> ``[T, out]``), the rows from ``bulk_from`` on through
    ``m.bulk`` (long prompt chunks, without batch invariance: ``Layout.bulk_from``)."""
    if bulk_from >= x.shape[0]:
        return m(x)
    if bulk_from == 0:
        return m.bulk(x)
    return torch.cat((m(x[:bulk_from]), m.bulk(x[bulk_from:])))


class Matrix:
    """A weight matrix kept in the layout a CPU multiplies fastest. Where the native
    kernels run (``use_native``, a float32 or bfloat16 matrix): packed once for their
    ``dense_product``, which streams the matrix near the memory's speed for one token
    and computes each row as one chain of multiply-adds, whatever else shares the call.
    Otherwise, on a CPU with oneDNN: packed into oneDNN's blocked layout when first used.
    A plain ``[out, in]`` matrix is reordered on every call, and MKL's small products
    read the weights far below the memory's speed; packed, a product of 2-8 tokens costs
    little more than one token's. oneDNN's products run as calls of at most
    ``ONEDNN_MAX_TOKENS`` rows over input slices of at most ``ONEDNN_MAX_INPUTS``, which
    makes every row's result independent of the others' (measured as fast as one large
    product for prompt chunks), and a call's rows are padded up to a count of
    ``ONEDNN_ROWS``, which bounds the primitives oneDNN builds. Without oneDNN (a GPU):
    the default product; in float32 on a CPU ``[in, out]`` for a single token (one pass
    streams it, well faster than the usual product)."""

    def __init__(self, rows: torch.Tensor, bias: torch.Tensor | None) -> None:
        self.rows: torch.Tensor | None = rows  # [out, in], contiguous (None: released)
        self.nbytes = rows.nbytes  # what a product reads
        self.out_features = rows.shape[0]
        self.bias = bias
        self.dense: torch.Tensor | None = None  # the native kernels' packing (use_native)
        self._native: Any = None
        # oneDNN's packing is made when first needed: a runner on the native kernels
        # (use_native, right after loading) never makes it
        self._slices: list[torch.Tensor] | None = None
        self.cols: torch.Tensor | None = None
        self._cuts: list[tuple[int, int]] = []
        self._packed_yet = False

    @property
    def packed(self) -> list[torch.Tensor] | None:
        """oneDNN's packed slices (None: not on oneDNN's product)."""
        if not self._packed_yet and self.dense is None and self.rows is not None:
            self._pack(self.rows)
        return self._slices

    def _pack(self, rows: torch.Tensor) -> None:
        """oneDNN's packed slices of ``rows`` (a CPU that has it), else the single-token
        ``[in, out]`` copy where that pays."""
        self._packed_yet = True
        cpu = rows.device.type == "cpu"
        inputs = rows.shape[1]
        cuts = [(lo, min(lo + ONEDNN_MAX_INPUTS, inputs))
                for lo in range(0, inputs, ONEDNN_MAX_INPUTS)]
        slices = [pack(rows[:, lo:hi].contiguous()) for lo, hi in cuts] if cpu else []
        # oneDNN's opaque blocked copies, one per input slice
        kept = [s for s in slices if s is not None]
        self._slices = kept if kept and len(kept) == len(slices) else None
        self._cuts = cuts
        self.cols = (rows.t().contiguous()
                     if cpu and self._slices is None and rows.dtype == torch.float32 else None)

    def use_native(self, native: ModuleType | None) -> None:
        """Multiply through ``native``'s ``dense_product`` (the kernels module, on a CPU,
        in float32 or bfloat16 with an even input size), which replaces oneDNN's packed
        copy: a row's result is one chain of multiply-adds over its inputs, and one token
        streams the matrix near the memory's speed (docs/performance.md, "Dense
        products"). None: back to oneDNN's product (or PyTorch's)."""
        if native is None:
            if self.dense is not None:
                rows = self.plain()
                self.dense, self._native = None, None
                self.rows = rows
                self._pack(rows)
            return
        if self.dense is not None or self.rows is None:  # (released beside oneDNN's copy)
            return
        rows = self.rows
        if (rows.device.type != "cpu"
                or rows.dtype not in (torch.float32, torch.bfloat16)
                or (rows.dtype == torch.bfloat16 and rows.shape[1] % 2)):
            return
        self.dense, self._native = dense.pack(rows), native
        self._slices, self.cols, self._packed_yet = None, None, False

    def plain(self) -> torch.Tensor:
        """The ``[out, in]`` rows: kept, or read back from the native packing."""
        if self.rows is not None:
            return self.rows
        if self.dense is None:
            raise RuntimeError("this matrix's plain rows were released")
        return dense.unpack(self.dense, self.out_features)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.dense is not None:
            y: torch.Tensor = self._native.dense_product(x.contiguous(), self.dense,
                                                         self.out_features, self.bias)
            return y
        if self.packed is not None:
            if x.shape[0] <= ONEDNN_MAX_TOKENS:
                return self._packed(x)
            return torch.cat([self._packed(x[i : i + ONEDNN_MAX_TOKENS])
                              for i in range(0, x.shape[0], ONEDNN_MAX_TOKENS)])
        if self.cols is not None and x.shape[0] == 1:
            if self.bias is not None:
                return torch.addmm(self.bias, x, self.cols)
            return x @ self.cols
        assert self.rows is not None  # released only beside a packed copy
        return F.linear(x, self.rows, self.bias)

    def take(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows ``ids`` (``[...]``) of the matrix, ``[..., in]``: the plain rows', or read
        from the native packing (a tied head's rows, which its input embedding looks up:
        ``memory.read_embedding_from_head``)."""
        if self.rows is not None or self.dense is None:
            return self.plain()[ids]
        return dense.take(self.dense, self.out_features, ids)

    def release_rows(self) -> bool:
        """Let the plain rows go where the packed copy (oneDNN's or the native one) does
        every product; whether they went now."""
        if (self.packed is None and self.dense is None) or self.rows is None:
            return False
        self.rows = None
        return True

    def bulk(self, x: torch.Tensor) -> torch.Tensor:
        return self(x)  # the packed calls are as fast as one large product here

    @property
    def runs_native(self) -> bool:
        return self.dense is not None

    def _packed(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` (at most ``ONEDNN_MAX_TOKENS`` rows) through the packed slices, its rows
        padded up to a count of ``ONEDNN_ROWS``."""
        assert self.packed is not None
        n = x.shape[0]
        rows = padded_rows(n)
        if rows != n:
            x = torch.cat((x, x.new_zeros((rows - n, x.shape[1]))))
        if len(self.packed) == 1:
            y = onednn_linear(x, self.packed[0], self.bias)
        else:
            (lo, hi), *rest = self._cuts
            y = onednn_linear(x[:, lo:hi].contiguous(), self.packed[0], self.bias)
            for (lo, hi), part in zip(rest, self.packed[1:], strict=True):
                y = y + onednn_linear(x[:, lo:hi].contiguous(), part, None)
        return y[:n] if rows != n else y


def padded_rows(n: int) -> int:
    """The row count of ``ONEDNN_ROWS`` a call of ``n`` rows (at most
    ``ONEDNN_MAX_TOKENS``) runs as."""
    return next(r for r in ONEDNN_ROWS if r >= n)


def onednn_linear(x: torch.Tensor, packed: torch.Tensor,
                  bias: torch.Tensor | None) -> torch.Tensor:
    """oneDNN's product of ``x`` ``[T, in]`` and a packed ``[out, in]`` matrix."""
    y: torch.Tensor = torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
    return y


@functools.cache
def onednn_dtypes() -> frozenset[torch.dtype]:
    """The dtypes in which oneDNN's linear over a packed weight computes what the plain
    product does (empty where this PyTorch build has no oneDNN)."""
    op = getattr(torch.ops.mkldnn, "_linear_pointwise", None)
    reorder = getattr(torch.ops.mkldnn, "_reorder_linear_weight", None)
    if op is None or reorder is None or not torch.backends.mkldnn.is_available():
        return frozenset()
    x = torch.arange(6.0).view(2, 3)
    w = torch.arange(12.0).view(4, 3)
    dtypes = set()
    for dtype in (torch.float32, torch.bfloat16):
        try:
            got = op(x.to(dtype), reorder(w.to(dtype), PACK_TOKENS), None, "none", [], "")
        except (RuntimeError, NotImplementedError):
            continue
        if torch.equal(got.float(), x @ w.t()):
            dtypes.add(dtype)
    return frozenset(dtypes)


def pack(rows: torch.Tensor) -> torch.Tensor | None:
    """``rows`` in oneDNN's blocked layout for products of a few tokens; None where oneDNN
    is missing or does not take this dtype."""
    if rows.dtype not in onednn_dtypes():
        return None
    try:
        packed: torch.Tensor = torch.ops.mkldnn._reorder_linear_weight(rows, PACK_TOKENS)
    except (RuntimeError, NotImplementedError):
        return None
    return packed


class Stacked:
    """Matrices of different formats whose outputs are concatenated (a fused q/k/v whose
    parts a GGUF file stores in different types)."""

    def __init__(self, parts: Sequence[Product]) -> None:
        self.parts = list(parts)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:  # [T, in] -> [T, sum(out)]
        return torch.cat([part(x) for part in self.parts], dim=-1)

    def bulk(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([part.bulk(x) for part in self.parts], dim=-1)


@dataclass(frozen=True)
class LayerWeights:
    """One decoder layer's matrices, fused (q, k and v as one; gate and up as one).
    The fused ``[out, in]`` tensors become the modules' own weights (each module
    sees its rows), so only the ``[in, out]`` copies take extra memory. The norms
    and the activation are the layer's own."""

    input_norm: nn.Module
    post_norm: nn.Module
    act: nn.Module
    qkv: Product
    o: Product
    gate_up: Product
    down: Product
    qk_norms: tuple[nn.Module, nn.Module] | None = None  # each head's q and k norms (Qwen3)
    # Gemma's norms of attention's output and of the MLP's (post_norm is then the MLP's
    # input norm), or None
    out_norms: tuple[nn.Module, nn.Module] | None = None
    window: int | None = None  # a sliding-window layer's window, or None

    @classmethod
    def of(cls, layer: LayerModules, quantize: str = "none", blocks: ModuleType | None = None
           ) -> LayerWeights:
        """The layer's matrices, fused; quantized by ``quantize`` (int4, int8) unless
        ``none`` (then the modules' weights become views of the fused ones); ``blocks``:
        ``quantized``'s."""
        make = fuse if quantize == "none" else functools.partial(fuse_quantized,
                                                                 method=quantize, blocks=blocks)
        matrices: dict[str, Any] = {name: make(modules)
                                    for name, modules in linear_modules(layer).items()}
        return cls(**layer_norms(layer), **matrices)


def layer_norms(layer: LayerModules) -> dict[str, Any]:
    """A decoder layer's norms, activation and window as ``LayerWeights`` takes them."""
    attention, pre_mlp = layer.self_attn, getattr(layer, "pre_feedforward_layernorm", None)
    post_mlp = getattr(layer, "post_feedforward_layernorm", None)  # Gemma's, with pre_mlp
    common = {"input_norm": layer.input_layernorm, "act": layer.mlp.act_fn,
              "qk_norms": qk_norms(attention), "window": getattr(attention, "window", None)}
    if pre_mlp is None:
        return {**common, "post_norm": layer.post_attention_layernorm}
    return {**common, "post_norm": pre_mlp,
            "out_norms": (layer.post_attention_layernorm, post_mlp)}


def qk_norms(attention: object) -> tuple[nn.Module, nn.Module] | None:
    """An attention module's per-head q and k norms (Qwen3's), or None."""
    q, k = getattr(attention, "q_norm", None), getattr(attention, "k_norm", None)
    return (q, k) if q is not None and k is not None else None


def norm_heads(qkv: torch.Tensor, norms: tuple[nn.Module, nn.Module], heads: int, kv_heads: int,
               dim: int) -> torch.Tensor:
    """``qkv`` ``[T, (heads + 2 kv_heads) dim]`` with each head of q and of k normed by
    ``norms`` (the values as they are), contiguous."""
    q, k, v = qkv.split([heads * dim, kv_heads * dim, kv_heads * dim], dim=-1)
    q = norms[0](q.reshape(-1, heads, dim)).reshape(-1, heads * dim)
    k = norms[1](k.reshape(-1, kv_heads, dim)).reshape(-1, kv_heads * dim)
    return torch.cat((q, k, v), dim=-1)


def linear_modules(layer: LayerModules) -> dict[str, tuple[nn.Linear, ...]]:
    """A decoder layer's linear modules by the fused ``LayerWeights`` matrix they make."""
    attention, mlp = layer.self_attn, layer.mlp
    return {"qkv": (attention.q_proj, attention.k_proj, attention.v_proj),
            "o": (attention.o_proj,), "gate_up": (mlp.gate_proj, mlp.up_proj),
            "down": (mlp.down_proj,)}


def fuse(linears: Sequence[nn.Linear]) -> Matrix:
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
    return Matrix(fused, bias)


def fuse_quantized(linears: Sequence[nn.Linear], method: str, blocks: ModuleType | None = None
                   ) -> Product:
    """One quantized ``[sum(out), in]`` matrix for ``linears``; the modules' own weights
    are dropped (left on the meta device), since only the quantized copy runs."""
    from runtime.matrices.quantized import quantized

    weights = [m.weight.detach() for m in linears]
    biases = [getattr(m, "bias", None) for m in linears]
    bias = None
    if any(b is not None for b in biases):
        bias = torch.cat([b.detach() if b is not None else w.new_zeros(w.shape[0])
                          for b, w in zip(biases, weights, strict=True)])
    matrix = quantized(torch.cat(weights) if len(weights) > 1 else weights[0], bias, method,
                       blocks)
    for module in linears:
        drop_weight(module)
    return matrix


def drop_weight(module: Weighted) -> None:
    """Replace ``module``'s weight by a meta tensor of its shape (its memory is freed)."""
    module.weight = torch.nn.Parameter(module.weight.detach().to("meta"), requires_grad=False)


def head_product(model: CausalModel, quantize: str = "none", blocks: ModuleType | None = None
                 ) -> Product:
    """The output head as a matrix, quantized by ``quantize`` unless ``none`` (``blocks``:
    ``quantized``'s)."""
    head = model.get_output_embeddings()
    weight = head.weight.detach()
    bias = getattr(head, "bias", None)
    bias = bias.detach() if bias is not None else None
    if quantize == "none":
        return Matrix(weight, bias)
    from runtime.matrices.quantized import quantized

    matrix = quantized(weight, bias, quantize, blocks)
    drop_weight(head)  # a tied input embedding keeps its own reference
    return matrix
