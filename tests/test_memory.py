"""What a served model need not hold: oneDNN primitives for a bounded set of row counts,
an input embedding read from the weights file, a draft's embedding converted as it is
looked up. Each keeps every logit bitwise."""

from __future__ import annotations

import json
import os
import random
import struct
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from torch import nn

from runtime.drafts import draft_format
from runtime.matrices import weights
from runtime.models.skeleton import ConvertedEmbedding, Embedding
from runtime.runner.batched import BatchedLM
from runtime.runner.memory import FileRows

NAME = "model.embed_tokens.weight"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_a_file_s_rows_are_read_as_it_stores_them(tmp_path: Path, dtype: torch.dtype) -> None:
    table = torch.randn(300, 24).to(dtype)
    file = tmp_path / "model.safetensors"
    save_file({"other": torch.zeros(3), NAME: table, "bias": torch.ones(5)}, str(file))
    rows = FileRows.open(file, NAME)
    assert rows is not None and rows.shape == (300, 24) and rows.dtype == dtype
    ids = torch.tensor([[0, 299, 7], [7, 150, 1]])
    assert torch.equal(rows(ids), table[ids])  # any shape of ids, repeats too
    assert torch.equal(rows(torch.tensor([], dtype=torch.long)), table[:0])
    assert torch.equal(rows.span(10, 20), table[10:20])
    assert FileRows.open(file, "missing") is None
    assert FileRows.open(file, "bias") is None  # not a matrix
    with pytest.raises(IndexError, match="row 300 out of range"):
        rows(torch.tensor([300]))
    with pytest.raises(IndexError):
        rows(torch.tensor([-1]))
    rows.close()
    with pytest.raises(ValueError, match="closed"):
        rows(torch.tensor([0]))


def test_a_file_cut_short_fails_the_lookup_not_the_process(tmp_path: Path) -> None:
    file = tmp_path / "model.safetensors"
    save_file({NAME: torch.randn(64, 16)}, str(file))
    rows = FileRows.open(file, NAME)
    assert rows is not None
    with open(file, "rb") as f:
        header = 8 + struct.unpack("<Q", f.read(8))[0]
    assert json.loads(file.read_bytes()[8:header])[NAME]["shape"] == [64, 16]
    with open(file, "r+b") as f:  # rewritten in place, shorter (what must not happen)
        f.truncate(header + 10 * 16 * 4)
    assert rows(torch.tensor([3])).shape == (1, 16)
    with pytest.raises(OSError, match="shorter"):
        rows(torch.tensor([40]))


