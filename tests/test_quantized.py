"""Weight-only int4/int8 matrices, ``--quantize`` at load, and losslessness with them."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from decoding.engine import Engine
from decoding.policy import FixedSpeculation
from decoding.prompting import encode_text
from decoding.round import decode
from decoding.types import GenerationRequest, SamplingParams
from drafters.model import ModelDrafter
from drafters.ngram import NgramDrafter
from runtime.loaders.loading import load_target
from runtime.matrices.quantized import (
    BlockMatrix,
    Int4Matrix,
    Int8Matrix,
    quantize_int4,
    quantize_int8,
    quantized,
)
from runtime.runner.batched import BatchedLM
from runtime.runner.causal_lm import CausalLM
from wiring.drafts import load_model_drafter

GREEDY = SamplingParams(temperature=0.0)
PROMPTS = ["The quick brown fox jumps over the lazy dog. The quick brown fox",
           "1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12,", "Hello", "a b a b a b a b a b"]


@pytest.mark.parametrize("method", ["int4", "int8"])
@pytest.mark.parametrize("shape", [(1536, 576), (40, 64)])
def test_matrix_is_its_dequantized_product(method: str, shape: tuple[int, int]) -> None:
    """Every token count gives the product with the dequantized matrix, and each row is
    exactly what it is alone; the bulk product (long prompt chunks) agrees to rounding."""
    torch.manual_seed(0)
    weight = torch.randn(shape)
    matrix = quantized(weight, None, method)
    dense = matrix.dequantize().float()  # [out, in]
    step = 1 / 15 if method == "int4" else 1 / 127  # of a group's (a row's) range
    assert (dense - weight).abs().max() <= weight.abs().max() * 2 * step * 0.6
    for tokens in (1, 3, 9, 32, 40, 300):
        x = torch.randn(tokens, shape[1]).bfloat16()
        want = x.float() @ dense.t()
        for got in (matrix(x).float(), matrix.bulk(x).float()):
            assert got.shape == (tokens, shape[0])
            assert (got - want).abs().max() <= 2e-2 * want.abs().max()
        alone = torch.cat([matrix(x[i : i + 1]) for i in range(tokens)]).float()
        assert torch.equal(matrix(x).float(), alone)


def test_int4_codes_survive_packing() -> None:
    rows = quantize_int4(torch.randn(100, 128))  # not a whole block of 64 rows
    matrix = Int4Matrix(rows)
    assert torch.equal(matrix.codes(), rows.codes)
    assert matrix.packed.dtype == torch.uint8
    codes, scales = quantize_int8(torch.randn(8, 64))
    assert codes.dtype == torch.int8 and codes.abs().max() == 127
    assert torch.equal(Int8Matrix(codes, scales).weight, codes)


@pytest.mark.parametrize("method", ["int4", "int8"])
def test_quantize_round_trip(tiny_target_dir: Path, tiny_target: CausalLM, method: str) -> None:
    """A model directory quantized at load: its matrices are the float ones within a
    quantization step, its own linear weights are dropped, and it predicts as float32
    does nearly everywhere."""
    target = BatchedLM.load(str(tiny_target_dir), quantize=method)
    assert isinstance(target, BatchedLM) and target.weights_format == method
    assert target.dtype == torch.bfloat16
    layer = target.model.model.layers[0]
    assert layer.self_attn.q_proj.weight.device.type == "meta"
    qkv = target.stack.weights[0].qkv
    # int4: block matrices with int8 activations where the native kernels have them
    int4 = BlockMatrix if target.product_activations == "int8" else Int4Matrix
    assert isinstance(qkv, int4 if method == "int4" else Int8Matrix)
    original = tiny_target.model.model.layers[0].self_attn
    want = torch.cat([original.q_proj.weight, original.k_proj.weight, original.v_proj.weight])
    assert (qkv.dequantize().float() - want).abs().max() <= 0.2 * want.abs().max()
    ids = encode_text(target.tokenizer, PROMPTS[0])
    got = target.score(target.new_state(), ids).float()
    state = tiny_target.new_state()
    try:
        ref = tiny_target.score(state, ids).float()
    finally:
        tiny_target.release(state)  # the shared fixture's rows stay free for other tests
    if method == "int8":
        assert (got.argmax(-1) == ref.argmax(-1)).float().mean() >= 0.8
    # int4's step is ~1/30 of a group's range: a random tiny model's flat logits move
    # visibly (the real model's agreement is in docs/quantization.md), but stay aligned
    centred = got - got.mean(-1, keepdim=True), ref - ref.mean(-1, keepdim=True)
    cosine = torch.nn.functional.cosine_similarity(*centred, dim=-1)
    assert cosine.min() >= (0.99 if method == "int8" else 0.85), cosine


@pytest.fixture(scope="module")
def int4_target(tiny_target_dir: Path) -> CausalLM:
    return load_target(str(tiny_target_dir), "float32", quantize="int4")


def _request(target: CausalLM, text: str, n: int = 24) -> GenerationRequest:
    return GenerationRequest(prompt_ids=tuple(encode_text(target.tokenizer, text)),
                             max_new_tokens=n, sampling=GREEDY)


def _tokens(target: CausalLM, drafter: object, request: GenerationRequest,
            k: int | None = 4) -> list[int]:
    policy = FixedSpeculation(k) if k is not None else None
    return [t for e in decode(target, drafter, request, policy) for t in e.token_ids]  # type: ignore[arg-type]


def test_greedy_speculation_is_lossless_on_a_quantized_target(
        int4_target: CausalLM, tiny_draft_dir: Path) -> None:
    """Greedy speculative output is the quantized target's own greedy output, with an
    n-gram draft, the target as its own draft and a quantized model draft."""
    draft = load_target(str(tiny_draft_dir), "float32", quantize="int8")
    drafters = {"ngram": NgramDrafter(), "self": ModelDrafter(int4_target, int4_target),
                "int8-draft": ModelDrafter(draft, int4_target)}
    for prompt in PROMPTS:
        request = _request(int4_target, prompt)
        plain = _tokens(int4_target, None, request)
        for name, drafter in drafters.items():
            assert _tokens(int4_target, drafter, request) == plain, (prompt, name)


@pytest.mark.parametrize("streams", [
    1,
    4,
])
def test_engine_streams_match_plain_decoding(int4_target: CausalLM, streams: int) -> None:
    """Streams of a quantized target through the engine, speculating with n-gram drafts,
    each give what plain decoding of that stream alone gives."""
    engine = Engine(int4_target, {"ngram": NgramDrafter()}, default_drafter="ngram",
                    max_queue=8, max_active=streams)
    engine.start()
    try:
        streams = [engine.submit(_request(int4_target, p)) for p in PROMPTS]
        results = [[t for e in s for t in e.token_ids] for s in streams]
    finally:
        engine.shutdown()
    for prompt, got in zip(PROMPTS, results, strict=True):
        assert got == _tokens(int4_target, None, _request(int4_target, prompt)), prompt


def test_shipped_draft_quantizes_beside_a_gguf_target() -> None:
    """The default model served from its GGUF: the shipped draft follows it into int4
    (its subset head too), and speculation with it stays lossless."""
    target = load_target("default", quantize="auto")
    assert getattr(target, "weights_format", "").startswith("gguf-q4_1")
    drafter = load_model_drafter("default-draft", target)
    runner = drafter.model
    assert isinstance(runner, BatchedLM) and runner.weights_format == "int4"
    assert isinstance(runner.stack.head, Int4Matrix | BlockMatrix)
    assert runner.stack.head_ids is not None
    request = _request(target, "Write a short poem about the sea.", n=32)
    assert _tokens(target, drafter, request, k=None) == _tokens(target, None, request)
