"""A static check of an exported graph against what TensorRT's ONNX parser accepts.

The tables follow onnx-tensorrt's operator support matrix for TensorRT 10 (opsets
9 to 20): which operators parse, the element types each takes (of its data
input), and the inputs that must be build-time constants. The export runs it
and warns, so a graph TensorRT would refuse is noticed on the CPU, before any
GPU sees it; the engine build remains the final judge.
"""

from __future__ import annotations

from typing import Any

MIN_OPSET, MAX_OPSET = 9, 20
FLOATS = frozenset({"float32", "float16", "bfloat16"})
NUMBERS = FLOATS | {"int32", "int64"}
ANY = NUMBERS | {"bool"}

_GROUPS: dict[frozenset[str], str] = {
    FLOATS: """Acos Acosh Asin Asinh Atan Atanh AveragePool BatchNormalization Ceil Celu Clip
        Conv ConvTranspose Cos Cosh CumSum Dropout Einsum Elu Erf Exp Floor GRU Gemm
        GlobalAveragePool GlobalLpPool GlobalMaxPool GroupNormalization HardSigmoid HardSwish
        Hardmax ImageScaler InstanceNormalization IsInf LRN LSTM LayerNormalization LeakyRelu
        Log LogSoftmax LpNormalization LpPool MatMul MaxPool MeanVarianceNormalization PRelu
        ParametricSoftplus Pow QuantizeLinear RNN RandomNormal RandomNormalLike RandomUniform
        RandomUniformLike Reciprocal Resize Round ScaledTanh Scan Selu Sigmoid Sin Sinh Softmax
        Softplus Softsign Sqrt Tan Tanh ThresholdedRelu Upsample""",
    NUMBERS: """Abs Add ArgMax ArgMin DepthToSpace Div Equal Gelu Greater GreaterOrEqual IsNaN
        Less LessOrEqual Max Mean Min Mod Mul Neg Pad Range ReduceL1 ReduceL2 ReduceLogSum
        ReduceLogSumExp ReduceMax ReduceMean ReduceMin ReduceProd ReduceSum ReduceSumSquare Relu
        Scatter ScatterElements ScatterND Shrink Sign SpaceToDepth Sub Sum TopK""",
    ANY: """Cast CastLike Concat Constant ConstantOfShape Expand EyeLike Flatten Gather
        GatherElements GatherND Identity If Loop OneHot Reshape ReverseSequence Shape Size Slice
        Split Squeeze Tile Transpose Trilu Unsqueeze Where""",
    frozenset({"bool"}): "And Not Or Xor",
    frozenset({"float32", "float16"}):
        "DeformConv GridSample Mish NonMaxSuppression NonZero RoiAlign",
}
SUPPORTED: dict[str, frozenset[str]] = {
    op: types for types, ops in _GROUPS.items() for op in ops.split()}
# Which input holds the data whose type the matrix lists (the first unless named here).
DATA_INPUT = {"Where": 1}
# Inputs that must be initializers or Constant outputs: operator -> input index.
CONSTANT_INPUTS = {"CumSum": 1, "Pad": 3, "Slice": 3, "Squeeze": 1, "Unsqueeze": 1,
                   **{op: 1 for op in SUPPORTED if op.startswith("Reduce")}}
_TYPE_NAMES = {1: "float32", 10: "float16", 16: "bfloat16", 6: "int32", 7: "int64", 9: "bool",
               11: "float64", 2: "uint8", 3: "int8"}


def lint_file(path: str) -> list[str]:
    """Every reason TensorRT's parser would refuse the ONNX graph in ``path``."""
    import onnx

    return lint(onnx.load(path, load_external_data=False))


def lint(model: Any) -> list[str]:
    import onnx

    problems = [f"opset {o.version} is outside TensorRT's {MIN_OPSET}..{MAX_OPSET}"
                for o in model.opset_import
                if o.domain in ("", "ai.onnx") and not MIN_OPSET <= o.version <= MAX_OPSET]
    graph = onnx.shape_inference.infer_shapes(model).graph
    types = {v.name: _TYPE_NAMES.get(v.type.tensor_type.elem_type, "unknown")
             for v in (*graph.input, *graph.output, *graph.value_info)}
    types.update({t.name: _TYPE_NAMES.get(t.data_type, "unknown") for t in graph.initializer})
    constants = {t.name for t in graph.initializer}
    constants.update(out for n in graph.node if n.op_type == "Constant" for out in n.output)
    for node in graph.node:
        problems.extend(_node_problems(node, types, constants))
    return problems


def _node_problems(node: Any, types: dict[str, str], constants: set[str]) -> list[str]:
    name = f"{node.op_type} node {node.name or node.output[0]!r}"
    if node.domain not in ("", "ai.onnx"):
        return [f"{name} is from operator set {node.domain!r}, which TensorRT does not parse"]
    supported = SUPPORTED.get(node.op_type)
    if supported is None:
        return [f"{name}: TensorRT has no {node.op_type} operator"]
    problems = []
    index = DATA_INPUT.get(node.op_type, 0)
    data = node.input[index] if len(node.input) > index else (node.output[0] or "")
    dtype = types.get(data)
    if dtype is not None and dtype not in supported:
        problems.append(f"{name}: TensorRT's {node.op_type} does not take {dtype}")
    const = CONSTANT_INPUTS.get(node.op_type)
    if const is not None and len(node.input) > const and node.input[const] \
            and node.input[const] not in constants:
        problems.append(f"{name}: input {const} must be a constant for TensorRT")
    return problems
