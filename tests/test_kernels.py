"""The fused CPU kernels (runtime/native/csrc/): each against PyTorch's own ops, each token's
result independent of the batch and of the thread count, bad calls refused with an
error, the runner's choice between them and PyTorch's path, and every instruction-set
level computing bitwise the same."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.nn import functional as F

from runtime.native import kernels
from runtime.runner.attention import rotate
from runtime.runner.batched import BatchedLM
from runtime.runner.causal_lm import CausalLM
from runtime.runner.passes import BatchItem
from tests.batching import mixed_passes


@pytest.fixture(scope="module")
def native() -> Any:
    return kernels.native()  # this machine has g++: a build failure is a failure here


@pytest.fixture()
def threads() -> Iterator[None]:
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


PAGE = 8  # positions a block in these tests: a sequence's keys cross several


def paged(rows: torch.Tensor, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """``rows`` ``[R, kv, capacity, D]`` as a pool ``[1 + R * capacity / PAGE, kv, PAGE, D]``
    (block 0 zero, the others shuffled) and its block tables ``[R, capacity / PAGE]``."""
    count, kv, capacity, dim = rows.shape
    width = capacity // PAGE
    order = torch.randperm(count * width, generator=torch.Generator().manual_seed(seed)) + 1
    tables = order.view(count, width)
    pool = rows.new_zeros((1 + count * width, kv, PAGE, dim))
    for r in range(count):
        for i in range(width):
            pool[tables[r, i]] = rows[r, :, i * PAGE:(i + 1) * PAGE]
    return pool, tables


def unpaged(pool: torch.Tensor, tables: torch.Tensor) -> torch.Tensor:
    """The rows ``[R, kv, width * PAGE, D]`` that ``tables`` read of ``pool``."""
    blocks = pool[tables]  # [R, width, kv, PAGE, D]
    return blocks.transpose(1, 2).reshape(tables.shape[0], pool.shape[1], -1, pool.shape[3])


def _close(dtype: torch.dtype) -> dict[str, float]:
    return {"atol": 1e-5, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 2e-2, "rtol": 2e-2}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_add_rms_norm_is_the_residual_sum_and_the_model_norm(native: Any,
                                                            dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(0)
    hidden, delta = (torch.randn(5, 96, generator=g).to(dtype) for _ in range(2))
    weight = torch.rand(96, generator=g).to(dtype)
    summed, normed = native.add_rms_norm(hidden, delta, weight, 1e-5)
    assert torch.equal(summed, hidden + delta)  # rounded once, as the eager sum is
    x = summed.float()
    expected = weight.float() * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5))
    torch.testing.assert_close(normed.float(), expected, **_close(dtype))
    alone, normed_alone = native.add_rms_norm(hidden, None, weight, 1e-5)
    assert alone is hidden
    assert normed_alone.shape == hidden.shape


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_store_rotates_and_writes_the_cache(native: Any, dtype: torch.dtype) -> None:
    heads, kv, dim, tokens = 4, 2, 32, 3
    g = torch.Generator().manual_seed(1)
    qkv = torch.randn(tokens, (heads + 2 * kv) * dim, generator=g).to(dtype)
    angles = torch.rand(tokens, dim // 2, generator=g) * 6
    cos = torch.cat((angles.cos(), angles.cos()), -1).to(dtype)
    sin = torch.cat((angles.sin(), angles.sin()), -1).to(dtype)
    pool_k, tables = paged(torch.zeros(2, kv, 16, dim, dtype=dtype))
    pool_v = torch.zeros_like(pool_k)
    rows, slots = torch.tensor([1, 1, 0]), torch.tensor([4, 5, 9])
    q = native.rope_store(qkv, cos, sin, pool_k, pool_v, tables, rows, slots, heads, kv)
    keys, values = unpaged(pool_k, tables), unpaged(pool_v, tables)
    assert not pool_k[0].any() and not pool_v[0].any()  # the null block stays zero
    split = qkv.float().view(tokens, heads + 2 * kv, dim)
    rotated = rotate(split[:, : heads + kv], cos.float()[:, None], sin.float()[:, None])
    torch.testing.assert_close(q.float(), rotated[:, :heads], **_close(dtype))
    for t in range(tokens):
        torch.testing.assert_close(keys[rows[t], :, slots[t]].float(), rotated[t, heads:],
                                   **_close(dtype))
        assert torch.equal(values[rows[t], :, slots[t]], split[t, heads + kv :].to(dtype))
    assert int((keys != 0).any(-1).sum()) == tokens * kv  # nothing else written


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
# a multiple of 64, of 16 but not 64 (the vector path's last slice of dimensions is
# partial), and not of 16 (the generic path)
@pytest.mark.parametrize("dim", [64, 80, 24])
# query heads per key/value head: 3 (one part), 7 (parts of 4 and 3), 8 (two of 4)
@pytest.mark.parametrize("heads", [6, 14, 16])
def test_attend_sees_exactly_the_keys_allowed(native: Any, dtype: torch.dtype,
                                             dim: int, heads: int) -> None:
    kv, capacity = 2, 40
    g = torch.Generator().manual_seed(2)
    keys = torch.randn(3, kv, capacity, dim, generator=g).to(dtype)
    values = torch.randn(3, kv, capacity, dim, generator=g).to(dtype)
    (pool_k, tables), (pool_v, _) = paged(keys), paged(values)
    q = torch.randn(4, heads, dim, generator=g).to(dtype)
    rows = torch.tensor([0, 2, 2, 1])
    limits = torch.tensor([1, 17, 18, 30])
    extras = torch.tensor([-1, -1, 33, -1])  # the third also sees key 33 (an alternative)
    out = native.attend(q, pool_k, pool_v, tables, rows, limits, extras, 0.3)
    for t in range(4):
        seen = list(range(int(limits[t]))) + ([int(extras[t])] if extras[t] >= 0 else [])
        k = keys[rows[t], :, seen].float().repeat_interleave(heads // kv, 0)  # [h, n, D]
        v = values[rows[t], :, seen].float().repeat_interleave(heads // kv, 0)
        expected = F.scaled_dot_product_attention(q[t].float()[:, None], k, v, scale=0.3)
        torch.testing.assert_close(out[t].float(), expected.reshape(-1), **_close(dtype))


def test_silu_mul(native: Any) -> None:
    gate_up = torch.randn(3, 2 * 40)
    torch.testing.assert_close(native.silu_mul(gate_up),
                               F.silu(gate_up[:, :40]) * gate_up[:, 40:])


def test_a_token_s_result_depends_on_nothing_else(native: Any, threads: None) -> None:
    """Bitwise: a token alone, beside others, and on one or two threads."""
    g = torch.Generator().manual_seed(3)
    keys, tables = paged(torch.randn(2, 3, 64, 64, generator=g).to(torch.bfloat16))
    values, _ = paged(torch.randn(2, 3, 64, 64, generator=g).to(torch.bfloat16))
    q = torch.randn(9, 9, 64, generator=g).to(torch.bfloat16)
    rows, limits = torch.tensor([0] * 5 + [1] * 4), torch.arange(30, 39)
    extras = torch.full((9,), -1)
    hidden = torch.randn(9, 576, generator=g).to(torch.bfloat16)
    weight = torch.rand(576, generator=g).to(torch.bfloat16)
    results = []
    for n in (1, 2):
        torch.set_num_threads(n)
        results.append((native.attend(q, keys, values, tables, rows, limits, extras, 0.125),
                        native.add_rms_norm(hidden, hidden, weight, 1e-5)[1],
                        native.silu_mul(torch.cat((hidden, hidden), -1))))
    for a, b in zip(*results, strict=True):
        assert torch.equal(a, b)
    for t in (0, 4, 8):
        one = native.attend(q[t : t + 1], keys, values, tables, rows[t : t + 1],
                            limits[t : t + 1], extras[t : t + 1], 0.125)
        assert torch.equal(one[0], results[0][0][t])
        assert torch.equal(native.add_rms_norm(hidden[t : t + 1], hidden[t : t + 1], weight,
                                               1e-5)[1][0], results[0][1][t])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_argmax_rows_is_torch_s_argmax(native: Any, dtype: torch.dtype) -> None:
    """The first of the largest of each row, as torch's argmax of the widened rows: ties
    (the first wins, -0.0 ties 0.0), a NaN (the first NaN wins, before or after the
    largest, in the vectors or in the scalar tail), rows of -inf (all but the masked),
    rows of every width around the vectors'."""
    g = torch.Generator().manual_seed(1)
    rows = [torch.randn(width, generator=g) for width in (1, 7, 8, 15, 16, 17, 33, 49152)]
    tied = torch.randn(100, generator=g)
    tied[[20, 70, 90]] = 9.0  # three equal largest
    rows += [tied, torch.full((40,), float("-inf")), torch.zeros(23)]
    signed = torch.zeros(18)
    signed[3], signed[11] = -0.0, 0.0
    masked = torch.full((50,), float("-inf"))
    masked[31] = -5.0
    late, early = torch.randn(64, generator=g), torch.randn(64, generator=g)
    late[60], early[2] = float("nan"), float("nan")
    early[40] = float("inf")
    # a NaN in a row's scalar tail, past the last whole vector of any level (and a row
    # that is all tail): the tail loop alone must see it
    tail, short = torch.randn(71, generator=g), torch.randn(5, generator=g)
    tail[68], short[3] = float("nan"), float("nan")
    rows += [signed - 1, masked, late, early, tail, short]
    for row in rows:
        x = row.to(dtype)[None].repeat(2, 1)
        x[1] = x[1].flip(0)
        want = x.float().argmax(dim=-1)
        got = native.argmax_rows(x)
        assert got.dtype == torch.int64 and torch.equal(got, want), row[:8]
    x = torch.randn(5, 3000, generator=g).to(dtype)
    assert kernels.loaded() is native  # (what first_largest runs on)
    assert kernels.first_largest(x) == x.float().argmax(-1).tolist()
    assert kernels.first_largest(x[:, ::2]) == x[:, ::2].float().argmax(-1).tolist()
    with pytest.raises(RuntimeError, match="scores must be"):
        native.argmax_rows(torch.zeros(3, dtype=dtype))
    with pytest.raises(RuntimeError, match="scores must be"):
        native.argmax_rows(torch.zeros(3, 4, dtype=torch.float16))


