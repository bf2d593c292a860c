"""The default model cut to its first layers, exported and used as the real target's draft.

An untrained truncation is a poor draft (few proposals are accepted), but it is
the real architecture at full vocabulary: the export, the ONNX Runtime drafter
and lossless decoding must all hold for it.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from decoding.drafter import DraftContext
from decoding.prompting import encode_chat
from decoding.round import decode
from decoding.types import GenerationRequest, SamplingParams
from drafters.model import ModelDrafter
from runtime.runner.causal_lm import CausalLM
from trt.backends import load_draft
from trt.manifest import Manifest
from trt.sources import DraftSource

SPEC = "default-truncated:2"
GREEDY = SamplingParams(temperature=0.0)


@pytest.mark.real_model
def test_truncated_default_draft(default_target: CausalLM, tmp_path: Path) -> None:
    drafter, backend = load_draft(SPEC, default_target, "onnx", export_root=tmp_path)
    assert backend == "onnx" and drafter is not None
    (export_dir,) = tmp_path.iterdir()
    manifest = Manifest.load(export_dir)
    assert manifest.num_layers == 2 and manifest.source_spec == SPEC
    assert manifest.check is not None and manifest.check.max_abs_logits_diff < 1e-3
    ids = encode_chat(default_target.tokenizer,
                      [{"role": "user", "content": "Name three primary colours."}])
    # The same proposals as the PyTorch drafter on the same truncated model.
    model = ModelDrafter(DraftSource.parse(SPEC).load_causal_lm(), default_target)
    context = DraftContext(ids, GREEDY, None)
    assert (drafter.propose(drafter.begin(ids), context, 4).tokens
            == model.propose(model.begin(ids), context, 4).tokens)
    # Lossless against the real target.
    request = GenerationRequest(prompt_ids=tuple(ids), max_new_tokens=10, sampling=GREEDY)
    plain = [t for e in decode(default_target, None, request) for t in e.token_ids]
    events = list(decode(default_target, drafter, request))
    assert [t for e in events for t in e.token_ids] == plain
    assert sum(e.draft_tokens for e in events) > 0
