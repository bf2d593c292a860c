"""The amx level: block products of 2 to 16 tokens as AMX tile products (csrc/tiles.h),
bitwise every other level's. On a host without AMX the same tile code runs in the
``amx_emulated`` build (each tile instruction a C++ function doing what it is documented
to do) and is compared with the host's level and ``default``; the real tiles are
compared with ``avx512_vnni`` where the host has AMX. Asking Linux for the tile data
permission, falling back to ``avx512_vnni`` where it is refused, and refusing
``SPECSERVE_CPU_CAPABILITY=amx`` on a CPU without AMX."""

from __future__ import annotations

import ctypes
import errno
import logging
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from runtime.native import kernels
from runtime.runner.batched import BatchedLM
from tests.batching import mixed_passes

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
        return mixed_passes(runner, range(30, 70))

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


@pytest.mark.parametrize("bits", [4, 8])
def test_the_amx_level_gives_avx512_vnni_s_products_bitwise(threads: None, bits: int) -> None:
    """The real tiles (on a host whose CPU has them and whose Linux lets this process use
    them) against the avx512_vnni level, in one process."""
    if "amx" not in kernels.host_levels():
        pytest.skip("needs a host with AMX (amx_tile, amx_int8)")
    amx, vnni = kernels.build("amx"), kernels.build("avx512_vnni")
    assert amx is not None and vnni is not None
    assert amx.capability() == "amx" and amx.tiles() == "amx" and vnni.tiles() == "none"
    for index, (out, inputs) in enumerate(SHAPES):
        case = _case(bits, out, inputs, seed=10 * bits + index)
        for n, (a, b) in enumerate(zip(_products(amx, bits, case), _products(vnni, bits, case),
                                       strict=True)):
            assert torch.equal(a, b), (out, inputs, n)


@pytest.fixture()
def amx_cpu(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[tuple[int, int]]]:
    """This CPU's flags faked to an AMX one's, the tile permission asked anew; yields the
    arch_prctl calls a test's fake answers (options and arguments)."""
    monkeypatch.setattr(kernels.platform, "machine", lambda: "x86_64")
    monkeypatch.setattr(kernels, "_cpu_flags", lambda: kernels.LEVELS["amx"][1])
    monkeypatch.delenv(kernels.CAPABILITY_VARIABLE, raising=False)
    kernels.amx_refusal.cache_clear()
    kernels._log_amx_fallback.cache_clear()
    yield []
    kernels.amx_refusal.cache_clear()
    kernels._log_amx_fallback.cache_clear()


def _kernel_answers(calls: list[tuple[int, int]], request: int,
                    granted: int | None) -> Callable[[int, int], tuple[int, int]]:
    """arch_prctl as a kernel answering the request with ``request`` (an errno, 0: done)
    and the read-back with the feature bits ``granted`` (None: fails)."""
    def answer(option: int, argument: int) -> tuple[int, int]:
        calls.append((option, argument))
        if option == kernels.ARCH_REQ_XCOMP_PERM:
            return (0, 0) if request == 0 else (-1, request)
        assert option == kernels.ARCH_GET_XCOMP_PERM
        if granted is None:
            return -1, errno.EFAULT
        ctypes.c_ulong.from_address(argument).value = granted
        return 0, 0
    return answer