def test_bad_calls_raise_instead_of_reading_out_of_bounds(native: Any) -> None:
    keys = torch.zeros(2, 1, 8, 16)  # a pool of two blocks of 8
    tables = torch.tensor([[1]])
    q = torch.zeros(1, 2, 16)
    one = torch.tensor([0])
    with pytest.raises(RuntimeError, match="out of range"):
        native.attend(q, keys, keys, tables, torch.tensor([1]), torch.tensor([1]),
                      torch.tensor([-1]), 1.0)
    with pytest.raises(RuntimeError, match="out of range"):
        native.attend(q, keys, keys, tables, one, torch.tensor([9]), torch.tensor([-1]), 1.0)
    with pytest.raises(RuntimeError, match="names block 2"):
        native.attend(q, keys, keys, torch.tensor([[2]]), one, one + 1, one - 1, 1.0)
    with pytest.raises(RuntimeError, match="power of two"):
        native.attend(q, keys[:, :, :6].contiguous(), keys[:, :, :6].contiguous(), tables, one,
                      one + 1, one - 1, 1.0)
    with pytest.raises(RuntimeError, match="out of range"):
        native.rope_store(torch.zeros(1, 64), torch.zeros(1, 16), torch.zeros(1, 16), keys,
                          keys.clone(), tables, one, torch.tensor([8]), 2, 1)
    with pytest.raises(RuntimeError, match="dtype"):
        native.attend(q.double(), keys, keys, tables, one, one + 1, one - 1, 1.0)
    with pytest.raises(RuntimeError):
        native.silu_mul(torch.zeros(2, 3))


