"""K-quant matrices (runtime.matrices.kquants.KQuantMatrix): GGUF's Q4_K, Q5_K and Q6_K
super-blocks multiplied natively with int8 activations. Each product bitwise against a
model of the kernel's integer and float steps written here from gguf's own decoding of
the blocks, and near the float product of gguf's dequantization; the rows gguf's
dequantization bitwise; the packing the file's size; every level the same bits; a GGUF
file of K-quant tensors served through them."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as GT

from runtime.loaders.loading import load_target
from runtime.matrices.kquants import KQuantEmbedding, KQuantMatrix
from runtime.native import kernels
from runtime.runner import fused
from runtime.runner.batched import BatchedLM
from runtime.runner.passes import BatchItem
from tests.test_gguf import dense, file_weights, k_blocks, tiny_dir, write_gguf
from tests.test_kernels import at_level, lower_levels

__all__ = ["tiny_dir"]  # a fixture, shared

KINDS = (GT.Q4_K, GT.Q5_K, GT.Q6_K)
SIZES = {kind: gguf.GGML_QUANT_SIZES[kind][1] for kind in KINDS}
TOKENS = (1, 2, 3, 4, 5, 7, 8, 9, 12, 13, 17)  # each tile size, full passes, passes evenly filled


@pytest.fixture(scope="module")
def native() -> Any:
    return kernels.native()


def matrix(native: Any, parts: list[tuple[GT, np.ndarray]], bias: torch.Tensor | None = None
           ) -> KQuantMatrix:
    inputs = parts[0][1].shape[1] // SIZES[parts[0][0]] * 256
    return KQuantMatrix(native, [(kind.name, torch.from_numpy(rows)) for kind, rows in parts],
                        inputs, bias)


def quantized_activations(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The kernels' int8 activations, in float32 steps: codes round(x * 127 / max|x|) per
    32 inputs ``[T, blocks, 32]``, each block's scale max|x| / 127 and scale * code sum
    ``[T, blocks]``."""
    xb = x.float().view(x.shape[0], -1, 32)
    top = xb.abs().amax(-1)
    inv = torch.where(top > 0, torch.tensor(127.0) / top, torch.zeros_like(top))
    codes = torch.round(xb * inv[..., None]).clamp(-128, 127)
    scale = top / torch.tensor(127.0)
    return codes, scale, scale * codes.sum(-1)


