"""An ONNX export of a feature draft, run by ONNX Runtime on a CPU, checked against PyTorch.

Two graphs. ``step.onnx`` is one drafting call: ``input_ids`` [1, n] beside
``features`` [1, n, H] (each row's feature as the draft reads it: the target's, fused
where the draft fuses layers, or the draft's own last output), after ``past_key`` and
``past_value`` [1, kv_heads, p, head_dim] (p may be 0); it returns ``hidden`` [1, n, H]
(the draft's outputs: the last one is fed back beside the drafted token), ``logits``
[1, K] after the last row over the head's tokens, ``next_token`` [1] (the vocabulary id
of their argmax), and ``present_key`` / ``present_value`` grown by n. ``fuse.onnx``,
for a draft that fuses the target's layers, turns ``layers`` [n, L*H] into
``features`` [n, H]. The target's embedding and head rows are constants in the graph.

An export is written to a temporary directory and moved into place only after ONNX
Runtime reproduces PyTorch on a chain of drafting calls (``check``).
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from specdistill.feature import FeatureDraft

STEP_NAME = "step.onnx"
FUSE_NAME = "fuse.onnx"
MANIFEST_NAME = "feature-onnx.json"
OPSET = 18
CHECK_ATOL = 1e-4  # float32 logits, relative to their largest


class FeatureStep(nn.Module):
    """``step.onnx``'s computation (``FeatureDraft.cached_step`` and the head)."""

    def __init__(self, draft: FeatureDraft) -> None:
        super().__init__()
        self.draft = draft

    def forward(self, input_ids: torch.Tensor,  # [1, n]
                features: torch.Tensor,  # [1, n, H]
                past_key: torch.Tensor,  # [1, kv_heads, p, head_dim]
                past_value: torch.Tensor,  # [1, kv_heads, p, head_dim]
                ) -> tuple[torch.Tensor, ...]:
        hidden, key, value = self.draft.cached_step(input_ids, features, past_key, past_value)
        logits = self.draft.logits(hidden[:, -1])  # [1, K]
        token = self.draft.head_ids[logits.argmax(-1)]  # [1]
        return hidden, logits, token, key, value


class FeatureFuse(nn.Module):
    """``fuse.onnx``'s computation (``FeatureDraft.target_feature``)."""

    def __init__(self, draft: FeatureDraft) -> None:
        super().__init__()
        self.draft = draft

    def forward(self, layers: torch.Tensor) -> torch.Tensor:  # [n, L*H] -> [n, H]
        return self.draft.target_feature(layers)


def _empty_past(draft: FeatureDraft, length: int = 0) -> torch.Tensor:
    c = draft.config
    return torch.zeros(1, c["num_key_value_heads"], length, c["head_dim"])


def export(draft: FeatureDraft, out_dir: Path, check_cases: int = 3) -> dict[str, Any]:
    """Export ``draft`` (float32) into ``out_dir`` and check it; returns the manifest."""
    draft = draft.eval().float()
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.tmp-", dir=out_dir.parent))
    try:
        h = draft.config["hidden_size"]
        seq = torch.export.Dim("seq", min=1, max=4096)
        past = torch.export.Dim("past", min=0, max=8192)
        args = (torch.zeros(1, 3, dtype=torch.long), torch.zeros(1, 3, h),
                _empty_past(draft, 2), _empty_past(draft, 2))
        _export(FeatureStep(draft), args, ({1: seq}, {1: seq}, {2: past}, {2: past}),
                ["input_ids", "features", "past_key", "past_value"],
                ["hidden", "logits", "next_token", "present_key", "present_value"],
                work / STEP_NAME)
        if draft.layers:
            rows = torch.export.Dim("rows", min=1, max=8192)
            _export(FeatureFuse(draft), (torch.zeros(3, len(draft.layers) * h),),
                    ({0: rows},), ["layers"], ["features"], work / FUSE_NAME)
        manifest = {"format": "specserve-feature-onnx", "opset": OPSET,
                    "hidden_size": h, "layers": list(draft.layers),
                    "head_tokens": int(draft.head_ids.numel()),
                    "check": check(draft, work, check_cases)}
        (work / MANIFEST_NAME).write_text(json.dumps(manifest, indent=2) + "\n")
        if out_dir.exists():
            shutil.rmtree(out_dir)
        work.rename(out_dir)
    except BaseException:
        shutil.rmtree(work, ignore_errors=True)
        raise
    return manifest


