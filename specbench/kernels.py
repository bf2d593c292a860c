"""The fused CPU kernels against PyTorch's ops: one-token steps and verify passes of a
few tokens, per precision, the two paths interleaved on the same loaded weights.

    python -m specbench.kernels --json bench-results/kernels.json
    python -m specbench.kernels --target model.gguf --precisions gguf --paths native

Prints a table (median ms a pass at a 300-token context, each pass's ratio to the first
token count's, how far the two paths' logits are apart, and the pass's two floors at the
threads in use: reading its weights at the memory bandwidth measured here, and its
multiply-adds at the MACs a core's cycle of the loaded level gives) and writes JSON.
``--paths native`` times the native kernels alone. ``--target`` takes any
target a server takes (a GGUF file, a model directory; default: the default model); the
table gives the bytes a one-token step reads (every layer matrix and the head as the
products hold them; for a GGUF file also the file's own bytes of those tensors) and the
step against its read floor. With ``--products``, also each of
the default model's matrix shapes as PyTorch's int4 product against the native block
product with int8 activations (``runtime.matrices.quantized.BlockMatrix``), the same codes,
interleaved, beside
the block product's two floors at the threads in use: reading its bytes at the memory
bandwidth measured here, and its multiply-adds at the int8 MACs a core's cycle of the
loaded instruction-set level gives (``INT8_MACS_PER_CYCLE``) and the clock in
/proc/cpuinfo (or ``--ghz``).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from typing import Any

import torch

from runtime.loaders.loading import load_target
from runtime.runner.batched import BatchedLM
from runtime.runner.passes import BatchItem
from specbench.compare import json_output, write_json

MS = 1000.0
CONTEXT = 300
PRECISIONS = {"gguf": ("bfloat16", "auto"), "bfloat16": ("bfloat16", "none"),
              "float32": ("float32", "none"),
              "gguf-float32": ("float32", "auto")}  # the server's default
PATHS = ("torch", "native")


def _pass_ms(target: BatchedLM, tokens: int, repeats: int) -> tuple[float, torch.Tensor]:
    """Median ms of a pass adding ``tokens`` after a ``CONTEXT``-token prompt, and the
    logits of one such pass."""
    state = target.new_state()
    try:
        target.forward_batch([BatchItem(state, [100 + i % 900 for i in range(CONTEXT)], 1)])
        new = [123 + i for i in range(tokens)]
        logits = target.forward_batch([BatchItem(state, new, tokens)])[0].float()
        times = []
        for _ in range(repeats):
            target.rollback(state, CONTEXT)
            start = time.perf_counter()
            target.forward_batch([BatchItem(state, new, tokens)])
            times.append(time.perf_counter() - start)
        return statistics.median(times) * MS, logits
    finally:
        target.release(state)


def step_macs(target: BatchedLM) -> int:
    """Multiply-adds of one token's pass through the matrices: every layer's and the
    head's (attention's are a few percent at this context)."""
    config = target.model.config
    hidden, inner = config.hidden_size, config.intermediate_size
    attended = target.heads * target.head_dim
    width = (target.heads + 2 * target.kv_heads) * target.head_dim
    layer = hidden * width + attended * hidden + hidden * 2 * inner + inner * hidden
    return config.num_hidden_layers * layer + hidden * config.vocab_size


def run(args: argparse.Namespace) -> dict[str, Any]:
    from runtime.native import kernels
    from specbench.concurrency import measure_bandwidth
    from specbench.quant import step_bytes

    if args.threads:
        torch.set_num_threads(args.threads)
    threads = torch.get_num_threads()
    paths = args.paths.split(",")
    level = kernels.capability()
    ghz = args.ghz or clock_ghz()
    bandwidth = measure_bandwidth()  # bytes a second
    rows = []
    file_bytes = file_matrix_bytes(args.target) if args.target.endswith(".gguf") else None
    for name in args.precisions.split(","):
        dtype, quantize = PRECISIONS[name]
        target = load_target(args.target, dtype, quantize=quantize)
        assert isinstance(target, BatchedLM)
        read_bytes = step_bytes(target)
        read_ms = read_bytes / bandwidth * MS
        per_cycle = (INT8_MACS_PER_CYCLE if name == "gguf" else FLOAT_MACS_PER_CYCLE)[level]
        macs_per_ms = per_cycle * threads * ghz * 1e6 if ghz else None
        first: float | None = None
        for tokens in (int(t) for t in args.tokens.split(",")):
            times: dict[str, list[float]] = {p: [] for p in paths}
            logits: dict[str, torch.Tensor] = {}
            for _ in range(args.rounds):  # interleaved: machine noise hits both alike
                for path in paths:
                    target.use_kernels(path)
                    ms, logits[path] = _pass_ms(target, tokens, args.repeats)
                    times[path].append(ms)
            ms_of = {p: statistics.median(times[p]) for p in paths}
            native_ms = ms_of.get("native", ms_of[paths[-1]])
            first = first or native_ms
            row: dict[str, Any] = {
                "precision": name, "tokens": tokens,
                "torch_ms": round(ms_of["torch"], 2) if "torch" in ms_of else None,
                "native_ms": round(native_ms, 2),
                "native_min_ms": round(min(times.get("native", times[paths[-1]])), 2),
                "ratio_to_first": round(native_ms / first, 2),
                "read_mb": round(read_bytes / 1e6, 1),
                "file_matrix_mb": None if file_bytes is None else round(file_bytes / 1e6, 1),
                "read_floor_ms": round(read_ms, 2),
                "to_floor": round(native_ms / read_ms, 2),
                "compute_floor_ms": None if macs_per_ms is None
                else round(step_macs(target) * tokens / macs_per_ms, 2)}
            if len(paths) == 2:
                row |= {"speedup": round(ms_of["torch"] / native_ms, 2),
                        "max_abs_logit_diff": round(float(
                            (logits["torch"] - logits["native"]).abs().max()), 4),
                        "same_argmax": bool(torch.equal(logits["torch"].argmax(-1),
                                                        logits["native"].argmax(-1)))}
            rows.append(row)
            print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
        del target
    return {"target": args.target, "context": CONTEXT, "threads": threads, "level": level,
            "ghz": round(ghz, 2) if ghz else None,
            "bandwidth_gb_s": round(bandwidth / 1e9, 1), "rows": rows}


# int8 multiply-adds a core's cycle gives in the block product at each level, one vector
# multiply a cycle: avx512_vnni's vpdpbusd (64 on 512 bits); avx512 and avx2 build the
# 256-bit pair vpmaddubsw + vpmaddwd (32 per two multiplies); default is scalar; amx (a
# pass of 2 or more tokens) one TDPBSUD of 16 tokens x 16 rows x a block of 32 inputs
# every 16 cycles (the throughput Intel's optimization manual gives; unmeasured here)
INT8_MACS_PER_CYCLE = {"amx": 512, "avx512_vnni": 64, "avx512": 16, "avx2": 16, "default": 1}
# float32 multiply-adds a core's cycle gives in the dense products, one vector FMA a cycle
FLOAT_MACS_PER_CYCLE = {"amx": 16, "avx512_vnni": 16, "avx512": 16, "avx2": 8, "default": 1}


def file_matrix_bytes(path: str) -> int:
    """The GGUF file's bytes of the tensors a one-token step reads: every matrix but the
    input embedding (whose one row a step looks up), the head included."""
    from pathlib import Path

    from runtime.files import gguf_file

    tensors = gguf_file.read(Path(path)).tensors
    head = "output.weight" if "output.weight" in tensors else "token_embd.weight"
    return sum(int(t.data.nbytes) for name, t in tensors.items()
               if len(t.shape) > 1 and (name != "token_embd.weight" or name == head))


def clock_ghz() -> float | None:
    """The fastest core clock /proc/cpuinfo reports now, in GHz (None where it says none)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as info:
            mhz = [float(line.split(":")[1]) for line in info if line.startswith("cpu MHz")]
    except OSError:
        return None
    return max(mhz) / 1000 if mhz else None