def fma(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """float32 a * b + c rounded once (the float32 product is exact in float64)."""
    return (a.double() * b.double() + c.double()).float()


def decoded(kind: GT, rows: np.ndarray) -> dict[str, torch.Tensor]:
    """gguf's reading of each row's super-blocks: codes [out, in], float16 d (and dmin)
    [out, supers] as float32, scales (and minimums) [out, subs] as integers."""
    out = rows.shape[0]
    blocks = rows.reshape(-1, SIZES[kind])
    n = len(blocks)
    if kind == GT.Q6_K:
        d = blocks[:, 208:210].copy().view(np.float16).astype(np.float32)
        sc = blocks[:, 192:208].copy().view(np.int8).astype(np.int64)
        shifted = blocks[:, :128].reshape(n, 2, 1, 64) >> np.array([0, 4], np.uint8).reshape(
            1, 1, 2, 1)
        low = (shifted & 15).reshape(n, 2, 128)
        pairs = blocks[:, 128:192].reshape(n, 2, 1, 32) >> np.array([0, 2, 4, 6],
                                                                     np.uint8).reshape(1, 1, 4, 1)
        high = (pairs & 3).reshape(n, 2, 128)
        codes = (low | (high << 4)).reshape(n, 256)
        parts = {"d": d, "sc": sc}
    else:
        d = blocks[:, 0:2].copy().view(np.float16).astype(np.float32)
        dmin = blocks[:, 2:4].copy().view(np.float16).astype(np.float32)
        sc, m = gguf.quants.Q4_K.get_scale_min(blocks[:, 4:16].copy())
        qs = blocks[:, 16:] if kind == GT.Q4_K else blocks[:, 48:]
        low = (qs.reshape(n, 4, 1, 32) >> np.array([0, 4], np.uint8).reshape(1, 1, 2, 1)) & 15
        codes = low.reshape(n, 256).astype(np.int64)
        if kind == GT.Q5_K:
            qh = blocks[:, 16:48]  # bit j of byte e: sub-block j's input e
            fifth = (qh[:, None, :] >> np.arange(8, dtype=np.uint8)[None, :, None]) & 1
            codes = codes | (fifth.reshape(n, 256).astype(np.int64) << 4)
        parts = {"d": d, "dmin": dmin, "sc": sc.astype(np.int64), "m": m.astype(np.int64)}
    out_parts = {k: torch.from_numpy(np.ascontiguousarray(v)).reshape(out, -1)
                 for k, v in parts.items()}
    out_parts["codes"] = torch.from_numpy(np.ascontiguousarray(codes).astype(np.int64)).reshape(
        out, -1)
    return out_parts


def model(kind: GT, rows: np.ndarray, x: torch.Tensor) -> torch.Tensor:  # [T, out] float32
    """The kernel's steps, per block of 32 inputs in input order: the code x activation
    sums exact, then Q4_K/Q5_K acc = fma(dot, (d*sc) * a, acc), acc = fma(-(dmin*m),
    a*sum, acc); Q6_K t = sc0 (dot0 - 32 sum0) + sc1 (dot1 - 32 sum1), acc = fma(t, d*a,
    acc)."""
    parts = decoded(kind, rows)
    codes, scale, total = quantized_activations(x)  # [T, B, 32], [T, B], [T, B]
    q = parts["codes"].double().view(rows.shape[0], -1, 32)  # [out, B, 32]
    acc = torch.zeros(x.shape[0], rows.shape[0])
    for b in range(q.shape[1]):
        d = parts["d"][:, b // 8]  # [out]
        if kind == GT.Q6_K:
            halves = []
            for h in range(2):
                cut = slice(16 * h, 16 * h + 16)
                dots = codes[:, b, cut].double() @ q[:, b, cut].t()  # [T, out], exact
                sums = codes[:, b, cut].double().sum(-1, keepdim=True)
                halves.append((dots - 32 * sums) * parts["sc"][:, 2 * b + h].double())
            t = (halves[0] + halves[1]).float()
            acc = fma(t, d[None] * scale[:, b, None], acc)
        else:
            dots = (codes[:, b].double() @ q[:, b].t()).float()
            dsc = d * parts["sc"][:, b].float()  # exact
            dm = parts["dmin"][:, b // 8] * parts["m"][:, b].float()  # exact
            acc = fma(dots, dsc[None] * scale[:, b, None], acc)
            acc = fma(-dm[None], total[:, b, None].expand_as(acc), acc)
    return acc


def random_rows(kind: GT, out: int, inputs: int, seed: int) -> np.ndarray:
    return k_blocks(kind, out, inputs, seed)


@pytest.mark.parametrize("kind", KINDS, ids=lambda k: k.name)
@pytest.mark.parametrize("shape", [(16, 256), (37, 512), (50, 768)])  # whole, ragged tiles
def test_a_product_is_the_kernel_s_steps_bitwise(native: Any, kind: GT,
                                                 shape: tuple[int, int]) -> None:
    rows = random_rows(kind, *shape, seed=shape[0])
    m = matrix(native, [(kind, rows)])
    want_float = torch.from_numpy(gguf.quants.dequantize(rows, kind)).double()
    g = torch.Generator().manual_seed(shape[1])
    for tokens in TOKENS:
        x = torch.randn(tokens, shape[1], generator=g).bfloat16().float()
        got = native.kquant_product(x, m.packed, m.layout, None)  # float32 out
        assert torch.equal(got, model(kind, rows, x)), (kind, shape, tokens)
        # near the float product of gguf's weights: only the activations' rounding
        exact = x.double() @ want_float.t()
        assert (got.double() - exact).abs().max() <= 0.02 * exact.abs().max()
        # bfloat16 in and out, as a pass runs it
        assert torch.equal(m(x), got.bfloat16())


@pytest.mark.parametrize("kind", KINDS, ids=lambda k: k.name)
def test_rows_are_gguf_s_dequantization_and_the_bytes_the_file_s(native: Any, kind: GT) -> None:
    rows = random_rows(kind, 48, 512, seed=7)
    m = matrix(native, [(kind, rows)])
    want = torch.from_numpy(gguf.quants.dequantize(rows, kind))
    assert torch.equal(m.dequantize(), want)
    ids = torch.tensor([47, 0, 16, 5, 5])
    assert torch.equal(m.rows(ids), want[ids])
    assert torch.equal(m.rows(ids, torch.bfloat16), want[ids].bfloat16())
    assert m.nbytes == rows.nbytes  # 48 rows: whole tiles, the file's bytes exactly


def test_a_matrix_of_mixed_types_is_its_parts_side_by_side(native: Any) -> None:
    """A fused q/k/v whose parts differ in type (Qwen's Q6_K v beside Q4_K q and k), parts
    ending inside a tile, with a bias: each part's columns are that part's product."""
    parts = [(GT.Q4_K, random_rows(GT.Q4_K, 40, 512, 1)),
             (GT.Q6_K, random_rows(GT.Q6_K, 24, 512, 2)),
             (GT.Q5_K, random_rows(GT.Q5_K, 19, 512, 3))]
    bias = torch.randn(83)
    fused_matrix = matrix(native, parts, bias)
    assert fused_matrix.out_features == 83 and fused_matrix.layout.shape == (3, 3)
    x = torch.randn(9, 512).bfloat16()
    got = native.kquant_product(x.float(), fused_matrix.packed, fused_matrix.layout, None)
    alone = torch.cat([native.kquant_product(x.float(), p.packed, p.layout, None)
                       for p in (matrix(native, [part]) for part in parts)], dim=1)
    assert torch.equal(got, alone)
    assert torch.equal(fused_matrix(x), (got + bias.bfloat16().float()).bfloat16())
    want = torch.cat([torch.from_numpy(gguf.quants.dequantize(r, k)) for k, r in parts])
    assert torch.equal(fused_matrix.dequantize(), want)


def test_a_token_s_result_depends_on_nothing_else(native: Any) -> None:
    """Bitwise: each token alone, within passes of every size, on one or two threads."""
    m = matrix(native, [(GT.Q4_K, random_rows(GT.Q4_K, 200, 768, 5)),
                        (GT.Q6_K, random_rows(GT.Q6_K, 64, 768, 6))])
    x = torch.randn(19, 768).bfloat16()
    before = torch.get_num_threads()
    try:
        results = []
        for n in (1, 2):
            torch.set_num_threads(n)
            results.append(m(x))
    finally:
        torch.set_num_threads(before)
    assert torch.equal(results[0], results[1])
    for size in (1, 2, 5, 8, 9, 16):
        for start in range(0, 19 - size + 1, size):
            assert torch.equal(m(x[start : start + size]), results[0][start : start + size])


def test_a_product_of_no_tokens_is_empty(native: Any) -> None:
    """A pass with no tokens (nothing of a type's segment to multiply) returns no rows
    rather than dividing its passes by zero."""
    m = matrix(native, [(GT.Q4_K, random_rows(GT.Q4_K, 20, 256, 3)),
                        (GT.Q6_K, random_rows(GT.Q6_K, 16, 256, 4))])
    out = m(torch.zeros(0, 256, dtype=torch.bfloat16))
    assert out.shape == (0, 36) and out.dtype == torch.bfloat16


def test_bad_calls_raise_instead_of_reading_out_of_bounds(native: Any) -> None:
    m = matrix(native, [(GT.Q4_K, random_rows(GT.Q4_K, 32, 512, 0))])
    x = torch.randn(2, 512)
    with pytest.raises(RuntimeError, match="multiple of 256"):
        native.kquant_product(torch.randn(2, 300), m.packed, m.layout, None)
    with pytest.raises(RuntimeError, match="describes"):
        native.kquant_product(torch.randn(2, 256), m.packed, m.layout, None)
    short = m.packed[:-1].contiguous()
    with pytest.raises(RuntimeError, match="describes"):
        native.kquant_product(x, short, m.layout, None)
    bad = m.layout.clone()
    bad[0, 0] = 8  # Q8_0: not a K-quant
    with pytest.raises(RuntimeError, match="segment 0"):
        native.kquant_product(x, m.packed, bad, None)
    with pytest.raises(RuntimeError, match="out of range"):
        m.rows(torch.tensor([32]))
    with pytest.raises(ValueError, match="super-blocks of 256"):
        KQuantMatrix(native, [("Q4_K", torch.zeros(4, 144, dtype=torch.uint8))], 300)
    with pytest.raises(ValueError, match="not a K-quant"):
        KQuantMatrix(native, [("Q8_0", torch.zeros(4, 34 * 8, dtype=torch.uint8))], 256)


@pytest.mark.parametrize("level", lower_levels())
def test_every_level_computes_the_same_k_quant_products(native: Any, tmp_path: Path,
                                                       level: str) -> None:
    """Another level's build (VNNI's vpdpbusd, AVX2's vpmaddubsw and vpmaddwd, or a loop;
    the amx level takes the avx512_vnni products): bitwise the same products of every
    K-quant type for passes of 1 to 17 tokens, in bfloat16 and float32, and the same
    dequantized rows."""
    parts = [(k.name, torch.from_numpy(random_rows(k, rows, 768, i)))
             for i, (k, rows) in enumerate(((GT.Q4_K, 37), (GT.Q5_K, 21), (GT.Q6_K, 50)))]
    x = torch.randn(17, 768).bfloat16()
    torch.save({"parts": parts, "x": x}, tmp_path / "cases.pt")
    script = (
        "import torch\n"
        "from runtime.native import kernels\n"
        "from runtime.matrices.kquants import KQuantMatrix\n"
        "native = kernels.native()\n"
        f"assert native.capability() == {level!r}\n"
        f"data = torch.load({str(tmp_path / 'cases.pt')!r})\n"
        "out = []\n"
        "for part in data['parts']:\n"
        "    m = KQuantMatrix(native, [part], 768)\n"
        "    x = data['x']\n"
        f"    out += [m(x[:n]) for n in {TOKENS}] + [m(x[:n].float()) for n in (1, 9)]\n"
        "    out.append(m.dequantize())\n"
        f"torch.save(out, {str(tmp_path / 'out.pt')!r})\n")
    at_level(level, script)
    other = torch.load(tmp_path / "out.pt")
    mine = []
    for part in parts:
        m = KQuantMatrix(native, [part], 768)
        mine += [m(x[:n]) for n in TOKENS] + [m(x[:n].float()) for n in (1, 9)]
        mine.append(m.dequantize())
    for index, (got, expected) in enumerate(zip(other, mine, strict=True)):
        assert torch.equal(got, expected), index


Q4_K_M = {"attn_q": GT.Q4_K, "attn_k": GT.Q4_K, "attn_v": GT.Q6_K, "attn_output": GT.Q5_K,
          "ffn_gate": GT.Q4_K, "ffn_up": GT.Q4_K, "ffn_down": GT.Q6_K, "embed": GT.Q4_K}


def test_a_gguf_of_k_quants_is_served_by_them(native: Any, tmp_path: Path,
                                               tiny_dir: Path) -> None:
    """A file of Q4_K, Q5_K and Q6_K tensors (q/k Q4_K beside a Q6_K v, as Qwen's Q4_K_M
    has them, and a tied Q4_K embedding): every matrix a K-quant matrix of the file's
    bytes and gguf's dequantization, the embedding's rows the file's in bfloat16, one
    ``LayerStack`` call a pass bitwise the per-layer loop, and logits near those of the
    same file with bfloat16 activations."""
    path = write_gguf(tmp_path, tiny_dir, Q4_K_M)
    target = load_target(str(path), quantize="auto")
    assert isinstance(target, BatchedLM) and target.product_activations == "int8"
    want = file_weights(path)
    sizes = {t.name: int(t.n_bytes) for t in gguf.GGUFReader(str(path)).tensors}
    for index, layer in enumerate(target.stack.weights):
        for product, names in ((layer.qkv, ("attn_q", "attn_k", "attn_v")),
                               (layer.o, ("attn_output",)), (layer.gate_up, ("ffn_gate", "ffn_up")),
                               (layer.down, ("ffn_down",))):
            assert isinstance(product, KQuantMatrix)
            keys = [f"blk.{index}.{n}.weight" for n in names]
            assert torch.equal(product.dequantize(), torch.cat([want[k] for k in keys]))
            assert product.nbytes == sum(sizes[k] for k in keys)
            assert fused.stack_kind(product, target.dtype) == fused.KQUANT_KIND
    embed = target.model.model.embed_tokens
    assert isinstance(embed, KQuantEmbedding) and target.stack.head is embed.matrix
    ids = torch.tensor([3, 500, 49151])
    assert torch.equal(embed(ids), want["token_embd.weight"][ids].bfloat16())
    assert torch.equal(dense(target.stack.head), want["token_embd.weight"])
    assert target.stack.layer_stack is not None
    prompt = list(range(300, 340))

    def logits() -> torch.Tensor:
        state = target.new_state()
        try:
            out = target.score(state, prompt)
            steps = [target.forward_batch([BatchItem(state, [t], 1)])[0] for t in (5, 6)]
            verify = target.forward_batch([BatchItem(state, [7, 8, 9], 3)])[0]
            return torch.cat([out, *steps, verify])
        finally:
            target.release(state)

    stacked = logits()
    loop, target.stack.layer_stack = target.stack.layer_stack, None
    try:
        assert torch.equal(logits(), stacked)
    finally:
        target.stack.layer_stack = loop
    wide = load_target(str(path), quantize="auto", int8_activations=False)
    ref = wide.score(wide.new_state(), prompt).float()
    got = stacked[: len(prompt)].float()
    centred = got - got.mean(-1, keepdim=True), ref - ref.mean(-1, keepdim=True)
    cosine = torch.nn.functional.cosine_similarity(*centred, dim=-1)
    assert cosine.mean() >= 0.95, cosine.mean()
