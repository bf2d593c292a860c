"""Prompt/prefix KV reuse and remembered continuations, over a byte store.

A prompt is cut into fixed-size token blocks. Block i's key hashes block
i-1's key with block i's tokens, under a namespace naming the model, its
revision, the KV dtype and this format's version, so the longest cached
prefix is found block by block and a key can never be reused by another model.
The value is the target's KV for that block, in the dtype it was computed in
(nothing is rounded, so a hit gives exactly the output a miss would), in a
compact binary layout with a CRC-32; anything that does not check out is a
miss. A store may return only the first blocks of a long read (the rest None);
what it returned is used and the rest of the prompt is prefilled.

The same store remembers which tokens followed a context (keyed by a hash of
the last ``CONTEXT_TOKENS`` tokens), which feeds the continuation drafter.

Stores are byte key/value maps that never raise: ``InProcessStore`` (the
default, an LRU bounded in bytes) or a Redis store shared by replicas (in the
gateway, since this package does not talk to Redis).
"""

from __future__ import annotations

import hashlib
import struct
import threading
import time
import warnings
import zlib
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, fields
from typing import Protocol

import torch

FORMAT_VERSION = 2
DEFAULT_BLOCK_TOKENS = 64
DEFAULT_MAX_BYTES = 512 * 1024 * 1024
CONTEXT_TOKENS = 8  # tokens hashed to key a remembered continuation
CONTINUATION_TOKENS = 16  # tokens remembered after each context
_MAGIC = b"SSKV"
# magic, format version, layers, kv heads, head dim, tokens, block index, dtype code
_HEADER = struct.Struct("<4sHHHHHHB")
_BODY = 32  # the header padded, so that the tensors start aligned
_CRC = struct.Struct("<I")
# every dtype a KV may be kept in; codes are part of the format
_DTYPES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2, torch.int8: 3,
           torch.uint8: 4, torch.float8_e4m3fn: 5, torch.float8_e5m2: 6}
_DTYPE_BY_CODE = {v: k for k, v in _DTYPES.items()}
_TOKENS = struct.Struct("<I")


class PrefixStore(Protocol):
    """A byte store. Implementations swallow their own failures: a failed get is
    a miss, a failed put is dropped, and both are counted in ``stats``. A get may
    stop early (a slow read): the values it did read come first, the rest None."""

    stats: CacheStats

    def get_many(self, keys: Sequence[bytes]) -> list[bytes | None]: ...

    def put_many(self, items: Sequence[tuple[bytes, bytes]]) -> None: ...

    def flush(self, timeout_s: float = 30.0) -> bool:
        """Wait until the writes made so far are readable (False: ``timeout_s`` passed)."""
        ...


@dataclass
class CacheStats:
    """Counters read by the metrics exporter (monotonic)."""

    lookups: int = 0  # prefix lookups (one per request)
    hits: int = 0  # lookups that reused at least one block
    hit_tokens: int = 0  # prompt tokens whose KV was reused
    partial_hits: int = 0  # hits that reused only some of the prompt's full blocks
    fetched_bytes: int = 0  # bytes of KV blocks read from the store
    reads_cut: int = 0  # store reads cut short at a block boundary (slow, not failed)
    puts_dropped: int = 0  # writes dropped because too much was waiting to be written
    continuation_lookups: int = 0
    continuation_hits: int = 0
    errors: int = 0  # store failures and rejected (corrupt) values
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def add(self, **counts: int) -> None:
        with self.lock:
            for name, value in counts.items():
                setattr(self, name, getattr(self, name) + value)

    def counts(self) -> dict[str, int]:
        """Every counter by name (what the metrics exporter reads)."""
        with self.lock:
            return {f.name: getattr(self, f.name) for f in fields(self) if f.name != "lock"}


