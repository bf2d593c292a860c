"""What quantized targets cost and change: step time, weights read, quality, memory.

``python -m specbench.quant`` measures, for each precision of the default model (float32,
bfloat16, int8, int4 quantized at load, and the GGUF file's own weights; a name ending in
``-bf16act`` keeps bfloat16 activations where the native kernels would quantize them to
int8, ``quantized.BlockMatrix``):

- the one-token step at a ~300-token context against the floor for the bytes of
  weights a step reads (memory bandwidth measured here, as ``specbench.concurrency``, in
  rounds that pair each bandwidth with the steps timed right after it);
- quality against float32 (the GGUF dequantized): greedy float32 continuations of the
  shipped prompts, scored teacher-forced by each precision: top-1 agreement and mean
  |logit difference| over the continuation positions;
- for the GGUF: how far the kernel's bfloat16 scales move the weights (max relative
  error per tensor against gguf's own dequantization);
- with ``--rss``: the resident memory of a ready ``specserve serve --draft none
  --no-prefix-cache`` per precision.

Prints a table and writes JSON (``--json``). Timings are ratios within one run.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from decoding.prompting import encode_chat
from runtime.files import model_store
from runtime.loaders.loading import PRECISIONS, load_target
from runtime.matrices.kquants import KQuantMatrix
from runtime.matrices.quantized import BlockMatrix, Int4Matrix, Int8Matrix
from runtime.matrices.weights import Matrix, Product, Stacked
from runtime.native.kernels import CHOICES as KERNEL_CHOICES
from runtime.runner.batched import BatchedLM
from runtime.runner.causal_lm import CausalLM
from specbench.compare import load_prompts
from specbench.concurrency import measure_bandwidth

MS = 1e3
CONTEXT = 300
BF16_ACTIVATIONS = "-bf16act"  # a precision's suffix: no int8 activations


def product_bytes(product: Product) -> int:
    """Bytes of one weight matrix as the step reads it."""
    if isinstance(product, Int4Matrix | Int8Matrix | BlockMatrix | KQuantMatrix):
        return product.nbytes
    if isinstance(product, Stacked):
        return sum(product_bytes(p) for p in product.parts)
    if isinstance(product, Matrix):
        return product.nbytes
    raise TypeError(f"unknown matrix {type(product).__name__}")


def step_bytes(target: CausalLM) -> int:
    """Bytes of weights a one-token step reads: every matrix and the head (the input
    embedding's one row and the norms are negligible)."""
    if not isinstance(target, BatchedLM):
        raise TypeError(f"{target.name}: only the batched runner's matrices are counted")
    total = product_bytes(target.stack.head)
    for layer in target.stack.weights:
        total += sum(product_bytes(p) for p in (layer.qkv, layer.o, layer.gate_up, layer.down))
    return total


@torch.inference_mode()
def step_time(target: CausalLM, steps: int) -> float:
    """Median seconds of a one-token step after a ``CONTEXT``-token prompt."""
    state = target.new_state()
    target.prefill(state, list(range(1000, 1000 + CONTEXT)))
    times = []
    for _ in range(steps + 3):
        start = time.perf_counter()
        target.score(state, [1234])
        times.append(time.perf_counter() - start)
        target.rollback(state, CONTEXT)
    target.release(state)
    return statistics.median(times[3:])


def step_over_floor(target: CausalLM, size: int, steps: int, rounds: int = 5
                    ) -> dict[str, Any]:
    """The one-token step against the read floor of its ``size`` bytes, in ``rounds``
    rounds that each measure the bandwidth and then the step (a noisy host's bandwidth
    moves by a third within a minute): medians of the rounds, the ratio's range."""
    measured = []
    for _ in range(rounds):
        bandwidth = measure_bandwidth(repeats=3)
        step = step_time(target, max(1, steps // rounds))
        measured.append((bandwidth, step, step * bandwidth / size))
    ratios = [r for _, _, r in measured]
    bandwidth = statistics.median(b for b, _, _ in measured)
    return {"step_ms": round(statistics.median(s for _, s, _ in measured) * MS, 2),
            "bandwidth_gb_s": round(bandwidth / 1e9, 1),
            "floor_ms": round(size / bandwidth * MS, 2),
            "step_over_floor": round(statistics.median(ratios), 2),
            "step_over_floor_range": [round(min(ratios), 2), round(max(ratios), 2)]}


@torch.inference_mode()
def continuations(target: CausalLM, prompts: list[list[int]], tokens: int) -> list[list[int]]:
    """Greedy continuations (prompt + new tokens) by ``target``."""
    out = []
    for ids in prompts:
        state = target.new_state()
        logits = target.prefill(state, ids)
        seq = list(ids)
        for _ in range(tokens):
            seq.append(int(logits.argmax()))
            logits = target.score(state, [seq[-1]])[0]
        target.release(state)
        out.append(seq)
    return out


@torch.inference_mode()
def scored(target: CausalLM, seqs: list[list[int]], starts: list[int]) -> list[torch.Tensor]:
    """The logits after each continuation position, teacher-forced, one token a step
    (as decoding runs)."""
    out = []
    for seq, start in zip(seqs, starts, strict=True):
        state = target.new_state()
        rows = [target.prefill(state, seq[:start])]
        rows += [target.score(state, [t])[0] for t in seq[start:-1]]
        target.release(state)
        out.append(torch.stack(rows).float())  # [new, vocab]
    return out


def compare(reference: list[torch.Tensor], got: list[torch.Tensor]) -> dict[str, float]:
    ref, new = torch.cat(reference), torch.cat(got)
    return {"top1_agreement": round(float((ref.argmax(-1) == new.argmax(-1)).float().mean()), 4),
            "mean_abs_logit_diff": round(float((ref - new).abs().mean()), 4),
            "positions": int(ref.shape[0])}


def scale_error(gguf_path: Path) -> dict[str, Any]:
    """Max relative error of the int4 kernel's weights (bfloat16 scale and zero) against
    gguf's own dequantization, over every int4 tensor of the file; also checks that the
    packed codes reproduce the file's values with float32 scales, and, where the native
    kernels have block products, how far the block matrices' float16 scales move them."""
    import gguf

    from runtime.loaders.gguf_weights import INT4_TYPES, int4_rows
    from runtime.matrices.quantized import BlockMatrix, block_kernels
    from runtime.native import kernels

    try:
        blocks = block_kernels(kernels.native(), int8_activations=True)
    except kernels.KernelsUnavailable:
        blocks = None
    worst = 0.0
    worst_exact = 0.0
    worst_block = 0.0
    reader = gguf.GGUFReader(str(gguf_path))
    for tensor in reader.tensors:
        kind = tensor.tensor_type.name
        if kind not in INT4_TYPES:
            continue
        data = np.asarray(tensor.data)
        want = torch.from_numpy(gguf.quants.dequantize(data, tensor.tensor_type).copy())
        rows = int4_rows(kind, data, int(tensor.shape[0]))
        exact = rows.dequantize()
        got = Int4Matrix(rows).dequantize().float()
        scale = want.abs().max()
        worst = max(worst, float((got - want).abs().max() / scale))
        worst_exact = max(worst_exact, float((exact - want).abs().max() / scale))
        if blocks is not None:
            block = BlockMatrix.int4(blocks, rows).dequantize()
            worst_block = max(worst_block, float((block - want).abs().max() / scale))
    report = {"max_rel_error_bf16_scales": worst, "max_rel_error_float32_scales": worst_exact}
    if blocks is not None:
        report["max_rel_error_block_float16_scales"] = worst_block
    return report


def serve_rss(quantize: str, dtype: str, timeout: float = 600) -> float:
    """Resident MB of a ready ``specserve serve --draft none --no-prefix-cache``."""
    import socket
    import urllib.request

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "specserve.cli", "serve", "--draft", "none",
           "--no-prefix-cache", "--port", str(port), "--metrics-port", "0",
           "--quantize", quantize, "--dtype", dtype]
    process = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and process.poll() is None:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/ready", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                time.sleep(0.5)
        time.sleep(2)
        status = Path(f"/proc/{process.pid}/status").read_text()
        rss = next(line for line in status.splitlines() if line.startswith("VmRSS"))
        return int(rss.split()[1]) / 1024
    finally:
        process.terminate()
        try:
            process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def draft_costs(steps: int) -> list[dict[str, Any]]:
    """The shipped draft's one-token step per draft dtype beside the GGUF target's step
    (the cost of a draft token as a fraction of a target step)."""
    from wiring.drafts import load_model_drafter

    target = load_target("default", "bfloat16", quantize="auto")
    target_step = step_time(target, steps)
    rows = []
    for draft_dtype in ("bfloat16", "int8", "int4"):
        runner: Any = load_model_drafter("default-draft", target, draft_dtype=draft_dtype).model
        draft_step = step_time(runner, steps)
        rows.append({"draft_dtype": draft_dtype, "draft_step_ms": round(draft_step * MS, 2),
                     "target_step_ms": round(target_step * MS, 2),
                     "draft_over_target": round(draft_step / target_step, 3)})
        print(json.dumps(rows[-1]), flush=True)
    return rows


def run(args: argparse.Namespace) -> dict[str, Any]:
    torch.set_num_threads(args.threads or torch.get_num_threads())
    bandwidth = measure_bandwidth()  # the figure for the table's header; rows pair their own
    precisions = [p.strip() for p in args.precisions.split(",") if p.strip()]
    prompts: list[list[int]] = []
    reference: list[torch.Tensor] = []
    seqs: list[list[int]] = []
    report: dict[str, Any] = {"bandwidth_gb_s": round(bandwidth / 1e9, 1), "context": CONTEXT,
                              "threads": torch.get_num_threads(), "rows": []}
    for name in precisions:
        dtype, quantize = PRECISIONS[name.removesuffix(BF16_ACTIVATIONS)]
        target = load_target("default", dtype, quantize=quantize, kernels=args.kernels,
                             int8_activations=not name.endswith(BF16_ACTIVATIONS))
        if not prompts:
            prompts = [encode_chat(target.tokenizer, p.messages)
                       for s in args.prompt_sets.split(",")
                       for p in load_prompts(s, args.prompts)]
        size = step_bytes(target)
        row: dict[str, Any] = {
            "precision": name, "weights": getattr(target, "weights_format", dtype),
            "products": getattr(target, "product_activations", dtype),
            "weights_mb": round(size / 1e6, 1), **step_over_floor(target, size, args.steps)}
        if name == "float32":
            seqs = continuations(target, prompts, args.tokens)
            reference = scored(target, seqs, [len(p) for p in prompts])
        elif reference:
            row.update(compare(reference, scored(target, seqs, [len(p) for p in prompts])))
        report["rows"].append(row)
        print(json.dumps(row), flush=True)
        del target
        gc.collect()
    report["gguf"] = scale_error(model_store.default_gguf())
    if args.draft_cost:
        report["draft_cost"] = draft_costs(args.steps)
    if args.rss:
        for name in precisions:
            dtype, quantize = PRECISIONS[name.removesuffix(BF16_ACTIVATIONS)]
            rss = serve_rss(quantize, dtype)
            next(r for r in report["rows"] if r["precision"] == name)["serve_rss_mb"] = round(rss)
    return report


def write_table(report: dict[str, Any]) -> None:
    cols = ["precision", "weights", "products", "weights_mb", "step_ms", "bandwidth_gb_s",
            "floor_ms", "step_over_floor", "step_over_floor_range", "top1_agreement",
            "mean_abs_logit_diff", "serve_rss_mb"]
    print(" | ".join(cols))
    for row in report["rows"]:
        print(" | ".join(str(row.get(c, "")) for c in cols))
    for row in report.get("draft_cost", []):
        print(f"draft {row['draft_dtype']}: {row['draft_step_ms']} ms a token, "
              f"{row['draft_over_target']} of the GGUF target's {row['target_step_ms']} ms")
    print(f"bandwidth {report['bandwidth_gb_s']} GB/s, context {report['context']}, "
          f"threads {report['threads']}; GGUF int4 weights vs gguf's dequantization: "
          f"{report['gguf']}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--precisions",
                        default="float32,bfloat16,int8,int4,int4-bf16act,gguf,gguf-bf16act")
    parser.add_argument("--prompt-sets", default="chat,grounded")
    parser.add_argument("--prompts", type=int, default=None, help="prompts per set (all)")
    parser.add_argument("--tokens", type=int, default=32, help="continuation tokens")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--kernels", default="auto", choices=list(KERNEL_CHOICES),
                        help="the targets' elementwise work and attention (runtime.native.kernels)")
    parser.add_argument("--rss", action="store_true", help="also a served process's RSS")
    parser.add_argument("--draft-cost", action="store_true",
                        help="also the shipped draft's step per draft dtype")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    report = run(args)
    write_table(report)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
