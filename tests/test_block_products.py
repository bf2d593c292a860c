"""Block matrices (runtime.matrices.quantized.BlockMatrix): 4- and 8-bit codes with float16 scales
and minimums per block of 32 inputs, multiplied with int8 activations by the native
kernels' ``block_product`` (AVX512-VNNI, or AVX2). Each product against a reference computed here
from the same int8 activations, a token's result independent of the batch and the thread
count, the packing holding a GGUF file's own codes and scales, bad calls refused."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as GT

from runtime.files import model_store
from runtime.loaders.gguf_weights import GGUFModel, int4_rows
from runtime.loaders.loading import load_target
from runtime.matrices.quantized import BlockMatrix, Int4Matrix, quantize_int4
from runtime.native import kernels
from runtime.runner.batched import BatchedLM
from runtime.runner.passes import BatchItem
from tests.test_gguf import NAMES, dense, encode, file_weights, tiny_dir, write_gguf
from tests.test_kernels import at_level, lower_levels

__all__ = ["tiny_dir"]  # a fixture, shared


@pytest.fixture(scope="module")
def native() -> Any:
    return kernels.native()


@pytest.fixture()
def threads() -> Iterator[None]:
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def reference(m: BlockMatrix, x: torch.Tensor) -> torch.Tensor:
    """``x @ m.T`` as the kernel defines it: x quantized per block of 32 to int8
    (round(x * 127 / max|x|)), each block's code sum exact, blocks summed in float64."""
    tokens, inputs = x.shape
    blocks = inputs // 32
    xb = x.float().view(tokens, blocks, 32)
    top = xb.abs().amax(-1, keepdim=True)
    inv = torch.where(top > 0, 127.0 / top, torch.zeros_like(top))
    q = torch.round(xb * inv).clamp(-127, 127)  # [T, blocks, 32]
    d = (top / 127.0).double()  # [T, blocks, 1]
    codes = m.codes().double().view(m.out_features, blocks, 32)
    scale, low = (s.double() for s in m.scales())  # [out, blocks]
    dots = torch.einsum("tbk,obk->tob", q.double(), codes)  # exact integers
    sums = q.double().sum(-1)  # [T, blocks]
    return (dots * scale[None] * d[:, None, :, 0]
            + low[None] * (d[..., 0] * sums)[:, None, :]).sum(-1)