class InProcessStore:
    """An LRU dictionary bounded in bytes, with an optional time to live."""

    def __init__(self, max_bytes: int = DEFAULT_MAX_BYTES, ttl_s: float | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.max_bytes = max_bytes
        self.ttl_s = ttl_s
        self._clock = clock
        self.stats = CacheStats()
        self._items: OrderedDict[bytes, tuple[bytes, float]] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()

    @property
    def size_bytes(self) -> int:
        return self._bytes

    def get_many(self, keys: Sequence[bytes]) -> list[bytes | None]:
        now = self._clock()
        out: list[bytes | None] = []
        with self._lock:
            for key in keys:
                item = self._items.get(key)
                if item is not None and self.ttl_s is not None and now - item[1] > self.ttl_s:
                    self._drop(key)
                    item = None
                if item is not None:
                    self._items.move_to_end(key)
                out.append(item[0] if item else None)
        return out

    def put_many(self, items: Sequence[tuple[bytes, bytes]]) -> None:
        now = self._clock()
        with self._lock:
            for key, value in items:
                if len(value) > self.max_bytes:
                    continue
                if key in self._items:
                    self._drop(key)
                self._items[key] = (value, now)
                self._bytes += len(value) + len(key)
                while self._bytes > self.max_bytes:
                    self._drop(next(iter(self._items)))

    def flush(self, timeout_s: float = 30.0) -> bool:
        return True  # writes are readable at once

    def _drop(self, key: bytes) -> None:
        value, _ = self._items.pop(key)
        self._bytes -= len(value) + len(key)


@dataclass(frozen=True)
class PrefixHit:
    tokens: int  # how many prompt tokens the KV covers
    kv: list[tuple[torch.Tensor, torch.Tensor]]  # per layer: [1, heads, tokens, head_dim] each


class PrefixCache:
    """Block-chained KV reuse and continuations for one model over a store."""

    def __init__(
        self,
        store: PrefixStore,
        namespace: str,
        block_tokens: int = DEFAULT_BLOCK_TOKENS,
        max_prefix_tokens: int | None = None,
    ) -> None:
        if block_tokens < 1:
            raise ValueError("block_tokens must be >= 1")
        self.store = store
        self.namespace = f"{namespace}|v{FORMAT_VERSION}".encode()
        self.block_tokens = block_tokens
        self.max_prefix_tokens = max_prefix_tokens

    @property
    def stats(self) -> CacheStats:
        return self.store.stats

    # -- prefix KV -----------------------------------------------------------------

    def block_keys(self, token_ids: Sequence[int]) -> list[bytes]:
        """Keys of the full blocks of ``token_ids``, each chained to the one before."""
        keys: list[bytes] = []
        previous = hashlib.blake2b(self.namespace, digest_size=20).digest()
        size = self.block_tokens
        limit = len(token_ids) if self.max_prefix_tokens is None else min(
            len(token_ids), self.max_prefix_tokens)
        for start in range(0, limit - size + 1, size):
            block = struct.pack(f"<{size}I", *token_ids[start : start + size])
            previous = hashlib.blake2b(previous + block, digest_size=20).digest()
            keys.append(b"kv:" + previous)
        return keys

    def lookup(self, prompt_ids: Sequence[int], layers: int) -> PrefixHit | None:
        """The KV of the longest cached prefix, leaving at least one token to prefill."""
        keys = self.block_keys(prompt_ids[:-1])
        self.stats.add(lookups=1)
        if not keys:
            return None
        values = self.store.get_many(keys)
        blocks: list[list[tuple[torch.Tensor, torch.Tensor]]] = []
        fetched = 0
        for index, value in enumerate(values):
            if value is None:
                break
            fetched += len(value)
            kv = _decode_block(value, index, layers, self.block_tokens)
            if kv is None:
                self.stats.add(errors=1)
                break
            blocks.append(kv)
        self.stats.add(fetched_bytes=fetched)
        if not blocks:
            return None
        merged = [  # one copy out of the fetched bytes
            (torch.cat([b[layer][0] for b in blocks], dim=2),
             torch.cat([b[layer][1] for b in blocks], dim=2))
            for layer in range(layers)
        ]
        tokens = len(blocks) * self.block_tokens
        self.stats.add(hits=1, hit_tokens=tokens, partial_hits=int(len(blocks) < len(keys)))
        return PrefixHit(tokens=tokens, kv=merged)

    def store_prefix(
        self,
        prompt_ids: Sequence[int],
        kv: Sequence[tuple[torch.Tensor, torch.Tensor]],  # per layer [1, heads, >= n, dim]
        skip_blocks: int = 0,
    ) -> None:
        """Store the full blocks of the prompt not already cached."""
        keys = self.block_keys(prompt_ids[:-1])
        size = self.block_tokens
        items = []
        staging = torch.empty(block_bytes(kv, size), dtype=torch.uint8) if kv else None
        for index in range(skip_blocks, len(keys)):
            start = index * size
            block = [(k[:, :, start : start + size], v[:, :, start : start + size]) for k, v in kv]
            items.append((keys[index], _encode_block(block, index, staging)))
        if items:
            self.store.put_many(items)

    # -- continuations -------------------------------------------------------------

    def continuation_key(self, context: Sequence[int]) -> bytes:
        packed = struct.pack(f"<{len(context)}I", *context)
        return b"next:" + hashlib.blake2b(self.namespace + packed, digest_size=20).digest()

    def continuation(self, token_ids: Sequence[int]) -> tuple[int, ...]:
        """Tokens that followed the last CONTEXT_TOKENS tokens before, if remembered."""
        if len(token_ids) < CONTEXT_TOKENS:
            return ()
        self.stats.add(continuation_lookups=1)
        value = self.store.get_many([self.continuation_key(token_ids[-CONTEXT_TOKENS:])])[0]
        tokens = _decode_tokens(value) if value is not None else None
        if value is not None and tokens is None:
            self.stats.add(errors=1)
        if tokens:
            self.stats.add(continuation_hits=1)
        return tokens or ()

    def remember(self, token_ids: Sequence[int], start: int) -> None:
        """Remember what followed every context ending at or after ``start``."""
        items = []
        for end in range(max(start, CONTEXT_TOKENS), len(token_ids)):
            following = token_ids[end : end + CONTINUATION_TOKENS]
            items.append((self.continuation_key(token_ids[end - CONTEXT_TOKENS : end]),
                          _encode_tokens(following)))
        if items:
            self.store.put_many(items)


def _encode_block(kv: Sequence[tuple[torch.Tensor, torch.Tensor]], index: int,
                  staging: torch.Tensor | None = None) -> bytes:
    """Header, each layer's keys then values as they are in memory, CRC-32.
    ``staging``: a uint8 buffer of the value's size to reuse (fresh memory is slow)."""
    first = kv[0][0]  # [1, heads, tokens, head_dim]
    _, heads, tokens, head_dim = first.shape
    header = _HEADER.pack(_MAGIC, FORMAT_VERSION, len(kv), heads, head_dim, tokens, index,
                          _DTYPES[first.dtype])
    per_tensor = first.numel() * first.element_size()
    size = _BODY + 2 * len(kv) * per_tensor
    buffer = staging if staging is not None else torch.zeros(size + _CRC.size, dtype=torch.uint8)
    raw = buffer.numpy()
    raw[:_BODY] = 0
    raw[: _HEADER.size] = memoryview(header)
    offset = _BODY
    for k, v in kv:
        for t in (k, v):  # one copy from the (strided) cache into the value
            buffer[offset : offset + per_tensor].view(t.dtype).view(t.shape).copy_(t)
            offset += per_tensor
    view = memoryview(raw.data)
    _CRC.pack_into(view, size, zlib.crc32(view[:size]))
    return raw.tobytes()


def block_bytes(kv: Sequence[tuple[torch.Tensor, torch.Tensor]], tokens: int) -> int:
    """The size of one encoded block of ``tokens`` positions of this KV."""
    first = kv[0][0]  # [1, heads, length, head_dim]
    return _BODY + 2 * len(kv) * first.shape[1] * tokens * first.shape[3] * first.element_size() \
        + _CRC.size


def _decode_block(
    value: bytes, index: int, layers: int, block_tokens: int
) -> list[tuple[torch.Tensor, torch.Tensor]] | None:
    """Parse and check one block into read-only views of ``value``; None if anything
    is off (a corrupt value is a miss)."""
    if len(value) < _BODY + _CRC.size:
        return None
    payload = memoryview(value)[: -_CRC.size]
    if zlib.crc32(payload) != _CRC.unpack_from(value, len(payload))[0]:
        return None
    magic, version, n_layers, heads, head_dim, tokens, stored_index, code = _HEADER.unpack_from(
        payload)
    dtype = _DTYPE_BY_CODE.get(code)
    if (magic != _MAGIC or version != FORMAT_VERSION or n_layers != layers or dtype is None
            or tokens != block_tokens or stored_index != index):
        return None
    per_tensor = heads * tokens * head_dim * torch.empty((), dtype=dtype).element_size()
    if len(payload) != _BODY + 2 * layers * per_tensor:
        return None
    with warnings.catch_warnings():  # the views are only read (copied out by the caller)
        warnings.simplefilter("ignore", UserWarning)
        flat = torch.frombuffer(payload, dtype=torch.uint8, offset=_BODY)
    out = []
    for layer in range(layers):
        tensors = []
        for j in range(2):
            offset = (2 * layer + j) * per_tensor
            raw = flat[offset : offset + per_tensor].view(dtype)
            tensors.append(raw.view(1, heads, tokens, head_dim))
        out.append((tensors[0], tensors[1]))
    return out


def _encode_tokens(tokens: Sequence[int]) -> bytes:
    body = struct.pack(f"<{len(tokens)}I", *tokens)
    return _TOKENS.pack(len(tokens)) + body + hashlib.blake2b(body, digest_size=8).digest()


def _decode_tokens(value: bytes) -> tuple[int, ...] | None:
    if len(value) < _TOKENS.size + 8:
        return None
    (count,) = _TOKENS.unpack_from(value)
    body = value[_TOKENS.size : -8]
    if len(body) != 4 * count or hashlib.blake2b(body, digest_size=8).digest() != value[-8:]:
        return None
    return struct.unpack(f"<{count}I", body)