def test_the_runner_s_kernels_agree_with_its_pytorch_path(tiny_target: CausalLM) -> None:
    """Same model, same tokens: the fused kernels' logits are PyTorch's to float32
    rounding, and a verify pass with each is bitwise its one-token steps."""
    assert isinstance(tiny_target, BatchedLM)
    assert tiny_target.kernels == "native"  # auto, on a machine that builds them
    prompt, future = list(range(5, 45)), [7, 8, 9, 10]
    got = {}
    try:
        for choice in ("native", "torch"):
            tiny_target.use_kernels(choice)
            assert tiny_target.kernels == choice
            state = tiny_target.new_state()
            tiny_target.forward_batch([BatchItem(state, prompt, 1)])
            steps = torch.cat([tiny_target.forward_batch([BatchItem(state, [t], 1)])[0]
                               for t in future])
            tiny_target.rollback(state, len(prompt))
            verify = tiny_target.forward_batch([BatchItem(state, future, len(future))])[0]
            tiny_target.release(state)
            assert torch.equal(verify, steps), choice
            got[choice] = steps
    finally:
        tiny_target.use_kernels("auto")
    torch.testing.assert_close(got["native"], got["torch"], atol=1e-4, rtol=1e-4)


def test_an_alternative_gets_its_one_token_step_s_logits_bitwise(
        tiny_target: CausalLM) -> None:
    """With the native kernels an alternative reads the keys a one-token step reads, in
    the same order: its logits are that step's bitwise, so batch invariance keeps them
    (the PyTorch path does not offer alternatives while invariant)."""
    assert isinstance(tiny_target, BatchedLM) and tiny_target.batch_invariant
    assert tiny_target.capabilities.branches
    prompt, pending, drafts, alternative = list(range(50, 90)), 11, [12, 13], 14
    state = tiny_target.new_state()
    tiny_target.forward_batch([BatchItem(state, prompt, 1)])
    chain = torch.cat([tiny_target.forward_batch([BatchItem(state, [t], 1)])[0]
                       for t in (pending, *drafts)])
    tiny_target.rollback(state, len(prompt) + 1)
    alone = tiny_target.forward_batch([BatchItem(state, [alternative], 1)])[0][0]
    tiny_target.rollback(state, len(prompt))
    tokens = [pending, *drafts, alternative]
    got = tiny_target.forward_batch([BatchItem(state, tokens, len(tokens), alternative=True)])[0]
    assert torch.equal(got[:-1], chain)
    assert torch.equal(got[-1], alone)
    tiny_target.release(state)
    tiny_target.use_kernels("torch")
    try:
        assert not tiny_target.capabilities.branches
    finally:
        tiny_target.use_kernels("auto")


