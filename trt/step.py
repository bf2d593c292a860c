"""The draft's single decoding step as a module with an explicit KV cache.

``DraftStep`` is what gets exported: token ids and the past keys/values go in,
the logits after the last token and the grown keys/values come out. It builds
a transformers ``DynamicCache`` from the tensors internally, so the model code
runs unchanged. ``check_engine`` compares any engine running the export
against this module on sample inputs.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn
from transformers import DynamicCache

from trt.errors import ExportCheckError
from trt.kv_drafter import KVCache, StepEngine
from trt.manifest import ExportCheck

log = logging.getLogger(__name__)

# Largest |logits(engine) - logits(PyTorch)| accepted, per export dtype. fp32 engines
# differ only by summation order; float16 carries ~3 significant digits. bfloat16 (~2
# digits) has no fixed bound: it is judged by top-k agreement alone.
TOLERANCES = {"float32": 1e-3, "float16": 0.25}
# Half-precision engines must also agree on the ranking: in every case each side's most
# likely token is among the other's TOP_K.
TOP_K = 5
HALF_PRECISION = ("float16", "bfloat16")
# (past length, new tokens): an empty past, single-token decoding steps, short prefills.
CHECK_CASES: tuple[tuple[int, int], ...] = ((0, 1), (0, 7), (1, 1), (5, 1), (6, 4), (33, 1),
                                            (33, 5))


class DraftStep(nn.Module):
    """One decoding step of a causal LM, KV cache in and out as tensors."""

    def __init__(self, model: Any) -> None:
        super().__init__()
        self.model = model
        self.num_layers = int(model.config.num_hidden_layers)

    def forward(
        self,
        input_ids: torch.Tensor,  # [1, n]
        past: list[torch.Tensor],  # 2 * layers of [1, kv_heads, p, head_dim]: k0, v0, k1, ...
    ) -> tuple[torch.Tensor, ...]:  # logits [1, vocab], then 2 * layers of [1, kv, p + n, hd]
        past_len = past[0].shape[2]
        cache = DynamicCache(config=self.model.config)
        for i in range(self.num_layers):
            cache.update(past[2 * i], past[2 * i + 1], i)
        positions = torch.arange(input_ids.shape[1], device=input_ids.device).unsqueeze(0)
        out = self.model(
            input_ids=input_ids,
            position_ids=positions + past_len,  # [1, n]
            cache=cache,
            use_cache=True,
            logits_to_keep=1,
        )
        layers: list[Any] = list(cache.layers)  # full-attention layers, keys/values grown
        presents = [t for layer in layers for t in (layer.keys, layer.values)]
        return (out.logits[:, -1, :], *presents)

    def empty_past(self) -> list[torch.Tensor]:
        config = self.model.config
        param = next(self.model.parameters())
        shape = (1, config.num_key_value_heads, 0, _head_dim(config))
        return [torch.zeros(shape, dtype=param.dtype, device=param.device)
                for _ in range(2 * self.num_layers)]


def _head_dim(config: Any) -> int:
    return int(getattr(config, "head_dim", None)
               or config.hidden_size // config.num_attention_heads)


def model_shape(model: Any) -> dict[str, int]:
    """The dimensions the manifest records and the engines allocate with."""
    config = model.config
    return {
        "num_layers": int(config.num_hidden_layers),
        "num_kv_heads": int(config.num_key_value_heads),
        "head_dim": _head_dim(config),
        "vocab_size": int(getattr(model.get_output_embeddings(), "vocab_size", 0)
                          or model.get_output_embeddings().weight.shape[0]),  # subset heads
        "max_positions": int(getattr(config, "max_position_embeddings", 0) or 4096),
    }


@torch.inference_mode()
def check_engine(
    engine: StepEngine,
    step: DraftStep,
    dtype: str,
    cases: Sequence[tuple[int, int]] = CHECK_CASES,
    seed: int = 0,
) -> ExportCheck:
    """Run ``engine`` and ``step`` on the same random inputs; raise if they disagree
    (beyond the dtype's tolerance, or, in half precision, on the top-k ranking)."""
    tolerance = TOLERANCES.get(dtype)
    vocab = int(step.model.get_input_embeddings().weight.shape[0])
    generator = torch.Generator().manual_seed(seed)
    worst, agreed = 0.0, 0
    for past_len, new in cases:
        ids = torch.randint(0, vocab, (1, past_len + new), generator=generator)  # [1, p + n]
        expected, got = _case(engine, step, ids, past_len)
        diff = float((got - expected).abs().max())
        agree = top_k_agree(got, expected, TOP_K)
        log.debug("check past=%d new=%d: max |diff| %.3g, top-%d %s", past_len, new, diff,
                  TOP_K, "agree" if agree else "differ")
        worst = max(worst, diff if diff == diff else float("inf"))  # NaN counts as the worst
        agreed += agree
    result = ExportCheck(runtime=engine.runtime, cases=tuple(cases), max_abs_logits_diff=worst,
                         tolerance=tolerance, top_k=TOP_K, top_k_agreement=agreed / len(cases))
    if tolerance is not None and not worst <= tolerance:
        raise ExportCheckError(
            f"{engine.runtime} disagrees with PyTorch: max |logits diff| {worst:.3g} exceeds "
            f"the {dtype} tolerance {tolerance:g}")
    if (dtype in HALF_PRECISION or tolerance is None) and agreed < len(cases):
        raise ExportCheckError(
            f"{engine.runtime} disagrees with PyTorch in {dtype}: in {len(cases) - agreed} of "
            f"{len(cases)} cases one side's most likely token is not in the other's top "
            f"{TOP_K} (max |logits diff| {worst:.3g})")
    return result


def _case(engine: StepEngine, step: DraftStep, ids: torch.Tensor, past_len: int
          ) -> tuple[torch.Tensor, torch.Tensor]:  # PyTorch's and the engine's [vocab], fp32
    new = ids.shape[1] - past_len
    device = next(step.parameters()).device
    past = step.empty_past()
    if past_len:
        past = list(step(ids[:, :past_len].to(device), past)[1:])
    expected = step(ids[:, past_len:].to(device), past)[0][0].float().cpu()  # [vocab]
    cache = KVCache([t.clone() for t in past], length=past_len)
    cache = _on_engine(engine, cache)
    got = engine.step(cache, ids[0, past_len:].tolist()).float().cpu()  # [vocab]
    if cache.length != past_len + new or cache.tensors[0].shape[2] != past_len + new:
        raise ExportCheckError(
            f"{engine.runtime}: the KV cache did not grow to {past_len + new} positions")
    return expected, got


def top_k_agree(got: torch.Tensor,  # [vocab]
                expected: torch.Tensor,  # [vocab]
                k: int) -> bool:
    """Whether each side's most likely token is among the other's ``k`` most likely."""
    if not (bool(torch.isfinite(got).all()) and bool(torch.isfinite(expected).all())):
        return False
    got_top = set(torch.topk(got, k).indices.tolist())
    expected_top = set(torch.topk(expected, k).indices.tolist())
    return int(got.argmax()) in expected_top and int(expected.argmax()) in got_top


def _on_engine(engine: StepEngine, cache: KVCache) -> KVCache:
    """Move a PyTorch-made cache to the device and dtype the engine keeps its cache in."""
    like = engine.empty_cache().tensors[0]
    return KVCache([t.to(device=like.device, dtype=like.dtype).contiguous()
                    for t in cache.tensors], cache.length)