def _export(module: nn.Module, args: tuple[Any, ...], shapes: tuple[Any, ...],
            inputs: list[str], outputs: list[str], path: Path) -> None:
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the exporter's notes on internals it handles
        program = torch.onnx.export(module, args, dynamo=True, dynamic_shapes=shapes,
                                    input_names=inputs, output_names=outputs,
                                    opset_version=OPSET, verbose=False)
        assert program is not None
        program.save(str(path))


def sessions(directory: Path) -> tuple[Any, Any | None]:
    """ONNX Runtime sessions (CPU) for ``step.onnx`` and, where there is one, ``fuse.onnx``."""
    try:
        import onnxruntime as ort
    except ImportError as exc:
        raise RuntimeError("the ONNX export's check needs onnxruntime "
                           "(pip install 'specserve[onnx]')") from exc
    options = ort.SessionOptions()
    options.log_severity_level = 3
    def open_(name: str) -> Any:
        return ort.InferenceSession(str(directory / name), options,
                                    providers=["CPUExecutionProvider"])
    return open_(STEP_NAME), open_(FUSE_NAME) if (directory / FUSE_NAME).exists() else None


def ort_chain(step: Any, fuse: Any | None, tokens: list[int], target: np.ndarray, count: int
              ) -> tuple[list[int], list[np.ndarray]]:
    """Draft ``count`` tokens with ONNX Runtime after ``tokens`` beside the target's rows
    ``target`` (its layers' where the draft fuses them): the drafted ids and each call's
    logits."""
    feats = fuse.run(None, {"layers": target})[0] if fuse is not None else target
    shape = step.get_inputs()[2].shape
    past = np.zeros((1, shape[1], 0, shape[3]), dtype=np.float32)
    ids = np.array([tokens], dtype=np.int64)
    feeds = {"input_ids": ids, "features": feats[None].astype(np.float32),
             "past_key": past, "past_value": past}
    drafted, logits = [], []
    for _ in range(count):
        hidden, out, token, key, value = step.run(None, feeds)
        drafted.append(int(token[0]))
        logits.append(out[0])
        feeds = {"input_ids": token.reshape(1, 1).astype(np.int64),
                 "features": hidden[:, -1:], "past_key": key, "past_value": value}
    return drafted, logits


@torch.no_grad()
def check(draft: FeatureDraft, directory: Path, cases: int = 3, count: int = 4,
          seed: int = 0) -> dict[str, Any]:
    """ONNX Runtime against PyTorch (``draft_sequential``) on ``cases`` random contexts:
    the same drafted tokens, logits within ``CHECK_ATOL``; raises where they differ."""
    step, fuse = sessions(directory)
    g = torch.Generator().manual_seed(seed)
    h = draft.config["hidden_size"] * max(1, len(draft.layers))
    vocab = int(draft.embedding.shape[0])
    worst = scale = 0.0
    for case in range(cases):
        n = 5 + 7 * case
        tokens = torch.randint(0, vocab, (n,), generator=g).tolist()
        target = torch.randn(n, h, generator=g) * (3.0 if draft.layers else 1.0)
        want, outs = draft.draft_sequential(tokens, target, count)
        got, logits = ort_chain(step, fuse, tokens, target.numpy(), count)
        if got != want:
            raise AssertionError(f"ONNX Runtime drafted {got}, PyTorch {want}")
        for out, row in zip(outs, logits, strict=True):
            reference = draft.logits(out).numpy()
            worst = max(worst, float(np.abs(reference - row).max()))
            scale = max(scale, float(np.abs(reference).max()))
    if worst > CHECK_ATOL * max(1.0, scale):  # relative to the logits' size
        raise AssertionError(f"ONNX Runtime's logits differ from PyTorch's by {worst}")
    return {"cases": cases, "tokens_each": count, "max_abs_logit_diff": worst,
            "max_abs_logit": scale, "runtime": "onnxruntime CPUExecutionProvider"}


def main(argv: list[str] | None = None) -> int:
    """``python -m specdistill.feature_onnx DRAFT_DIR OUT_DIR``: export a feature draft
    for the default target (or ``--target``) and check it with ONNX Runtime."""
    from runtime.loaders.loading import load_target
    from specdistill.feature_train import load_draft

    p = argparse.ArgumentParser(prog="python -m specdistill.feature_onnx")
    p.add_argument("draft", type=Path)
    p.add_argument("out", type=Path)
    p.add_argument("--target", default="default")
    args = p.parse_args(argv)
    target = load_target(args.target, "float32", "cpu", "auto", "auto", True)
    manifest = export(load_draft(args.draft, target), args.out)
    print(json.dumps(manifest["check"]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