def test_kernels_choice_is_checked(tiny_target: CausalLM) -> None:
    assert isinstance(tiny_target, BatchedLM)
    with pytest.raises(ValueError, match="unknown kernels"):
        tiny_target.use_kernels("fast")
    with pytest.raises(ValueError, match="unknown kernels"):
        kernels.resolve("fast", torch.device("cpu"))
    with pytest.raises(kernels.KernelsUnavailable, match="CPU only"):
        kernels.resolve("native", torch.device("meta"))
    assert kernels.resolve("auto", torch.device("meta")) is None


def test_a_machine_that_cannot_build_them_runs_pytorch(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Any, caplog: pytest.LogCaptureFixture) -> None:
    """A failing build (here: an instruction set g++ does not know) is a clear error for
    ``native`` and a warning and the PyTorch path for ``auto``."""
    monkeypatch.setenv("SPECSERVE_HOME", str(tmp_path))
    monkeypatch.delenv(kernels.DIR_VARIABLE, raising=False)
    level = kernels.capability()
    monkeypatch.setitem(kernels.LEVELS, level, (["-march=no-such-cpu"], kernels.LEVELS[level][1]))
    monkeypatch.setattr(kernels, "build", kernels.build.__wrapped__)
    with pytest.raises(kernels.KernelsUnavailable, match="could not be built"):
        kernels.resolve("native", torch.device("cpu"))
    with caplog.at_level(logging.WARNING, logger="runtime.native.kernels"):
        assert kernels.resolve("auto", torch.device("cpu")) is None
    assert "PyTorch path" in caplog.text


def test_the_level_is_the_host_s_best_unless_a_lower_one_is_named(
        monkeypatch: pytest.MonkeyPatch) -> None:
    runs = kernels.host_levels()
    assert runs[0] == "default" and runs == [lv for lv in kernels.LEVELS if lv in runs]
    monkeypatch.delenv(kernels.CAPABILITY_VARIABLE, raising=False)
    assert kernels.capability() == runs[-1]
    assert kernels.native().capability() == runs[-1]  # the module says what it was built for
    monkeypatch.setenv(kernels.CAPABILITY_VARIABLE, " DEFAULT ")
    assert kernels.capability() == "default"
    monkeypatch.setenv(kernels.CAPABILITY_VARIABLE, "avx9000")
    with pytest.raises(kernels.KernelsUnavailable, match="not a level"):
        kernels.capability()
    # a level above the CPU's: test_a_level_above_the_cpu_s_is_refused_on_every_host


def lower_levels() -> list[Any]:
    """Each level below this host's best, skipped (with the reason) where the host
    cannot run it (the amx level: a CPU with AMX, and Linux's permission to use its
    tiles)."""
    best = kernels.capability()
    runs = kernels.host_levels()
    return [pytest.param(level, marks=pytest.mark.skipif(
                level not in runs, reason=f"this host cannot run the {level} kernels"))
            for level in kernels.LEVELS if level != best]


def at_level(level: str, script: str) -> None:
    """Run ``script`` (Python) in a process whose kernels are ``level``'s."""
    env = {**os.environ, kernels.CAPABILITY_VARIABLE: level}
    result = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                            text=True, timeout=900, check=False)
    assert result.returncode == 0, result.stderr[-3000:]


def every_kernel(native: Any, cases: dict[str, Any]) -> dict[str, list[torch.Tensor]]:
    """Each elementwise kernel and attention on ``cases``, per dtype."""
    out = {}
    for name, c in cases.items():
        qkv, cos, sin, rows, slots, heads, kv, cap = c["rope"]
        keys, tables = paged(torch.zeros(2, kv, cap, cos.shape[1], dtype=qkv.dtype))
        values = torch.zeros_like(keys)
        rotated = native.rope_store(qkv, cos, sin, keys, values, tables, rows, slots, heads, kv)
        out[name] = [*native.add_rms_norm(*c["norm"], 1e-5), rotated, keys, values,
                     *[native.attend(*a, 0.3) for a in c["attend"]], native.silu_mul(c["silu"]),
                     native.argmax_rows(c["silu"])]
    return out


