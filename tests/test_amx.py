"""Block products of 2 to 16 tokens as AMX tile products (csrc/tiles.h), bitwise every
level's: on a host without AMX the tile code runs in the ``amx_emulated`` build (each tile
instruction a C++ function doing what it is documented to do) and is compared with the
host's level and ``default``."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from runtime import kernels
from runtime.batched import BatchedLM
from runtime.passes import BatchItem

# (out rows, inputs): one whole tile, tiles and a ragged last one, one block to ten
SHAPES = [(16, 32), (53, 96), (40, 64), (200, 320)]
TOKENS = [*range(1, 17), 17, 33]  # a tile product's 1 to 16 rows, then two and three passes


def _needs_vnni() -> None:
    if "avx512_vnni" not in kernels.host_levels():
        pytest.skip("the emulated tiles run on the avx512_vnni level's instructions, which "
                    "this CPU lacks")


@pytest.fixture(scope="module")
def emulated() -> Any:
    _needs_vnni()
    module = kernels.build("amx_emulated")
    assert module is not None
    assert module.capability() == "amx_emulated" and module.tiles() == "amx_emulated"
    return module


@pytest.fixture()
def threads() -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(2)  # chunks on PyTorch's worker threads too: each loads its tiles
    yield
    torch.set_num_threads(before)


def _case(bits: int, out: int, inputs: int, seed: int) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 16 if bits == 4 else 256, (out, inputs), generator=g,
                          dtype=torch.uint8)
    scale = torch.rand(out, inputs // 32, generator=g) / 20
    low = -torch.rand(out, inputs // 32, generator=g) / 10
    x = torch.randn(max(TOKENS), inputs, generator=g).bfloat16()
    bias = torch.randn(out, generator=g)
    return codes, scale, low, x, bias


def _products(module: Any, bits: int, case: tuple[torch.Tensor, ...]) -> list[torch.Tensor]:
    """Each token count's product (bfloat16 and float32 activations, with a bias)."""
    codes, scale, low, x, bias = case
    packed = module.block_pack(codes, scale, low, bits)
    out = codes.shape[0]
    return ([module.block_product(x[:n], packed, out, bits, None) for n in TOKENS]
            + [module.block_product(x[:n].float(), packed, out, bits, bias) for n in (1, 7, 17)])


def _tile_products(out: int, inputs: int, tokens: int) -> int:
    """The TDPBSUDs a product of ``tokens`` takes: one a tile of 16 rows, block of 32 inputs
    and pass of at most 16 tokens; none for a token alone."""
    if tokens == 1:
        return 0
    return -(-out // 16) * (inputs // 32) * -(-tokens // 16)


@pytest.mark.parametrize("bits", [4, 8])
def test_emulated_tiles_give_every_level_s_products_bitwise(emulated: Any, threads: None,
                                                           bits: int) -> None:
    """The tile code, its instructions emulated: bitwise the host level's and the
    ``default`` level's products for 4- and 8-bit matrices, 1 to 16 tokens and more (split
    into passes), whole and ragged tiles, 1 to 10 blocks; and the tiles did the work."""
    host, default = kernels.native(), kernels.build("default")
    assert default is not None and default.tiles() == "none"
    for index, (out, inputs) in enumerate(SHAPES):
        case = _case(bits, out, inputs, seed=10 * bits + index)
        before = emulated.emulated_tile_products()
        got = _products(emulated, bits, case)
        ran = emulated.emulated_tile_products() - before
        assert ran == (sum(_tile_products(out, inputs, n) for n in TOKENS)
                       + sum(_tile_products(out, inputs, n) for n in (1, 7, 17))), (out, inputs)
        for name, module in (("host", host), ("default", default)):
            want = _products(module, bits, case)
            for n, (a, b) in enumerate(zip(got, want, strict=True)):
                assert a.dtype == b.dtype and torch.equal(a, b), (name, out, inputs, n)


def test_emulated_tiles_give_the_model_s_logits_bitwise(emulated: Any, threads: None,
                                                        tiny_target_dir: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """A 4-bit model loaded on the emulated tiles, its layers run as one LayerStack call
    on a team of two threads (each chunk configures the tiles of the thread that claims
    it): a prompt, a step and verify passes of 3 and 16 tokens beside another sequence
    give bitwise the host level's logits."""
    def passes() -> list[torch.Tensor]:
        runner = BatchedLM.load(str(tiny_target_dir), dtype="bfloat16", quantize="int4")
        assert isinstance(runner, BatchedLM) and runner.stack.layer_stack is not None
        a, b = runner.new_state(), runner.new_state()
        out = runner.forward_batch([BatchItem(a, list(range(30, 70)), 1),
                                    BatchItem(b, list(range(5, 12)), 2)])
        out += runner.forward_batch([BatchItem(a, [7], 1)])
        out += runner.forward_batch([BatchItem(a, [8, 9, 10], 3), BatchItem(b, [11], 1)])
        out += runner.forward_batch([BatchItem(a, list(range(40, 56)), 16),
                                     BatchItem(b, [12, 13], 2)])
        runner.release(a)
        runner.release(b)
        return out

    with torch.inference_mode():
        want = passes()
        monkeypatch.setattr(kernels, "_loaded", kernels.loaded())  # restored after
        monkeypatch.setattr(kernels, "capability", lambda: "amx_emulated")
        before = emulated.emulated_tile_products()
        got = passes()
    assert emulated.emulated_tile_products() > before
    assert kernels.loaded() is emulated
    assert len(got) == len(want) == 7
    for index, (a, b) in enumerate(zip(got, want, strict=True)):
        assert torch.equal(a, b), index