def test_packed_products_run_a_few_row_counts_and_each_row_as_alone(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """oneDNN builds a primitive per row count it runs: calls of any row count run as one of
    ``ONEDNN_ROWS`` (zero rows padded), and each row comes out bitwise as it does alone."""
    if torch.float32 not in weights.onednn_dtypes():
        pytest.skip("this PyTorch build's oneDNN does not pack float32")
    seen: set[int] = set()
    linear = weights.onednn_linear

    def recorded(x: torch.Tensor, packed: torch.Tensor,
                 bias: torch.Tensor | None) -> torch.Tensor:
        seen.add(x.shape[0])
        return linear(x, packed, bias)

    monkeypatch.setattr(weights, "onednn_linear", recorded)
    torch.manual_seed(0)
    for dtype in sorted(weights.onednn_dtypes(), key=str):
        matrix = weights.Matrix(torch.randn(80, 1000).to(dtype), torch.randn(80).to(dtype))
        x = torch.randn(weights.ONEDNN_MAX_TOKENS + 9, 1000).to(dtype)
        alone = torch.cat([matrix(x[i : i + 1]) for i in range(x.shape[0])])
        for n in range(1, x.shape[0] + 1):
            got = matrix(x[:n])
            assert got.shape == (n, 80) and got.is_contiguous()
            assert torch.equal(got, alone[:n]), (dtype, n)
    assert seen == set(weights.ONEDNN_ROWS)


def test_a_float32_target_and_its_bfloat16_draft_hold_no_embedding_table(
        default_model_dir: Path) -> None:
    """The server's float32 default model beside the shipped draft in bfloat16: the draft
    converts the target's rows as it looks them up, the target (its tied head packed)
    reads them from its head's native packing once the server lets its plain weights go
    (from its weights file on PyTorch's path: tests/test_batched.py), and neither changes
    a logit of either model."""
    target = BatchedLM.load(str(default_model_dir), dtype="float32")
    directory = draft_format.resolve_draft_dir(draft_format.DEFAULT_DRAFT)
    assert directory is not None
    draft = draft_format.load_causal_lm(directory, target, "bfloat16")
    assert isinstance(draft, BatchedLM)
    converted = draft.model.model.embed_tokens
    assert isinstance(converted, ConvertedEmbedding)
    assert converted.weight.numel() == 0 and draft.model.dtype == torch.bfloat16
    assert not any(p.numel() == target.model.model.embed_tokens.weight.numel()
                   for p in draft.model.parameters())  # no copy of the table
    ids = [random.Random(1).randrange(target.vocab_size) for _ in range(24)]

    def logits(model: BatchedLM) -> torch.Tensor:
        state = model.new_state()
        try:
            return model.score(state, ids)
        finally:
            model.release(state)

    table = target.model.model.embed_tokens.weight.detach().clone()
    target_before, draft_before = logits(target), logits(draft)
    draft.model.model.embed_tokens = nn.Embedding.from_pretrained(table.to(torch.bfloat16))
    assert torch.equal(logits(draft), draft_before)  # as a converted copy of the table
    draft.model.model.embed_tokens = converted
    if not target.release_plain_weights():
        pytest.skip("this PyTorch build packs no float32 matrix (no oneDNN)")
    embed = target.model.model.embed_tokens
    assert isinstance(embed, Embedding) and embed.rows == target.stack.head.take
    assert embed.weight.numel() == 0
    assert torch.equal(embed(torch.arange(target.vocab_size)), table)
    assert torch.equal(logits(target), target_before)
    assert torch.equal(logits(draft), draft_before)


# In a fresh process: a 24 MiB block freed (glibc then raises its mapping threshold to it),
# fifteen 8 MiB blocks written, a 2 MiB block above them, the fifteen freed. Prints how far
# RSS stayed above where it was before the fifteen.
_HEAP_PROBE = """
import ctypes, os, sys
from runtime.runner.memory import map_large_allocations
libc = ctypes.CDLL("libc.so.6")
libc.malloc.restype = ctypes.c_void_p
libc.malloc.argtypes = [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
if sys.argv[1] == "mapped":
    assert map_large_allocations()
def rss():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
libc.free(libc.malloc(24 << 20))
before = rss()
blocks = [libc.malloc(8 << 20) for _ in range(15)]
for b in blocks:
    ctypes.memset(b, 1, 8 << 20)
top = libc.malloc(2 << 20)  # too big for any hole below: from the heap's top
for b in blocks:
    libc.free(b)
print((rss() - before) >> 20)
"""


def test_large_allocations_go_back_to_the_system_when_freed() -> None:
    """Freed blocks of 4 MiB or more leave the server's RSS (``map_large_allocations``,
    which ``specserve serve`` calls first). The control shows what it prevents: glibc's
    raised threshold puts them on the heap, where 120 MiB freed stays resident."""
    def kept_mib(mode: str, **env: str) -> int:
        clean = {k: v for k, v in os.environ.items() if k != "MALLOC_MMAP_THRESHOLD_"}
        out = subprocess.run([sys.executable, "-c", _HEAP_PROBE, mode], check=True,
                             capture_output=True, text=True, timeout=120, env=clean | env)
        return int(out.stdout.strip().splitlines()[-1])

    assert kept_mib("heap") >= 100
    assert kept_mib("mapped") <= 8
    with pytest.raises(subprocess.CalledProcessError):  # the operator's setting wins
        kept_mib("mapped", MALLOC_MMAP_THRESHOLD_="33554432")


# In a fresh process: what `specserve serve` sets before it stops at a metrics port in use,
# then whether blocks just below and at the threshold get mappings of their own (glibc marks
# a mapped chunk in its size word), after a 24 MiB block freed (which raises glibc's own
# threshold above both, where none was set). Prints the exit status and the two answers.
_SERVE_PROBE = """
import ctypes, socket, sys
from specserve.cli import main
busy = socket.socket()
busy.bind(("127.0.0.1", 0))
busy.listen()
if sys.argv[1] == "serve":
    code = main(["serve", "--host", "127.0.0.1", "--metrics-port",
                 str(busy.getsockname()[1])])
else:
    code = 0
libc = ctypes.CDLL("libc.so.6")
libc.malloc.restype = ctypes.c_void_p
libc.malloc.argtypes = [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
IS_MMAPPED = 2
def mapped(size):
    block = libc.malloc(size)
    head = ctypes.c_size_t.from_address(block - ctypes.sizeof(ctypes.c_size_t)).value
    libc.free(block)
    return int(bool(head & IS_MMAPPED))
libc.free(libc.malloc(24 << 20))
print(code, mapped((4 << 20) - (64 << 10)), mapped(4 << 20))
"""


def test_serve_maps_allocations_from_4_mib_apart() -> None:
    """`specserve serve` sets glibc's mapping threshold to 4 MiB before anything else, as
    glibc then holds it: a block of 4 MiB gets a mapping of its own, one 64 KiB smaller
    comes from the heap, and freeing a larger mapped block leaves the threshold where it
    was set. The control, with nothing set, shows glibc's own rising threshold."""
    def probe(mode: str) -> list[int]:
        clean = {k: v for k, v in os.environ.items()
                 if k != "MALLOC_MMAP_THRESHOLD_" and not k.startswith("SPECSERVE_")}
        out = subprocess.run([sys.executable, "-c", _SERVE_PROBE, mode], check=True,
                             capture_output=True, text=True, timeout=300, env=clean)
        return [int(word) for word in out.stdout.strip().splitlines()[-1].split()]

    code, below, at = probe("serve")
    assert code == 2  # stopped at the metrics port in use, after setting the threshold
    assert (below, at) == (0, 1), "serve left glibc's mapping threshold unset or not at 4 MiB"
    _, _, control_at = probe("control")
    assert control_at == 0  # glibc's own threshold rose past 4 MiB