# the default model's matrices (out, in): q/k/v, o, gate/up, down, the head
SHAPES = ((960, 576), (576, 576), (3072, 576), (576, 1536), (49152, 576))


def _call_us(product: Any, x: torch.Tensor, repeats: int) -> float:
    product(x)
    start = time.perf_counter()
    for _ in range(repeats):
        product(x)
    return (time.perf_counter() - start) / repeats * 1e6


def products(args: argparse.Namespace) -> list[dict[str, Any]]:
    """PyTorch's int4 product against the block product, per shape and token count."""
    from runtime.matrices.quantized import BlockMatrix, Int4Matrix, quantize_int4
    from runtime.native import kernels
    from specbench.concurrency import measure_bandwidth

    native = kernels.native()
    level = kernels.capability()
    threads = torch.get_num_threads()
    ghz = args.ghz or clock_ghz()
    ghz = round(ghz, 2) if ghz else None
    macs_per_us = (INT8_MACS_PER_CYCLE[level] * threads * ghz * 1e3) if ghz else None
    bandwidth = measure_bandwidth()  # bytes a second
    rows = []
    g = torch.Generator().manual_seed(0)
    for out, inputs in SHAPES:
        codes = quantize_int4(torch.randn(out, inputs, generator=g) / 20)
        pair = {"torch-int4": Int4Matrix(codes), "block": BlockMatrix.int4(native, codes)}
        repeats = max(5, 2_000_000 // (out * inputs) * 20)
        for tokens in (int(t) for t in args.tokens.split(",")):
            x = torch.randn(tokens, inputs, generator=g).to(torch.bfloat16)
            times: dict[str, list[float]] = {name: [] for name in pair}
            for _ in range(args.rounds):
                for name, product in pair.items():
                    times[name].append(_call_us(product, x, repeats))
            torch_us, block_us = (statistics.median(times[n]) for n in pair)
            block = pair["block"]
            assert isinstance(block, BlockMatrix)
            read_us = block.packed.numel() * block.packed.element_size() / bandwidth * 1e6
            compute_us = out * inputs * tokens / macs_per_us if macs_per_us else None
            rows.append({"matrix": f"{out}x{inputs}", "tokens": tokens,
                         "torch_int4_us": round(torch_us, 1), "block_us": round(block_us, 1),
                         "speedup": round(torch_us / block_us, 2),
                         "read_floor_us": round(read_us, 1),
                         "compute_floor_us": None if compute_us is None
                         else round(compute_us, 1),
                         "level": level, "threads": threads, "ghz": ghz,
                         "bandwidth_gb_s": round(bandwidth / 1e9, 1)})
            print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    return rows


def format_table(report: dict[str, Any]) -> str:
    def cell(row: dict[str, Any], key: str, suffix: str = "") -> str:
        return "-" if row.get(key) is None else f"{row[key]}{suffix}"

    lines = ["precision | tokens | torch ms | native ms | native min ms | / first | "
             "MB read | file's MB | read floor ms | / floor | compute floor ms | speed-up | "
             "max abs logit diff | same argmax",
             "---|---|---|---|---|---|---|---|---|---|---|---|---|---"]
    lines += [f"{r['precision']} | {r['tokens']} | {cell(r, 'torch_ms')} | {r['native_ms']} | "
              f"{r['native_min_ms']} | {r['ratio_to_first']}x | {r['read_mb']} | "
              f"{cell(r, 'file_matrix_mb')} | {r['read_floor_ms']} | {r['to_floor']}x | "
              f"{cell(r, 'compute_floor_ms')} | {cell(r, 'speedup', 'x')} | "
              f"{cell(r, 'max_abs_logit_diff')} | {cell(r, 'same_argmax')}"
              for r in report["rows"]]
    lines.append(f"{report['target']}: context {report['context']} tokens, "
                 f"{report['threads']} threads, "
                 f"{report['level']}; floors: {report['bandwidth_gb_s']} GB/s read, "
                 f"{report['ghz']} GHz")
    if report.get("products"):
        first = report["products"][0]
        lines += ["", "matrix | tokens | PyTorch int4 us | block us | speed-up | "
                  "read floor us | compute floor us", "---|---|---|---|---|---|---"]
        lines += [f"{r['matrix']} | {r['tokens']} | {r['torch_int4_us']} | {r['block_us']} | "
                  f"{r['speedup']}x | {r['read_floor_us']} | {r['compute_floor_us']}"
                  for r in report["products"]]
        lines.append(f"floors: {first['bandwidth_gb_s']} GB/s read; "
                     f"{INT8_MACS_PER_CYCLE[first['level']]} int8 MACs a cycle "
                     f"({first['level']}) x {first['threads']} threads x {first['ghz']} GHz")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m specbench.kernels", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default="default",
                        help="the target: a name, a model directory or a GGUF file")
    parser.add_argument("--precisions", default="gguf,bfloat16,float32")
    parser.add_argument("--tokens", default="1,2,4,5,8,16", help="tokens a pass adds")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds per path")
    parser.add_argument("--repeats", type=int, default=10, help="passes timed per round")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--paths", default="torch,native",
                        help="the paths timed: torch,native (interleaved) or native")
    parser.add_argument("--products", action="store_true",
                        help="also PyTorch's int4 product against the block product per "
                             "matrix shape")
    parser.add_argument("--ghz", type=float, default=None,
                        help="the core clock for the compute floor (default: /proc/cpuinfo's)")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    unknown = set(args.precisions.split(",")) - set(PRECISIONS)
    if unknown:
        parser.error(f"unknown precisions {sorted(unknown)}; choose from {sorted(PRECISIONS)}")
    if args.paths not in ("torch,native", "native"):
        parser.error("--paths is torch,native or native")
    path = json_output(args.json)
    report = run(args)
    if args.products:
        report["products"] = products(args)
    sys.stdout.write(format_table(report))
    write_json(path, report)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
