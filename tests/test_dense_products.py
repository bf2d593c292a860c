"""Float32 and bfloat16 matrices multiplied by the native kernels' ``dense_product``
(``weights.Matrix.use_native``): each output row one chain of fused multiply-adds over
its inputs in order, checked bitwise against that chain computed here; a token's result
independent of the batch and the thread count; the same products in every build; the
packing's round trip; the runner's matrices switching with its kernels; bad calls
refused."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from runtime.matrices import weights
from runtime.native import kernels
from runtime.runner.batched import BatchedLM
from runtime.runner.causal_lm import CausalLM
from runtime.runner.passes import BatchItem
from tests.test_kernels import at_level, lower_levels

DTYPES = [torch.float32, torch.bfloat16]


@pytest.fixture(scope="module")
def native() -> Any:
    return kernels.native()


@pytest.fixture()
def threads() -> Iterator[None]:
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def representable(shape: tuple[int, ...], dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Random values that bfloat16 holds exactly, in ``dtype``: any two multiply exactly
    in float32, so the chain below is computable bitwise in float64."""
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=g) / 8).bfloat16().to(dtype)


def chain(w: torch.Tensor, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """Each row of ``x`` ``[T, in]`` against ``w`` ``[out, in]`` as the kernel defines it:
    acc = fma(w_i, x_i, acc) over the inputs in order from zero (bfloat16: each pair's
    odd input first), each step rounded once to float32; then + bias. With exact
    products and float64 sums of float32 values this far apart, each step here is
    exactly the fused multiply-add."""
    wd, xd = w.double(), x.double()
    order = list(range(w.shape[1]))
    if w.dtype == torch.bfloat16:
        order = [i ^ 1 for i in order]  # 1, 0, 3, 2, ...
    acc = torch.zeros(x.shape[0], w.shape[0], dtype=torch.float32)
    for i in order:
        acc = (acc.double() + xd[:, i : i + 1] * wd[:, i][None]).float()
    if bias is not None:
        acc = acc + bias.float()
    return acc.to(x.dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(64, 32), (100, 96), (7, 2), (130, 50)])
def test_a_row_is_one_chain_of_multiply_adds_in_input_order(native: Any, dtype: torch.dtype,
                                                            shape: tuple[int, int]) -> None:
    """Bitwise the chain, for 1 to 13 tokens (passes of one to six tokens, evenly
    filled), rows past a multiple of 64 included, with and without a bias."""
    w = representable(shape, dtype, 0)
    bias = representable((shape[0],), dtype, 1)
    for b in (None, bias):
        m = weights.Matrix(w, b)
        m.use_native(native)
        assert m.runs_native
        for tokens in (1, 2, 5, 7, 13):
            x = representable((tokens, shape[1]), dtype, tokens)
            got = m(x)
            assert got.dtype == dtype and got.shape == (tokens, shape[0])
            assert torch.equal(got, chain(w, x, b)), (tokens, b is None)


def test_the_sum_runs_in_input_order(native: Any) -> None:
    """1e8 + 1 - 1e8 in float32, in that order, is 0: a kernel that summed in any other
    order (or in wider precision) would give 1. bfloat16 takes each pair's odd input
    first: -2^25, 0, 1, 2^25 sums as 0 - 2^25 + 2^25 + 1 = 1 (in input order, 0)."""
    w = torch.ones(1, 3)
    x = torch.tensor([[1e8, 1.0, -1e8], [1.0, 1e8, -1e8], [1e8, -1e8, 1.0]])
    m = weights.Matrix(w, None)
    m.use_native(native)
    assert m(x)[:, 0].tolist() == [0.0, 0.0, 1.0]
    m = weights.Matrix(torch.ones(1, 4).bfloat16(), None)
    m.use_native(native)
    x = torch.tensor([[-2.0**25, 0, 1, 2.0**25], [0, -2.0**25, 2.0**25, 1]]).bfloat16()
    assert m(x)[:, 0].tolist() == [1.0, 0.0]


def test_a_token_s_result_depends_on_nothing_else(native: Any, threads: None) -> None:
    """Whatever shares the call and however many threads run it: bitwise the same rows,
    a wide matrix split across threads included."""
    for dtype in DTYPES:
        m = weights.Matrix(torch.randn(1000, 96).to(dtype), torch.randn(1000).to(dtype))
        m.use_native(native)
        x = torch.randn(17, 96).to(dtype)
        torch.set_num_threads(1)
        alone = torch.cat([m(x[i : i + 1]) for i in range(17)])
        for n in (1, 2):
            torch.set_num_threads(n)
            for tokens in (3, 6, 8, 17):
                assert torch.equal(m(x[:tokens]), alone[:tokens]), (dtype, n, tokens)
            other = torch.cat((x[5:9], torch.randn(3, 96).to(dtype)))
            assert torch.equal(m(other)[:4], alone[5:9]), (dtype, n)