@pytest.mark.parametrize("level", lower_levels())
def test_every_level_computes_the_same_kernels(native: Any, tmp_path: Path, level: str) -> None:
    """The norm, the rotary embedding, attention (head dims of whole 16-lane chunks and
    not), the activation and the rows' argmax of another level's build: bitwise this
    one's."""
    g = torch.Generator().manual_seed(0)
    cases: dict[str, Any] = {}
    for dtype in (torch.float32, torch.bfloat16):
        name = str(dtype)
        t, heads, kv, cap = 5, 6, 2, 40
        hidden, delta = (torch.randn(t, 72, generator=g).to(dtype) for _ in range(2))
        angles = torch.rand(t, 16, generator=g) * 6
        rows, slots = torch.tensor([0, 1, 1, 0, 1]), torch.tensor([3, 9, 10, 4, 11])
        limits, extras = torch.tensor([3, 9, 10, 1, 39]), torch.tensor([-1, 30, -1, 2, -1])
        cases[name] = {
            "norm": (hidden, delta, torch.rand(72, generator=g).to(dtype)),
            "rope": (torch.randn(t, (heads + 2 * kv) * 32, generator=g).to(dtype),
                     torch.cat([angles.cos()] * 2, -1).to(dtype),
                     torch.cat([angles.sin()] * 2, -1).to(dtype), rows, slots, heads, kv, cap),
            "attend": [(torch.randn(t, heads, dim, generator=g).to(dtype),
                        paged(torch.randn(2, kv, cap, dim, generator=g).to(dtype))[0],
                        paged(torch.randn(2, kv, cap, dim, generator=g).to(dtype))[0],
                        paged(torch.zeros(2, 1, cap, 1))[1], rows, limits, extras)
                       for dim in (64, 24)],
            "silu": (torch.randn(t, 2 * 40, generator=g) * 4).to(dtype)}
    torch.save(cases, tmp_path / "cases.pt")
    at_level(level, "import torch\nfrom runtime.native import kernels\n"
                    "from tests.test_kernels import every_kernel\n"
                    f"native = kernels.native()\nassert native.capability() == {level!r}\n"
                    f"cases = torch.load({str(tmp_path / 'cases.pt')!r})\n"
                    f"torch.save(every_kernel(native, cases), {str(tmp_path / 'out.pt')!r})\n")
    mine, other = every_kernel(native, cases), torch.load(tmp_path / "out.pt")
    for name in cases:
        for index, (a, b) in enumerate(zip(mine[name], other[name], strict=True)):
            assert torch.equal(a, b), (name, index)


@pytest.mark.parametrize("level", lower_levels())
def test_every_level_gives_the_same_logits_and_text(tiny_target_dir: Any, tmp_path: Path,
                                                    level: str) -> None:
    """A whole model on another level's kernels, in float32 and bfloat16, with dense and
    4-bit block matrices: bitwise this level's logits for a prompt and a verify pass, and
    the same greedy text."""
    script = (
        "import sys, torch\n"
        "from runtime.runner.batched import BatchedLM\n"
        "from runtime.runner.passes import BatchItem\n"
        "out = {}\n"
        "for dtype, quantize in (('float32', 'none'), ('bfloat16', 'none'),\n"
        "                        ('float32', 'int4')):\n"
        f"    target = BatchedLM.load({str(tiny_target_dir)!r}, dtype=dtype, quantize=quantize)\n"
        "    assert target.kernels == 'native'\n"
        "    state = target.new_state()\n"
        "    ids = list(range(100, 140))\n"
        "    logits = [target.score(state, ids)]\n"
        "    logits += target.forward_batch([BatchItem(state, [7, 8, 9], 3)])\n"
        "    text = []\n"
        "    for _ in range(12):\n"
        "        token = int(logits[-1][-1].argmax())\n"
        "        step = target.forward_batch([BatchItem(state, [token], 1)])\n"
        "        logits.append(step[0])\n"
        "        text.append(int(step[0][-1].argmax()))\n"
        "    target.release(state)\n"
        "    out[dtype + '-' + quantize] = (logits, text)\n"
        "torch.save(out, sys.argv[1])\n")
    (tmp_path / "run.py").write_text(script)
    here, there = tmp_path / "here.pt", tmp_path / "there.pt"
    result = subprocess.run([sys.executable, str(tmp_path / "run.py"), str(here)],
                            capture_output=True, text=True, timeout=900, check=False)
    assert result.returncode == 0, result.stderr[-3000:]
    at_level(level, f"import runpy, sys\nsys.argv = ['run', {str(there)!r}]\n"
                    f"runpy.run_path({str(tmp_path / 'run.py')!r})\n")
    mine, other = torch.load(here), torch.load(there)
    assert list(mine) == list(other)
    for name, (logits, text) in mine.items():
        assert other[name][1] == text, name
        for a, b in zip(logits, other[name][0], strict=True):
            assert torch.equal(a, b), name


def chain_drafts(model_dir: str) -> dict[str, Any]:
    """The native draft chain over the tiny model as a float32 dense and a bfloat16
    4-bit block model: three sequences' drafts (tokens, confidences, second choices)
    and the keys their caches hold after it."""
    out: dict[str, Any] = {}
    for dtype, quantize in (("float32", "none"), ("bfloat16", "int4")):
        runner = BatchedLM.load(model_dir, dtype=dtype, quantize=quantize)
        assert isinstance(runner, BatchedLM) and runner.chain(runner.vocab_size) is not None
        states = [runner.new_state() for _ in range(3)]
        feeds = [[10, 11, 12, 13], list(range(40, 75)), [7]]
        drafts = runner.draft_chain(states, feeds, [5, 3, 1], runner.vocab_size)
        drafts += runner.draft_chain(states, [[d.tokens[-1]] for d in drafts], [4, 4, 2],
                                     runner.vocab_size)
        keys = [runner.kv(s)[0][0].clone() for s in states]
        out[f"{dtype}-{quantize}"] = ([(d.tokens, d.confidences, d.runner_up) for d in drafts],
                                      keys)
        for state in states:
            runner.release(state)
    return out


