"""The feature draft's ONNX export: ONNX Runtime on a CPU drafts what PyTorch drafts."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from specdistill import feature_onnx
from specdistill.feature import FeatureDraft

pytest.importorskip("onnxruntime", reason="the ONNX extra (onnxruntime) is not installed")


def _draft(layers: tuple[int, ...]) -> FeatureDraft:
    torch.manual_seed(1)
    config = {"hidden_size": 32, "intermediate_size": 64, "num_attention_heads": 4,
              "num_key_value_heads": 2, "head_dim": 8, "rms_norm_eps": 1e-5,
              "rope_theta": 10000.0, "max_position_embeddings": 128}
    draft = FeatureDraft(config, torch.randn(60, 32), torch.arange(0, 60, 3), layers=layers)
    with torch.no_grad():
        for p in draft.parameters():
            p.normal_(0.0, 0.3) if p.dim() > 1 else p.uniform_(0.5, 1.5)
    return draft.eval()


@pytest.mark.parametrize("layers", [(), (0, 3, 5)], ids=["final", "fused"])
def test_onnx_runtime_drafts_what_pytorch_drafts(layers: tuple[int, ...],
                                                 tmp_path: Path) -> None:
    draft = _draft(layers)
    manifest = feature_onnx.export(draft, tmp_path / "onnx")
    assert (tmp_path / "onnx" / feature_onnx.STEP_NAME).is_file()
    assert (tmp_path / "onnx" / feature_onnx.FUSE_NAME).is_file() == bool(layers)
    assert manifest["layers"] == list(layers) and manifest["head_tokens"] == 20
    check = manifest["check"]
    assert check["max_abs_logit_diff"] <= feature_onnx.CHECK_ATOL * check["max_abs_logit"]
    # a chain of its own: every drafted token and the logits of each call
    step, fuse = feature_onnx.sessions(tmp_path / "onnx")
    tokens = [5, 17, 42, 8, 33, 2]
    target = torch.randn(len(tokens), 32 * max(1, len(layers)))
    want, outs = draft.draft_sequential(tokens, target, 5)
    got, logits = feature_onnx.ort_chain(step, fuse, tokens, target.numpy(), 5)
    assert got == want
    for out, row in zip(outs, logits, strict=True):
        torch.testing.assert_close(torch.from_numpy(row), draft.logits(out).detach(),
                                   atol=1e-4, rtol=1e-4)


def test_the_check_refuses_an_export_of_other_weights(tmp_path: Path) -> None:
    draft = _draft((0, 3, 5))
    feature_onnx.export(draft, tmp_path / "onnx")
    with torch.no_grad():
        draft.fuse.weight.mul_(-1.0)  # the PyTorch module no longer matches the graph
    with pytest.raises(AssertionError, match="ONNX Runtime"):
        feature_onnx.check(draft, tmp_path / "onnx")
    assert not list(tmp_path.glob(".onnx.tmp-*"))  # nothing half-written left behind