@pytest.mark.parametrize("dtype", DTYPES)
def test_the_packing_round_trips_and_switches_back(native: Any, dtype: torch.dtype) -> None:
    """The rows come back bitwise from the native packing once the plain copy is let go
    (all of them, or those a lookup asks for); switching back to PyTorch's product keeps
    the products to rounding, and to native again gives the native products bitwise."""
    rows, bias = torch.randn(70, 48).to(dtype), torch.randn(70).to(dtype)
    x = torch.randn(5, 48).to(dtype)
    m = weights.Matrix(rows, bias)
    before = m(x)
    m.use_native(native)
    assert m.runs_native and m.packed is None
    first = m(x)
    assert m.release_rows() and m.rows is None
    assert torch.equal(m.plain(), rows)
    ids = torch.tensor([[69, 0, 64], [63, 5, 69]])
    assert torch.equal(m.take(ids), rows[ids])  # a tied embedding's lookups
    with pytest.raises(IndexError):
        m.take(torch.tensor([70]))  # a padding row of the last group is no row
    assert torch.equal(m(x), first)
    m.use_native(None)
    assert not m.runs_native and torch.equal(m.plain(), rows)
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(m(x), before, atol=tolerance, rtol=tolerance)
    torch.testing.assert_close(first.float(), before.float(), atol=tolerance * 4,
                               rtol=tolerance)
    m.use_native(native)
    assert torch.equal(m(x), first)


def test_what_the_kernel_cannot_take_stays_pytorch_s(native: Any) -> None:
    """bfloat16 with an odd input size (its inputs go in pairs) and float16 keep their
    product."""
    odd = weights.Matrix(torch.randn(8, 5).bfloat16(), None)
    odd.use_native(native)
    assert not odd.runs_native
    half = weights.Matrix(torch.randn(8, 4).half(), None)
    half.use_native(native)
    assert not half.runs_native


def test_bad_calls_raise_instead_of_reading_out_of_bounds(native: Any) -> None:
    m = weights.Matrix(torch.randn(40, 32), None)
    m.use_native(native)
    assert m.dense is not None
    x = torch.zeros(2, 32)
    with pytest.raises(RuntimeError, match="does not hold"):
        native.dense_product(x, m.dense, 80, None)  # more rows than packed
    with pytest.raises(RuntimeError, match="does not hold"):
        native.dense_product(torch.zeros(2, 48), m.dense, 40, None)
    with pytest.raises(RuntimeError, match="bias"):
        native.dense_product(x, m.dense, 40, torch.zeros(3))
    with pytest.raises(RuntimeError, match="contiguous"):
        native.dense_product(torch.zeros(32, 2).t(), m.dense, 40, None)
    with pytest.raises(RuntimeError, match="contiguous"):
        native.dense_product(torch.zeros(64), m.dense, 40, None)
    b = weights.Matrix(torch.randn(40, 32).bfloat16(), None)
    b.use_native(native)
    assert b.dense is not None
    with pytest.raises(RuntimeError, match="bfloat16 activations"):
        native.dense_product(x, b.dense, 40, None)
    with pytest.raises(RuntimeError, match="odd input size"):
        native.dense_product(torch.zeros(2, 31).bfloat16(), torch.zeros(1, 31, 64).bfloat16(),
                             40, None)
    with pytest.raises(RuntimeError):
        native.dense_product(x.half(), m.dense, 40, None)


def test_the_runner_s_matrices_follow_its_kernels(tiny_target: CausalLM) -> None:
    """Native kernels: every float matrix, the head's too, multiplies natively and a
    verify pass is bitwise its one-token steps; ``torch``: none does."""
    assert isinstance(tiny_target, BatchedLM) and tiny_target.kernels == "native"
    mats = [m for m in tiny_target._products() if isinstance(m, weights.Matrix)]
    assert mats and all(m.runs_native for m in mats)
    prompt, future = list(range(3, 40)), [5, 6, 7, 8, 9]
    state = tiny_target.new_state()
    try:
        tiny_target.forward_batch([BatchItem(state, prompt, 1)])
        steps = torch.cat([tiny_target.forward_batch([BatchItem(state, [t], 1)])[0]
                           for t in future])
        tiny_target.rollback(state, len(prompt))
        verify = tiny_target.forward_batch([BatchItem(state, future, len(future))])[0]
        assert torch.equal(verify, steps)
    finally:
        tiny_target.release(state)
    tiny_target.use_kernels("torch")
    try:
        assert not any(m.runs_native for m in mats)
    finally:
        tiny_target.use_kernels("auto")
    assert all(m.runs_native for m in mats)


@pytest.mark.parametrize("level", lower_levels())
def test_every_level_computes_the_same_products(native: Any, tmp_path: Path, level: str) -> None:
    """Another level's build runs the same chains of fused multiply-adds (sixteen lanes
    an instruction, eight, or one): bitwise this build's products, float32 and
    bfloat16, for passes of 1 to 9 tokens."""
    g = torch.Generator().manual_seed(0)
    cases = {str(dtype): (torch.randn(150, 96, generator=g).to(dtype),
                          torch.randn(150, generator=g).to(dtype),
                          torch.randn(9, 96, generator=g).to(dtype)) for dtype in DTYPES}
    torch.save(cases, tmp_path / "cases.pt")
    at_level(level, (
        "import torch\n"
        "from runtime.native import kernels\nfrom runtime.matrices import weights\n"
        "native = kernels.native()\n"
        f"assert native.capability() == {level!r}\n"
        f"cases = torch.load({str(tmp_path / 'cases.pt')!r})\n"
        "out = {}\n"
        "for name, (rows, bias, x) in cases.items():\n"
        "    m = weights.Matrix(rows, bias)\n"
        "    m.use_native(native)\n"
        "    out[name] = [m(x[:n]) for n in (1, 2, 5, 9)]\n"
        f"torch.save(out, {str(tmp_path / 'out.pt')!r})\n"))
    other = torch.load(tmp_path / "out.pt")
    for name, (rows, bias, x) in cases.items():
        m = weights.Matrix(rows, bias)
        m.use_native(native)
        for got, n in zip(other[name], (1, 2, 5, 9), strict=True):
            assert torch.equal(got, m(x[:n])), (name, n)