@pytest.mark.parametrize("level", lower_levels())
def test_every_level_drafts_the_same_native_chain(tiny_target_dir: Any, tmp_path: Path,
                                                  level: str) -> None:
    """The native draft chain on another level's kernels: bitwise this level's tokens,
    confidences, second choices and cache contents."""
    out = tmp_path / "chain.pt"
    at_level(level, "import torch\nfrom runtime.native import kernels\n"
                    "from tests.test_kernels import chain_drafts\n"
                    f"assert kernels.native().capability() == {level!r}\n"
                    f"torch.save(chain_drafts({str(tiny_target_dir)!r}), {str(out)!r})\n")
    mine, other = chain_drafts(str(tiny_target_dir)), torch.load(out)
    assert list(mine) == list(other)
    for name, (drafts, keys) in mine.items():
        assert other[name][0] == drafts, name  # floats compared exactly
        assert all(torch.equal(a, b) for a, b in zip(keys, other[name][1], strict=True)), name


@pytest.mark.real_model
def test_the_kernels_benchmark_writes_its_table_and_json(
        default_model_dir: object, tmp_path: Any, capsys: pytest.CaptureFixture[str]) -> None:
    from specbench import kernels as bench

    out = tmp_path / "kernels.json"
    assert bench.main(["--precisions", "gguf", "--tokens", "1,3", "--rounds", "1",
                       "--repeats", "2", "--products", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert [(r["precision"], r["tokens"]) for r in report["rows"]] == [("gguf", 1), ("gguf", 3)]
    for row in report["rows"]:
        assert row["torch_ms"] > 0 and row["native_ms"] > 0
        assert row["max_abs_logit_diff"] < 2.0  # the two paths round differently, no more
    printed = capsys.readouterr().out
    assert "native ms" in printed
    shapes = [(r["matrix"], r["tokens"]) for r in report["products"]]
    assert shapes == [(f"{o}x{i}", t) for o, i in bench.SHAPES for t in (1, 3)]
    assert all(r["torch_int4_us"] > 0 and r["block_us"] > 0 for r in report["products"])
    assert all(r["read_floor_us"] > 0 for r in report["products"])
    assert all(r["compute_floor_us"] is None or r["compute_floor_us"] > 0
               for r in report["products"])
    assert "block us" in printed and "compute floor us" in printed


def test_the_lowest_level_passes_the_same_checks() -> None:
    """The kernels built for no vector extensions (``default``: the loops vec.h falls
    back to) take the same checks as this host's level, block and dense products
    included, in a process of their own."""
    if kernels.capability() == "default":
        pytest.skip("this host's level is the lowest: the checks above ran on it")
    env = {**os.environ, kernels.CAPABILITY_VARIABLE: "default"}
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__,
         str(Path(__file__).with_name("test_block_products.py")),
         str(Path(__file__).with_name("test_dense_products.py")), "-k",
         "not lowest_level and not every_level and not benchmark and not cannot_build "
         "and not default_model and not gguf_target and not host_s_best"],
        env=env, capture_output=True, text=True, timeout=900, check=False)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-2000:]
    assert " skipped" not in result.stdout.splitlines()[-1], result.stdout[-2000:]


STACKS = {"blocks": ("bfloat16", "int4", True), "torch-int4": ("bfloat16", "int4", False),
          "dense": ("bfloat16", "none", True), "dense-float32": ("float32", "none", True)}


@pytest.mark.parametrize("stack", list(STACKS))
def test_the_layer_stack_is_the_python_loop_bitwise(tiny_target_dir: Any, stack: str) -> None:
    """A model's layers run as one ``LayerStack`` call: the same logits, bit for bit, as
    the per-layer Python loop over the same kernels, for a prompt, steps and a verify
    pass beside another sequence; with int4 block matrices (int8 activations), PyTorch's
    int4 ones and dense bfloat16 and float32 ones."""
    dtype, quantize, int8_activations = STACKS[stack]
    runner = BatchedLM.load(str(tiny_target_dir), dtype=dtype, quantize=quantize,
                            int8_activations=int8_activations)
    assert isinstance(runner, BatchedLM) and runner.stack.layer_stack is not None
    stack = runner.stack.layer_stack

    def passes() -> list[torch.Tensor]:
        a, b = runner.new_state(), runner.new_state()
        out = runner.forward_batch([BatchItem(a, list(range(30, 70)), 1),
                                    BatchItem(b, list(range(5, 12)), 2)])
        out += runner.forward_batch([BatchItem(a, [7], 1)])
        out += runner.forward_batch([BatchItem(a, [8, 9, 10], 3), BatchItem(b, [11], 1)])
        runner.release(a)
        runner.release(b)
        return out

    with_stack = passes()
    runner.stack.layer_stack = None
    try:
        without = passes()
    finally:
        runner.stack.layer_stack = stack
    assert len(with_stack) == len(without) == 5
    for got, want in zip(with_stack, without, strict=True):
        assert torch.equal(got, want)