@pytest.mark.parametrize(("request_errno", "granted", "reason"), [
    (errno.EOPNOTSUPP, None, "refused the AMX tile data permission"),
    (errno.EPERM, None, "refused the AMX tile data permission"),
    (0, 1 << 17, "did not grant"),
    (0, None, "could not be read back"),
], ids=["unsupported", "forbidden", "not-granted", "unreadable"])
def test_a_refused_tile_permission_falls_back_to_avx512_vnni(
        amx_cpu: list[tuple[int, int]], monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture, request_errno: int, granted: int | None,
        reason: str) -> None:
    """On a CPU with AMX whose Linux does not let the process use tile data (the system
    call's answer faked: no host here can refuse it), the best level is avx512_vnni, one
    log line says why, and naming amx is an error saying why."""
    monkeypatch.setattr(kernels, "_arch_prctl", _kernel_answers(amx_cpu, request_errno, granted))
    with caplog.at_level(logging.WARNING, logger="runtime.native.kernels"):
        assert kernels.host_levels()[-1] == "avx512_vnni"
        assert kernels.capability() == "avx512_vnni"
        assert "amx" not in kernels.host_levels()
    assert amx_cpu[0] == (kernels.ARCH_REQ_XCOMP_PERM, kernels.XFEATURE_XTILEDATA)
    assert len(amx_cpu) <= 2  # asked once a process, however often the levels are read
    lines = [r.getMessage() for r in caplog.records if "amx" in r.getMessage()]
    assert len(lines) == 1 and reason in lines[0] and "avx512_vnni" in lines[0], lines
    monkeypatch.setenv(kernels.CAPABILITY_VARIABLE, "amx")
    with pytest.raises(kernels.KernelsUnavailable, match=reason):
        kernels.capability()
    monkeypatch.setattr(kernels, "build", lambda level: pytest.fail(f"{level} loaded"))
    with pytest.raises(kernels.KernelsUnavailable, match=reason):
        kernels.native()


def test_a_granted_tile_permission_makes_amx_the_best_level(
        amx_cpu: list[tuple[int, int]], monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    """Granted (the bit of XTILEDATA read back), amx is the level chosen, with no
    fallback line, and a lower level can still be named."""
    monkeypatch.setattr(kernels, "_arch_prctl", _kernel_answers(amx_cpu, 0, 1 << 18 | 3))
    with caplog.at_level(logging.WARNING, logger="runtime.native.kernels"):
        assert kernels.host_levels() == list(kernels.LEVELS)
        assert kernels.capability() == "amx"
    assert [option for option, _ in amx_cpu] == [kernels.ARCH_REQ_XCOMP_PERM,
                                                 kernels.ARCH_GET_XCOMP_PERM]
    assert not caplog.records
    monkeypatch.setenv(kernels.CAPABILITY_VARIABLE, "avx512_vnni")
    assert kernels.capability() == "avx512_vnni"


def test_naming_amx_on_a_cpu_without_it_is_a_clear_error(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """SPECSERVE_CPU_CAPABILITY=amx where the CPU lacks AMX: refused, naming the levels it
    runs, before anything is built or loaded; and the test-only emulated build is never
    a level one can name."""
    if "amx" in kernels._cpu_levels():
        pytest.skip("this CPU has AMX: naming amx is not an error here")
    monkeypatch.setenv(kernels.CAPABILITY_VARIABLE, "amx")
    monkeypatch.setattr(kernels, "build", lambda level: pytest.fail(f"{level} loaded"))
    with pytest.raises(kernels.KernelsUnavailable, match="this CPU runs only"):
        kernels.capability()
    with pytest.raises(kernels.KernelsUnavailable, match="'amx': this CPU runs only"):
        kernels.native()
    monkeypatch.setenv(kernels.CAPABILITY_VARIABLE, "amx_emulated")
    with pytest.raises(kernels.KernelsUnavailable, match="not a level"):
        kernels.capability()


def test_the_real_permission_request_answers_on_this_host() -> None:
    """The request itself, unfaked: granted on a host with AMX (and then amx is this
    host's best level), refused with a reason on one without."""
    if not kernels._x86_64() or not kernels.sys.platform.startswith("linux"):
        pytest.skip("the tile permission is asked for on Linux on x86-64 only")
    kernels.amx_refusal.cache_clear()
    try:
        reason = kernels.amx_refusal()
    finally:
        kernels.amx_refusal.cache_clear()
    if "amx" in kernels._cpu_levels():
        assert reason is None or "amx" not in kernels.host_levels()
    else:
        assert reason is not None and "AMX" in reason
