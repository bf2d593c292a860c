"""The export at the engine profile's limits, in bfloat16, and against TensorRT's parser."""

from __future__ import annotations

import collections
from collections.abc import Callable, Sequence
from pathlib import Path

import onnx
import pytest
import torch
from onnx import TensorProto, helper

from runtime.runner.causal_lm import CausalLM
from trt.export import export_onnx
from trt.manifest import INPUT_IDS, Manifest
from trt.onnx_drafter import OrtEngine
from trt.onnx_lint import MAX_OPSET, SUPPORTED, lint, lint_file
from trt.onnx_reference import ReferenceEngine
from trt.sources import DraftSource
from trt.step import TOLERANCES, TOP_K, top_k_agree
from trt.tensorrt_build import BuildSettings, profile_shapes

ExportCli = Callable[[Sequence[str]], int]


def _limits(manifest: Manifest) -> tuple[int, int]:
    """The engine profile's most new tokens and most past tokens, for the whole context."""
    shapes = profile_shapes(manifest, BuildSettings(max_positions=manifest.max_positions))
    return shapes[INPUT_IDS][2][1], shapes["past_key_0"][2][2]


@pytest.mark.parametrize("case", ["longest input, empty past", "longest past, one token"])
def test_onnx_runtime_at_the_profile_limits(tiny_draft: CausalLM, tiny_draft_export: Path,
                                            case: str) -> None:
    manifest = Manifest.load(tiny_draft_export)
    max_new, max_past = _limits(manifest)
    assert max_past == manifest.max_positions - 1
    past, new = (0, max_new) if case.startswith("longest input") else (max_past, 1)
    ids = torch.randint(0, tiny_draft.vocab_size, (past + new,),
                        generator=torch.Generator().manual_seed(past + new)).tolist()
    engine = OrtEngine(tiny_draft_export)
    cache = engine.empty_cache()
    state = tiny_draft.new_state()
    if past:
        engine.step(cache, ids[:past])
        tiny_draft.prefill(state, ids[:past])
    got = engine.step(cache, ids[past:])  # [vocab]
    expected = tiny_draft.prefill(state, ids[past:])  # [vocab]
    assert float((got - expected).abs().max()) <= TOLERANCES["float32"]
    assert cache.length == past + new
    assert all(t.shape == (1, manifest.num_kv_heads, past + new, manifest.head_dim)
               for t in cache.tensors)


@pytest.fixture(scope="module")
def bf16_export(tmp_path_factory: pytest.TempPathFactory, tiny_draft_dir: Path) -> Path:
    out = tmp_path_factory.mktemp("bf16") / "export"
    export_onnx(DraftSource.parse(str(tiny_draft_dir)), out, "bfloat16")
    return out


def test_bfloat16_export_is_checked(bf16_export: Path) -> None:
    manifest = Manifest.load(bf16_export)
    assert manifest.dtype == "bfloat16"
    check = manifest.check
    assert check is not None and "reference evaluator" in check.runtime
    assert check.tolerance is None  # judged by ranking, not a fixed bound
    assert check.top_k == TOP_K and check.top_k_agreement == 1.0
    assert (0, 1) in check.cases and (33, 5) in check.cases


def test_bfloat16_graph_types_and_operators(bf16_export: Path) -> None:
    model = onnx.load(str(bf16_export / "draft.onnx"))
    types = {v.name: v.type.tensor_type.elem_type for v in (*model.graph.input,
                                                            *model.graph.output)}
    assert types.pop(INPUT_IDS) == TensorProto.INT64
    assert set(types.values()) == {TensorProto.BFLOAT16}  # past, present and logits
    weights = collections.Counter(t.data_type for t in model.graph.initializer
                                  if len(t.dims) == 2)
    assert set(weights) == {TensorProto.BFLOAT16}  # every matrix is bfloat16
    assert {n.op_type for n in model.graph.node} <= set(SUPPORTED)
    assert lint(model) == []


def test_bfloat16_export_agrees_with_pytorch_on_the_ranking(bf16_export: Path,
                                                             tiny_draft_dir: Path) -> None:
    model = DraftSource.parse(str(tiny_draft_dir)).load_causal_lm("bfloat16", "cpu")
    engine = ReferenceEngine(bf16_export)
    prompt = list(range(100, 140))
    cache = engine.empty_cache()
    state = model.new_state()
    got = engine.step(cache, prompt)  # [vocab]
    expected = model.prefill(state, prompt)  # [vocab]
    assert got.dtype == torch.bfloat16
    for token in (7, 8, 9):  # the decoding steps after it, one token each
        assert top_k_agree(got.float(), expected.float(), TOP_K)
        got, expected = engine.step(cache, [token]), model.prefill(state, [token])
    assert top_k_agree(got.float(), expected.float(), TOP_K)
    assert not top_k_agree(got.float(), -expected.float(), TOP_K)  # the check can fail


def test_cli_exports_bfloat16_with_its_check(export_cli: ExportCli, tiny_draft_dir: Path,
                                             tmp_path: Path,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    assert export_cli(["export-draft", "--draft", str(tiny_draft_dir), "--dtype", "bfloat16",
                       "--out", str(tmp_path / "out"), "--quiet"]) == 0
    assert "top-5 agreement 100%" in capsys.readouterr().err
    assert Manifest.load(tmp_path / "out").check is not None


def test_float32_export_passes_the_tensorrt_lint(tiny_draft_export: Path) -> None:
    assert lint_file(str(tiny_draft_export / "draft.onnx")) == []
    assert Manifest.load(tiny_draft_export).opset <= MAX_OPSET


def _graph(nodes: list[onnx.NodeProto], opset: int = 20,
           initializers: Sequence[onnx.TensorProto] = ()) -> onnx.ModelProto:
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3])
    axes = helper.make_tensor_value_info("axes", TensorProto.INT64, [1])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, None)
    graph = helper.make_graph(nodes, "g", [x, axes], [y], initializer=list(initializers))
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])


def test_the_lint_finds_what_tensorrt_refuses() -> None:
    assert lint(_graph([helper.make_node("Relu", ["x"], ["y"])])) == []
    assert "outside TensorRT's" in lint(_graph([helper.make_node("Relu", ["x"], ["y"])],
                                               opset=MAX_OPSET + 1))[0]
    (problem,) = lint(_graph([helper.make_node("Unique", ["x"], ["y"])]))
    assert "no Unique operator" in problem
    (problem,) = lint(_graph([helper.make_node("Unsqueeze", ["x", "axes"], ["y"])]))
    assert "input 1 must be a constant" in problem
    fixed = helper.make_tensor("one", TensorProto.INT64, [1], [0])
    assert lint(_graph([helper.make_node("Unsqueeze", ["x", "one"], ["y"])],
                       initializers=[fixed])) == []
    (problem,) = lint(_graph([helper.make_node("Cast", ["x"], ["d"], to=TensorProto.DOUBLE),
                              helper.make_node("Sqrt", ["d"], ["y"])]))
    assert "Sqrt does not take float64" in problem