@pytest.mark.parametrize(("dtype", "quantize"), [("bfloat16", "int4"), ("bfloat16", "none"),
                                               ("float32", "none")],
                         ids=["blocks", "dense", "dense-float32"])
def test_the_layer_stack_gives_the_same_logits_on_any_team(tiny_target_dir: Any,
                                                          threads: None, dtype: str,
                                                          quantize: str) -> None:
    """A stack pass of a few tokens runs as one team of threads (one parallel region,
    each call's chunks claimed from the team's counter, a wait for them before the next
    call): bit for bit its one-thread logits, whether the pass starts on the main
    thread or on another (as the server's model thread does), and with more threads than
    cores (members preempted mid-pass, their chunks taken by the others), for a step,
    verify passes of 3 and 16 tokens beside another sequence and a prompt longer than a
    team takes."""
    import threading

    runner = BatchedLM.load(str(tiny_target_dir), dtype=dtype, quantize=quantize)
    assert isinstance(runner, BatchedLM) and runner.stack.layer_stack is not None

    def passes(n: int) -> list[torch.Tensor]:
        torch.set_num_threads(n)
        return mixed_passes(runner, range(30, 100))  # a prompt of > 64 tokens

    results: dict[str, list[torch.Tensor]] = {}
    with torch.inference_mode():
        results["one"] = passes(1)
        results["two"] = passes(2)
        results["more than the cores"] = passes(2 * (os.cpu_count() or 1) + 1)

    def elsewhere() -> None:
        with torch.inference_mode():
            results["two, another thread"] = passes(2)

    worker = threading.Thread(target=elsewhere)
    worker.start()
    worker.join()
    for name in ("two", "more than the cores", "two, another thread"):
        assert len(results[name]) == len(results["one"]) == 7
        for got, want in zip(results[name], results["one"], strict=True):
            assert torch.equal(got, want), name


def test_the_layer_stack_checks_its_call_once_and_refuses_bad_ranges(tiny_target_dir: Any) -> None:
    """The block stack checks a pass's index lists once and then runs on raw pointers:
    a cache slot, key range or row out of range, or a cache of the wrong shape, is an
    error, not a read or a write out of bounds."""
    runner = BatchedLM.load(str(tiny_target_dir), dtype="bfloat16", quantize="int4",
                            int8_activations=True)
    loop = runner.stack.layer_stack
    if loop is None:
        pytest.skip("these kernels were built without block products (AVX512-VNNI or AVX2)")
    state = runner.new_state()
    runner.forward_batch([BatchItem(state, [5, 6, 7], 1)])
    hidden = runner.model.model.embed_tokens(torch.tensor([8]))
    cos, sin = runner.stack.rotary(hidden, torch.tensor([3]))
    capacity = len(state.blocks) * runner.stack.keys[0].shape[2]
    good = dict(tables=torch.tensor([state.blocks]), rows=torch.tensor([0]),
                slots=torch.tensor([3]), limits=torch.tensor([4]), extras=torch.tensor([-1]))

    def run(**change: Any) -> torch.Tensor:
        keys = change.pop("keys", runner.stack.keys)
        args = {**good, **change}
        return loop.forward(hidden, cos, sin, keys, runner.stack.values, args["tables"],
                            args["rows"], args["slots"], args["limits"], args["extras"])

    assert run().shape == hidden.shape
    blocks = runner.stack.keys[0].shape[0]
    for bad in (dict(slots=torch.tensor([capacity])), dict(limits=torch.tensor([capacity + 1])),
                dict(limits=torch.tensor([0])), dict(rows=torch.tensor([-1])),
                dict(rows=torch.tensor([1])), dict(tables=torch.tensor([[blocks]])),
                dict(tables=torch.tensor([[-1]])),
                dict(extras=torch.tensor([capacity])), dict(slots=torch.tensor([1, 2])),
                dict(keys=[runner.stack.keys[0],
                           *(k[:, :, :4].contiguous() for k in runner.stack.keys[1:])]),
                dict(keys=[k.transpose(2, 3) for k in runner.stack.keys])):
        with pytest.raises(RuntimeError):
            run(**bad)
    runner.release(state)


def test_the_prefix_cache_namespace_names_the_kernels(tiny_target: CausalLM) -> None:
    """KV computed by one path is never loaded by a replica on the other."""
    from gateway.server import kernels_key

    assert isinstance(tiny_target, BatchedLM)
    assert kernels_key(tiny_target) == f"native-{kernels.source_digest()[:16]}"
    # not the instruction-set level: every level computes the same KV
    assert kernels.capability() not in kernels_key(tiny_target)
    tiny_target.use_kernels("torch")
    try:
        assert kernels_key(tiny_target) == "torch"
    finally:
        tiny_target.use_kernels("auto")


