"""What a prefix-cache hit costs besides the transfer: encoding a prefix's KV into
blocks, checking and loading them back, and the checksum alone (CRC-32, which the
format uses, against BLAKE2b-128, which it used before), for the default model's
KV shape (30 layers, 3 KV heads, head dim 64) in float32 and bfloat16.

    python -m specbench.prefix_codec [--tokens 2048] [--json PATH]

Prints a table (best of ``--repeats``) and writes JSON.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import time
import uuid
import zlib
from collections.abc import Callable
from pathlib import Path

import torch

from decoding.prefix_cache import InProcessStore, PrefixCache

LAYERS, KV_HEADS, HEAD_DIM = 30, 3, 64


def _best(fn: Callable[[], object], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def measure(tokens: int, dtype: torch.dtype, repeats: int) -> dict[str, object]:
    kv = [(torch.randn(1, KV_HEADS, tokens + 1, HEAD_DIM).to(dtype),
           torch.randn(1, KV_HEADS, tokens + 1, HEAD_DIM).to(dtype)) for _ in range(LAYERS)]
    ids = list(range(tokens + 1))
    store = InProcessStore(max_bytes=4 << 30)
    cache = PrefixCache(store, f"codec-{uuid.uuid4().hex}")
    encode_s = _best(lambda: cache.store_prefix(ids, kv), repeats)
    hit = cache.lookup(ids, LAYERS)
    assert hit is not None and torch.equal(hit.kv[3][1], kv[3][1][:, :, : hit.tokens])
    lookup_s = _best(lambda: cache.lookup(ids, LAYERS), repeats)
    values = b"".join(v for v in store.get_many(cache.block_keys(ids[:-1])) if v is not None)
    crc_s = _best(lambda: zlib.crc32(values), repeats)
    blake_s = _best(lambda: hashlib.blake2b(values, digest_size=16).digest(), repeats)
    return {"dtype": str(dtype).removeprefix("torch."), "tokens": hit.tokens,
            "bytes": len(values), "encode_s": encode_s, "lookup_s": lookup_s,
            "crc32_s": crc_s, "blake2b_s": blake_s}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", default="bench-results/prefix_codec.json")
    args = parser.parse_args()
    rows = [measure(args.tokens, dtype, args.repeats) for dtype in (torch.float32, torch.bfloat16)]
    print(f"{'dtype':<10}{'tokens':>8}{'MB':>8}{'encode':>9}{'lookup':>9}{'crc32':>9}{'blake2b':>9}")
    for r in rows:
        print(f"{r['dtype']!s:<10}{r['tokens']:>8}{int(r['bytes']) / 1e6:>8.1f}"  # type: ignore[call-overload]
              + "".join(f"{float(r[k]) * 1000:>7.0f}ms"  # type: ignore[arg-type]
                        for k in ("encode_s", "lookup_s", "crc32_s", "blake2b_s")))
    out = Path(args.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"rows": rows}, indent=2))
    print(f"wrote {out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