def _random(native: Any, bits: int, out: int, inputs: int, seed: int) -> BlockMatrix:
    g = torch.Generator().manual_seed(seed)
    if bits == 4:
        return BlockMatrix.int4(native, quantize_int4(torch.randn(out, inputs, generator=g)))
    codes = torch.randint(-127, 128, (out, inputs), generator=g, dtype=torch.int8)
    return BlockMatrix.int8(native, codes, torch.rand(out, inputs // 32, generator=g) / 50)


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("shape", [(40, 96), (53, 64), (16, 32)])  # whole and partial tiles
@pytest.mark.parametrize("tokens", [1, 3, 11])  # one, a few, more than a pass of 8
def test_a_product_is_the_int8_reference(native: Any, bits: int, shape: tuple[int, int],
                                         tokens: int) -> None:
    m = _random(native, bits, *shape, seed=bits + tokens)
    # bfloat16 values: what the products take (BlockMatrix rounds float32 activations)
    x = torch.randn(tokens, shape[1], generator=torch.Generator().manual_seed(tokens))
    x = x.bfloat16().float()
    want = reference(m, x)
    got = m(x.float())
    assert got.dtype == torch.bfloat16  # the products take and give bfloat16
    torch.testing.assert_close(got.double(), want.to(torch.bfloat16).double(), rtol=8e-3,
                               atol=1e-3 * float(want.abs().max()))
    exact = native.block_product(x, m.packed, m.out_features, bits, None)  # float32 out
    torch.testing.assert_close(exact.double(), want, rtol=1e-5, atol=1e-5 * float(want.abs().max()))
    # against the dense product of the same weights: only the activations' rounding
    dense = x.double() @ m.dequantize().double().t()
    assert (exact.double() - dense).abs().max() <= 0.02 * dense.abs().max()


def test_a_bias_is_added(native: Any) -> None:
    weight = torch.randn(24, 64)
    bias = torch.randn(24)
    m = BlockMatrix.int4(native, quantize_int4(weight), bias)
    x = torch.randn(2, 64)
    plain = BlockMatrix.int4(native, quantize_int4(weight))
    torch.testing.assert_close(m(x).float(), plain(x).float() + bias.bfloat16().float(),
                               rtol=1e-2, atol=1e-2)


def test_a_token_s_result_depends_on_nothing_else(native: Any, threads: None) -> None:
    """Bitwise: each token alone, within passes of every size, on one or two threads."""
    m = _random(native, 4, 200, 576, seed=5)
    x = torch.randn(19, 576).bfloat16()
    results = []
    for n in (1, 2):
        torch.set_num_threads(n)
        results.append(m(x))
    assert torch.equal(results[0], results[1])
    for size in (1, 2, 5, 8, 9, 16):
        for start in range(0, 19 - size + 1, size):
            assert torch.equal(m(x[start : start + size]), results[0][start : start + size])


def test_the_packing_keeps_the_codes_and_float16_scales(native: Any) -> None:
    rows = quantize_int4(torch.randn(37, 128))
    m = BlockMatrix.int4(native, rows)
    assert torch.equal(m.codes(), rows.codes)
    scale, low = m.scales()
    assert torch.equal(scale, rows.scale.half()) and torch.equal(low, rows.low.half())
    codes = torch.randint(-128, 128, (20, 64), dtype=torch.int8)
    m8 = BlockMatrix.int8(native, codes, torch.ones(20, 2))
    assert torch.equal(m8.codes().to(torch.int16) - 128, codes.to(torch.int16))
    assert torch.equal(m8.dequantize(), codes.float())


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("shape", [(40, 96), (53, 64), (16, 32)])  # whole and partial tiles
def test_rows_are_the_dequantized_rows(native: Any, bits: int, shape: tuple[int, int]) -> None:
    """``rows`` decodes only the rows asked for, in any order and with repeats: the
    rows of ``dequantize()``, and in bfloat16 those rows rounded."""
    m = _random(native, bits, *shape, seed=bits)
    whole = m.dequantize()
    ids = torch.tensor([0, shape[0] - 1, 17 % shape[0], 0, 5, shape[0] - 1])
    assert torch.equal(m.rows(ids), whole[ids])
    assert torch.equal(m.rows(ids, torch.bfloat16), whole[ids].to(torch.bfloat16))
    assert m.rows(torch.zeros(0, dtype=torch.long)).shape == (0, shape[1])
    for bad in (torch.tensor([shape[0]]), torch.tensor([-1])):
        with pytest.raises(RuntimeError, match="out of range"):
            m.rows(bad)
    with pytest.raises(RuntimeError, match="int64"):
        m.rows(ids.int())


def test_bad_calls_raise_instead_of_reading_out_of_bounds(native: Any) -> None:
    m = _random(native, 4, 40, 64, seed=1)
    x = torch.zeros(2, 64)
    with pytest.raises(RuntimeError, match="does not hold"):
        native.block_product(x, m.packed, 80, 4, None)  # more rows than packed
    with pytest.raises(RuntimeError, match="does not hold"):
        native.block_product(x, m.packed, 40, 8, None)
    with pytest.raises(RuntimeError, match="multiple of 32"):
        native.block_product(torch.zeros(2, 48), m.packed, 40, 4, None)
    with pytest.raises(RuntimeError, match="bits"):
        native.block_product(x, m.packed, 40, 5, None)
    with pytest.raises(RuntimeError, match="bias"):
        native.block_product(x, m.packed, 40, 4, torch.zeros(3))
    with pytest.raises(RuntimeError, match=r"0\.\.15"):
        native.block_pack(torch.full((16, 32), 16, dtype=torch.uint8), torch.ones(16, 1),
                          torch.zeros(16, 1), 4)
    with pytest.raises(RuntimeError, match="multiple of 32"):
        native.block_pack(torch.zeros(16, 40, dtype=torch.uint8), torch.ones(16, 1),
                          torch.zeros(16, 1), 4)
    with pytest.raises(RuntimeError, match="contiguous"):
        native.block_product(torch.zeros(64), m.packed, 40, 4, None)


@pytest.mark.parametrize("kind", [GT.Q4_0, GT.Q4_1, GT.Q4_K])
def test_gguf_4_bit_blocks_keep_the_files_weights(native: Any, kind: GT) -> None:
    """gguf's own dequantization, from the packing: exact for Q4_0/Q4_1 (their scales
    are float16 in the file); Q4_K's scale products round once to float16."""
    weight = np.random.default_rng(1).normal(0, 0.1, (192, 512)).astype(np.float32)
    data = encode(weight, kind, seed=3)
    want = torch.from_numpy(gguf.quants.dequantize(data, kind).copy())
    m = BlockMatrix.int4(native, int4_rows(kind.name, data, 512))
    error = (m.dequantize() - want).abs().max() / want.abs().max()
    assert error <= (0 if kind != GT.Q4_K else 2 ** -10), error


def test_the_default_model_s_file_is_served_as_is(native: Any,
                                                 default_model_dir: Path) -> None:
    """The real default GGUF: every matrix and the head (Q8_0) is a block matrix whose
    weights are gguf's own dequantization, exactly; without int8 activations it is
    PyTorch's int4 format again."""
    path = model_store.default_gguf()
    model = GGUFModel(path)
    runner = model.runner("native")
    assert runner.product_activations == "int8" and runner.stack.layer_stack is not None
    reader = {t.name: t for t in gguf.GGUFReader(str(path)).tensors}
    for name, product in (("blk.3.ffn_down.weight", runner.stack.weights[3].down),
                          ("token_embd.weight", runner.stack.head)):
        assert isinstance(product, BlockMatrix)
        tensor = reader[name]
        want = gguf.quants.dequantize(np.asarray(tensor.data), tensor.tensor_type)
        assert torch.equal(product.dequantize(), torch.from_numpy(want.copy()))
    plain = GGUFModel(path).runner("native", int8_activations=False)
    assert plain.product_activations == "bfloat16"
    assert isinstance(plain.stack.weights[0].down, Int4Matrix)


def test_a_tied_embedding_is_read_from_the_head_s_blocks(native: Any,
                                                         default_model_dir: Path) -> None:
    """The default GGUF's input embedding is its Q8_0 head's blocks, looked up row by
    row: bitwise the bfloat16 table it stood for, which is never built (54 MB), and the
    shipped draft shares it."""
    from runtime.matrices.quantized import BlockEmbedding
    from wiring.drafts import load_drafter

    path = model_store.default_gguf()
    model = GGUFModel(path)
    runner = model.runner("native")
    embed = runner.model.model.embed_tokens
    assert isinstance(embed, BlockEmbedding) and embed.matrix is runner.stack.head
    assert not any(p.numel() for p in runner.model.model.parameters()
                   if p.dim() == 2 and p.shape[0] == embed.num_embeddings)
    assert (runner.device, runner.dtype) == (torch.device("cpu"), torch.bfloat16)
    table = model.wide("token_embd.weight")
    ids = torch.cat([torch.arange(16), torch.randint(0, table.shape[0], (2001,)),
                     torch.tensor([table.shape[0] - 1])])
    assert torch.equal(embed(ids), table[ids])
    assert torch.equal(embed(ids.view(2, -1)), table[ids].view(2, -1, table.shape[1]))
    drafter = load_drafter("default-draft", runner)
    assert drafter.model.model.model.embed_tokens is embed  # type: ignore[attr-defined]


def test_quantize_int4_runs_block_matrices(native: Any, tiny_target_dir: Path) -> None:
    runner = load_target(str(tiny_target_dir), "bfloat16", quantize="int4")
    assert isinstance(runner, BatchedLM) and runner.product_activations == "int8"
    assert isinstance(runner.stack.weights[0].qkv, BlockMatrix)
    assert isinstance(runner.stack.head, BlockMatrix)
    torch_path = load_target(str(tiny_target_dir), "bfloat16", quantize="int4", kernels="torch")
    assert isinstance(torch_path, BatchedLM) and torch_path.product_activations == "bfloat16"
    assert isinstance(torch_path.stack.weights[0].qkv, Int4Matrix)


@pytest.mark.parametrize("kinds", [
    {}, {part: GT.Q8_0 for part in NAMES.values()},
    {"attn_q": GT.Q4_K, "attn_k": GT.Q4_K, "attn_v": GT.Q6_K, "attn_output": GT.Q4_K,
     "ffn_gate": GT.Q4_K, "ffn_up": GT.Q4_K, "ffn_down": GT.Q6_K, "embed": GT.Q6_K},
    {"attn_q": GT.Q5_0, "attn_k": GT.Q5_0, "attn_v": GT.Q8_0, "ffn_down": GT.Q5_0,
     "embed": GT.Q5_0},
], ids=["q4_1", "q8_0", "q4_k_m", "q5_0"])
def test_a_gguf_target_runs_its_blocks_with_int8_activations(
        native: Any, tmp_path: Path, tiny_dir: Path, kinds: dict[str, GT]) -> None:
    """Its 4-bit, Q8_0, Q5_0 and K-quant matrices multiply the file's own weights, and
    its logits follow those of the same file with bfloat16 activations."""
    path = write_gguf(tmp_path, tiny_dir, kinds)
    target = load_target(str(path), quantize="auto")
    assert isinstance(target, BatchedLM) and target.product_activations == "int8"
    want = file_weights(path)
    layer = target.stack.weights[1]
    for product, names in ((layer.qkv, ("attn_q", "attn_k", "attn_v")),
                           (layer.down, ("ffn_down",))):
        expected = torch.cat([want[f"blk.1.{n}.weight"] for n in names])
        error = (dense(product).float() - expected).abs().max() / expected.abs().max()
        wide = any(kinds.get(n) == GT.Q6_K for n in names)
        assert error <= (2 ** -7 if wide else 2 ** -10 if kinds else 0), (names, error)
    wide_target = load_target(str(path), quantize="auto", int8_activations=False)
    ids = list(range(500, 540))
    got = target.score(target.new_state(), ids).float()
    ref = wide_target.score(wide_target.new_state(), ids).float()
    agree = (got.argmax(-1) == ref.argmax(-1)).float().mean()
    centred = got - got.mean(-1, keepdim=True), ref - ref.mean(-1, keepdim=True)
    cosine = torch.nn.functional.cosine_similarity(*centred, dim=-1)
    # a random tiny model's logits are flat: near-ties flip under the activations'
    # rounding (the real model's agreement: docs/quantization.md)
    assert agree >= 0.7 and cosine.mean() >= 0.95, (agree, cosine.mean())


PASSES = (1, 2, 5, 8, 9, 16, 17)  # tokens a product takes in the cross-level checks


@pytest.mark.parametrize("level", lower_levels())
def test_every_level_computes_the_same_products(native: Any, tmp_path: Path, level: str) -> None:
    """Another level's build (VNNI's vpdpbusd, AVX2's vpmaddubsw and vpmaddwd, or a
    loop) sums the same integers and takes the same float steps per output row: bitwise
    the same products, 4- and 8-bit, for passes of 1 to 17 tokens (one to three passes
    over the matrix)."""
    scale, low = torch.rand(53, 3) / 20, -torch.rand(53, 3) / 10
    cases = {"four": (torch.randint(0, 16, (53, 96), dtype=torch.uint8), scale, low, 4),
             "eight": (torch.randint(0, 256, (40, 64), dtype=torch.uint8), torch.rand(40, 2) / 50,
                       -torch.rand(40, 2), 8)}
    inputs = {name: torch.randn(17, case[0].shape[1]).bfloat16() for name, case in cases.items()}
    torch.save({"cases": cases, "inputs": inputs}, tmp_path / "cases.pt")
    at_level(level, (
        "import torch\n"
        "from runtime.native import kernels\n"
        "from runtime.matrices.quantized import BlockMatrix\n"
        "native = kernels.native()\n"
        f"assert native.capability() == {level!r}\n"
        f"data = torch.load({str(tmp_path / 'cases.pt')!r})\n"
        "out = {}\n"
        "for name, (codes, scale, low, bits) in data['cases'].items():\n"
        "    m = BlockMatrix(native, codes, scale, low, bits)\n"
        "    x = data['inputs'][name]\n"
        f"    out[name] = [m(x[:n]) for n in {PASSES}] + [m(x[:n].float()) for n in (1, 9)]\n"
        f"torch.save(out, {str(tmp_path / 'out.pt')!r})\n"))
    other = torch.load(tmp_path / "out.pt")
    for name, (codes, scale, low, bits) in cases.items():
        m = BlockMatrix(native, codes, scale, low, bits)
        x = inputs[name]
        mine = [m(x[:n]) for n in PASSES] + [m(x[:n].float()) for n in (1, 9)]
        for index, (got, expected) in enumerate(zip(other[name], mine, strict=True)):
            assert torch.equal(got, expected), (name, index)


def test_a_gguf_of_mixed_types_runs_as_one_layer_stack(native: Any, tmp_path: Path,
                                                       tiny_dir: Path) -> None:
    """4-bit, 8-bit (Q8_0) and K-quant (Q6_K) layer matrices run in one ``LayerStack``
    call a pass: bitwise the per-layer Python loop's logits."""
    from runtime.runner import fused

    kinds = {"attn_q": GT.Q8_0, "attn_k": GT.Q8_0, "attn_v": GT.Q8_0, "ffn_down": GT.Q6_K}
    target = load_target(str(write_gguf(tmp_path, tiny_dir, kinds)), quantize="auto")
    assert isinstance(target, BatchedLM) and target.stack.layer_stack is not None
    layer = target.stack.weights[0]
    assert [fused.stack_kind(m, target.dtype)
            for m in (layer.qkv, layer.o, layer.gate_up, layer.down)] == [
        8, 4, 4, fused.KQUANT_KIND]
    ids = list(range(300, 340))

    def logits() -> torch.Tensor:
        state = target.new_state()
        try:
            out = target.score(state, ids)
            steps = [target.forward_batch([BatchItem(state, [t], 1)])[0] for t in (5, 6)]
            return torch.cat([out, *steps])
        finally:
            target.release(state)

    stacked = logits()
    stack, target.stack.layer_stack = target.stack.layer_stack, None
    try:
        assert torch.equal(logits(), stacked)
    finally:
        target.stack.layer_stack = stack