def test_the_rotary_table_is_the_model_s_rotary_embedding_bitwise(tiny_target: CausalLM) -> None:
    """A pass looks its positions' cos/sin up in a table the model's own rotary embedding
    filled (grown as positions pass its end): bitwise what running it per pass gives."""
    from runtime.runner.stack import Rotary

    assert isinstance(tiny_target, BatchedLM)
    module = tiny_target.model.model.rotary_emb
    table = Rotary(module)
    assert table.static
    hidden = torch.zeros(3, tiny_target.model.config.hidden_size, dtype=tiny_target.dtype)
    for positions in ([0], [7, 3, 511], list(range(40)), [1500], [1024, 0, 2047]):
        index = torch.tensor(positions)
        cos, sin = table(hidden, index)
        want_cos, want_sin = module(hidden, index[None])
        assert torch.equal(cos, want_cos[0]) and torch.equal(sin, want_sin[0]), positions
    assert table._cos is not None and table._cos.shape[0] == 2048  # grown once, doubled
    module.rope_type = "dynamic"  # cos/sin that depend on the length: computed per pass
    try:
        per_pass = Rotary(module)
    finally:
        module.rope_type = "default"
    assert not per_pass.static
    cos, _ = per_pass(hidden, torch.tensor([5, 6]))
    assert torch.equal(cos, module(hidden, torch.tensor([[5, 6]]))[0][0])
    assert per_pass._cos is None


def test_the_layer_stack_refuses_matrices_of_the_wrong_kind(tiny_target_dir: Any) -> None:
    """Each matrix's kind is checked against its packing and shape when the stack is made:
    a dense matrix called a block one, PyTorch's int4 mixed with native kinds, or an
    unknown kind is an error, not a misread."""
    runner = BatchedLM.load(str(tiny_target_dir), dtype="bfloat16")
    assert isinstance(runner, BatchedLM) and runner.stack.layer_stack is not None
    mats = [m for w in runner.stack.weights for m in (w.qkv, w.o, w.gate_up, w.down)]
    native = kernels.native()

    def make(kinds: list[int]) -> Any:
        packed = [m.dense for m in mats]
        return native.LayerStack(packed, packed, [m.out_features for m in mats],
                                 [m.bias for m in mats], [w for w, _ in runner.stack.norms],
                                 [e for _, e in runner.stack.norms], 32, runner.heads,
                                 runner.kv_heads, runner.scaling, kinds)

    assert make([16] * len(mats)) is not None
    for kinds in ([4] + [16] * (len(mats) - 1), [0] + [16] * (len(mats) - 1),
                  [16] * (len(mats) - 1) + [0], [3] * len(mats), [16] * (len(mats) - 1),
                  [32] * len(mats)):
        with pytest.raises(RuntimeError):
            make(kinds)


def test_the_norms_the_kernels_hold_are_copies(tiny_target: CausalLM) -> None:
    """The norms a pass (and ``LayerStack``) reads are copies of the model's weights, in
    its dtype, even where no conversion is needed (float32): a view would keep the
    weights file's whole mapping resident once a server lets the model's weights go."""
    from runtime.runner import fused

    assert isinstance(tiny_target, BatchedLM) and tiny_target.dtype == torch.float32
    modules = fused._norms(tiny_target.model)
    assert len(modules) == len(tiny_target.stack.norms)
    for (weight, _), module in zip(tiny_target.stack.norms, modules, strict=True):
        assert torch.equal(weight, module.weight)
        assert weight.untyped_storage().data_ptr() != module.weight.untyped_storage().data_ptr()


def test_a_level_above_the_cpu_s_is_refused_on_every_host(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The CPU's flags faked down to the avx2 level's, so the refusal of a level this
    CPU cannot run is checked whatever the host runs (and never loaded)."""
    monkeypatch.setattr(kernels.platform, "machine", lambda: "x86_64")
    monkeypatch.setattr(kernels, "_cpu_flags", lambda: kernels.LEVELS["avx2"][1])
    assert kernels.host_levels() == ["default", "avx2"]
    monkeypatch.delenv(kernels.CAPABILITY_VARIABLE, raising=False)
    assert kernels.capability() == "avx2"
    monkeypatch.setenv(kernels.CAPABILITY_VARIABLE, "default")
    assert kernels.capability() == "default"
    for level in ("avx512", "avx512_vnni", "amx"):
        monkeypatch.setenv(kernels.CAPABILITY_VARIABLE, level)
        with pytest.raises(kernels.KernelsUnavailable, match="this CPU runs only"):
            kernels.capability()
        with pytest.raises(kernels.KernelsUnavailable, match="this CPU runs only"):
            kernels.native()
