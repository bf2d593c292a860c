"""A GGUF file's own quantized weights, served without a float32 copy of the model.

The model's modules are built on the meta device from its config (``runtime.models.skeleton``),
then only what the batched runner reads is filled: the norms in bfloat16 (Gemma's in
float32), the input embedding, and every matrix in the file's own format where the
native kernels multiply it. Where they build:

- Q4_K, Q5_K and Q6_K tensors keep their super-blocks byte for byte
  (``kquants.KQuantMatrix``: the file's d, dmin and 6-bit or int8 sub-scales, applied as
  the file's dequantization defines them); a fused q/k/v or gate/up whose parts differ in
  K-quant type is one matrix of segments.
- Q4_0, Q4_1, Q8_0 and Q5_0 tensors keep their codes (Q5_0's as int8) and their float16
  scales and minimums exactly (``quantized.BlockMatrix``).
- The input embedding of those types is read from its quantized rows, each looked-up row
  the file's dequantization cast to bfloat16 (``KQuantEmbedding``, ``BlockEmbedding``).

All of them multiply int8-quantized activations per block of 32, as llama.cpp does
(docs/quantization.md). Only Q5_1 and float tensors are widened to bfloat16. Without
the native kernels (no compiler, ``--kernels torch``), 4-bit tensors (Q4_K's sub-scales
folded into a float16 scale and minimum per 32) run PyTorch's int4 kernel and the rest is
dequantized to bfloat16. Any other type is refused, naming the tensor.
"""
from __future__ import annotations

import ctypes
import hashlib
import logging
import mmap
import os
import shutil
import weakref
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch import nn

from runtime.files import gguf_file, model_config, model_store
from runtime.matrices.kquants import SUPER_BLOCK, KQuantEmbedding, KQuantMatrix, raw_rows
from runtime.matrices.quantized import (
    ACTIVATIONS,
    BlockEmbedding,
    BlockMatrix,
    Int4Matrix,
    Int4Rows,
    block_kernels,
)
from runtime.matrices.weights import LayerWeights, Matrix, Product, Stacked, layer_norms
from runtime.models import skeleton
from runtime.models.skeleton import Skeleton
from runtime.native.kernels import resolve
from runtime.runner.batched import BatchedLM
from runtime.runner.causal_lm import CausalLM
from runtime.runner.memory import release_freed_memory

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from runtime.files.model_config import ModelConfig

log = logging.getLogger(__name__)

INT4_TYPES = frozenset({"Q4_0", "Q4_1", "Q4_K"})  # codes kept, as int4 groups of 32
# dequantized to bfloat16 (but where block products take them: BYTE_TYPES)
WIDE_TYPES = frozenset({"Q8_0", "Q5_0", "Q5_1", "Q5_K", "Q6_K", "F32", "F16", "BF16"})
SUPPORTED_TYPES = INT4_TYPES | WIDE_TYPES
# super-blocks of 256 kept as the file holds them: K-quant products (kquants.KQuantMatrix)
KQUANT_TYPES = frozenset({"Q4_K", "Q5_K", "Q6_K"})
# codes that fit int8 with a scale per 32 (Q5_0's are q - 16): block products' int8 matrices
BYTE_TYPES = frozenset({"Q8_0", "Q5_0"})
# block matrices hold their file's dequantization exactly (code * scale + low): a tied
# embedding is read from the head's blocks (Q4_K's are a 6-bit sub-scale times d, rounded)
EXACT_BLOCK_TYPES = frozenset({"Q4_0", "Q4_1", "Q8_0", "Q5_0"})
# GGUF tensor names of one layer, by the part of the fused matrices they make
QKV = ("attn_q", "attn_k", "attn_v")
GATE_UP = ("ffn_gate", "ffn_up")
FUSED = {"phi3": (("attn_qkv",), ("ffn_up",))}  # architectures storing them fused
PERMUTED_ARCHS = frozenset({"llama", "mistral"})  # q and k rows stored in rotary order
# a layer's norms: the module's name and the GGUF tensor's (Gemma 3's four, else two)
NORMS = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm"}
GEMMA_NORMS = {"input_layernorm": "attn_norm", "post_attention_layernorm": "post_attention_norm",
               "pre_feedforward_layernorm": "ffn_norm",
               "post_feedforward_layernorm": "post_ffw_norm"}


class GGUFTypeError(ValueError):
    """A GGUF tensor in a type this server cannot run."""


def load(path: str, dtype: str = "float32", device: str = "cpu",
         quantize: str = "auto", kernels: str = "auto", int8_activations: bool = True) -> CausalLM:
    """The runner for a GGUF file: its own weights (``quantize`` auto), or dequantized
    to ``dtype`` by transformers (``none``, the float model it stands for); ``kernels``:
    ``BatchedLM.use_kernels``; ``int8_activations``: ``GGUFModel.runner``."""
    file = Path(path)
    if quantize == "none":
        return _dequantized(file, dtype, device, kernels)
    if quantize != "auto":
        raise ValueError(f"{file.name} is quantized already: --quantize {quantize} applies to "
                         "model directories (use auto for the file's own weights, or none)")
    if device != "cpu":
        raise ValueError("a GGUF file's own weights run on a CPU only (--quantize none "
                         "dequantizes it)")
    runner = GGUFModel(file).runner(kernels, int8_activations)
    release_freed_memory()  # the loading's temporaries (the file's mapping is gone)
    return runner


class GGUFModel:
    """One GGUF file: its config, tokenizer and tensors."""

    def __init__(self, file: Path) -> None:
        self.file = file
        contents = gguf_file.read(file)  # its tensors, not its vocabulary (gguf_file)
        self.tensors = contents.tensors
        arch = contents.values.get("general.architecture")
        if arch is None:
            raise ValueError(f"{file.name}: no general.architecture in its metadata")
        self.arch = str(arch)
        self.config, self.tokenizer = config_and_tokenizer(file)
        self.blocks: ModuleType | None = None  # the kernels for BlockMatrix products, or None
        self.check_types()

    def check_types(self) -> None:
        for name, tensor in self.tensors.items():
            kind = tensor.tensor_type.name
            if kind not in SUPPORTED_TYPES:
                raise GGUFTypeError(
                    f"{self.file.name}: tensor {name!r} is of GGUF type {kind}, which this "
                    f"server cannot run; supported: {', '.join(sorted(SUPPORTED_TYPES))}")

    def runner(self, kernels: str = "auto", int8_activations: bool = True) -> BatchedLM:
        """The batched runner over the file's weights; ``int8_activations``: its 4-bit and
        Q8_0 matrices as ``BlockMatrix`` where the native kernels have block products."""
        model: Any = Skeleton(self.config, ACTIVATIONS,  # its linears on the meta device
                              name=str(self.file))
        # block products multiply any family's matrices, even where the layers run in PyTorch
        self.blocks = block_kernels(resolve(kernels, torch.device("cpu")), int8_activations)
        inner = model.model
        tied = "output.weight" not in self.tensors
        head: Product | None = None
        table = self.embedding_matrix(tied)
        embed_kind = self.tensors["token_embd.weight"].tensor_type.name
        embedding: torch.Tensor | None = None
        # rows read from the quantized matrix or the file: bitwise wide()'s rows
        if table is not None:  # a tied head's own matrix
            inner.embed_tokens = (KQuantEmbedding(table) if isinstance(table, KQuantMatrix)
                                  else BlockEmbedding(table))
            head = table
        elif not tied and embed_kind in KQUANT_TYPES:
            inner.embed_tokens = FileEmbedding(self.file, self.tensors["token_embd.weight"])
        else:
            embedding = self.wide("token_embd.weight")  # [vocab, hidden]
            inner.embed_tokens = nn.Embedding.from_pretrained(embedding, freeze=True)
        self.norm(inner.norm, "output_norm")
        layers = []
        for index, layer in enumerate(inner.layers):
            block = f"blk.{index}."
            names = GEMMA_NORMS if hasattr(layer, "pre_feedforward_layernorm") else NORMS
            for module, tensor in names.items():
                self.norm(getattr(layer, module), block + tensor)
            attention = layer.self_attn
            if hasattr(attention, "q_norm"):  # Qwen3, Gemma 3: each head's q and k normed
                self.norm(attention.q_norm, block + "attn_q_norm")
                self.norm(attention.k_norm, block + "attn_k_norm")
            qkv, gate_up = FUSED.get(self.arch, (QKV, GATE_UP))
            layers.append(LayerWeights(
                **layer_norms(layer), qkv=self.product([block + n for n in qkv]),
                o=self.product([block + "attn_output"]),
                gate_up=self.product([block + n for n in gate_up]),
                down=self.product([block + "ffn_down"])))
        if head is None:
            if tied:  # the head is the input embedding
                model.lm_head.weight = inner.embed_tokens.weight
                head = self.product(["token_embd"], rows=embedding)
            else:
                head = self.product(["output"])
        kinds = sorted({t.tensor_type.name for t in self.tensors.values()
                        if t.tensor_type.name in INT4_TYPES or len(t.shape) > 1})
        fmt = "gguf-" + "+".join(k.lower() for k in kinds)
        log.info("%s: %s, %d layers", self.file.name, fmt, len(layers))
        return BatchedLM(model, self.tokenizer, name=str(self.file), weights=layers,
                         head=head, weights_format=fmt, kernels=kernels)

    def embedding_matrix(self, tied: bool) -> KQuantMatrix | BlockMatrix | None:
        """A tied head's matrix, whose rows an input embedding lookup dequantizes exactly
        as the file does (a K-quant or exact block type, with the native kernels), else
        None."""
        kind = self.tensors["token_embd.weight"].tensor_type.name
        if not tied or self.blocks is None or kind not in KQUANT_TYPES | EXACT_BLOCK_TYPES:
            return None
        table = self.product(["token_embd"])
        return table if isinstance(table, (KQuantMatrix, BlockMatrix)) else None

    def product(self, names: list[str], rows: torch.Tensor | None = None) -> Product:
        """The matrices ``names`` (GGUF names without ``.weight``) as one product over
        their stacked rows: K-quant where every part is, else int4 where every part is
        int4, else bfloat16, else parts of each."""
        tensors = [self.tensors[n + ".weight"] for n in names]
        kinds = [t.tensor_type.name in INT4_TYPES for t in tensors]
        bias = self.bias(names)
        if (self.blocks is not None and all(t.tensor_type.name in KQUANT_TYPES for t in tensors)
                and int(tensors[0].shape[0]) % SUPER_BLOCK == 0):
            matrix = KQuantMatrix(self.blocks, [(t.tensor_type.name, self.raw(n))
                                                for n, t in zip(names, tensors, strict=True)],
                                  int(tensors[0].shape[0]), bias)
            for t in tensors:
                drop_pages(np.asarray(t.data))
            return matrix
        if all(kinds):
            rows4 = Int4Rows.cat([self.int4(n) for n in names])
            return (BlockMatrix.int4(self.blocks, rows4, bias) if self.blocks is not None
                    else Int4Matrix(rows4, bias))
        if self.blocks is not None and all(t.tensor_type.name in BYTE_TYPES for t in tensors):
            codes, scales = zip(*(self.int8(n) for n in names), strict=True)
            return BlockMatrix.int8(self.blocks, torch.cat(codes), torch.cat(scales), bias=bias)
        if not any(kinds):
            if rows is None:
                rows = torch.cat([self.wide(n + ".weight") for n in names])
            return Matrix(rows, bias)
        return Stacked([self.product([n]) for n in names])

    def bias(self, names: list[str]) -> torch.Tensor | None:
        """The matrices' biases (Qwen2's q, k and v have them) in one row, zeros for a
        part without one; None where none has."""
        if not any(n + ".bias" in self.tensors for n in names):
            return None
        rows = [int(self.tensors[n + ".weight"].shape[-1]) for n in names]
        return torch.cat([self.wide(n + ".bias") if n + ".bias" in self.tensors
                          else torch.zeros(r, dtype=ACTIVATIONS)
                          for n, r in zip(names, rows, strict=True)])

    def raw(self, name: str) -> torch.Tensor:  # [out, bytes a row] uint8
        """A quantized tensor's rows as the file stores them (a view of the mapping, or
        a copy with q/k rows reordered)."""
        rows = raw_rows(np.asarray(self.tensors[name + ".weight"].data))
        order = self.row_order(name)
        return rows[order] if order is not None else rows

    def int4(self, name: str) -> Int4Rows:
        tensor = self.tensors[name + ".weight"]
        rows = int4_rows(tensor.tensor_type.name, np.asarray(tensor.data), int(tensor.shape[0]))
        order = self.row_order(name)
        return rows.take(order) if order is not None else rows

    def norm(self, module: Any, name: str) -> None:
        """Fill a norm's weight from the file: Gemma's in float32 (which the norm computes
        in), as the file holds them (1 + weight: offset 0), others' in bfloat16."""
        if isinstance(module, skeleton.GemmaNorm):
            module.weight = _param(self.wide(name + ".weight", torch.float32))
            module.offset = 0.0
        else:
            module.weight = _param(self.wide(name + ".weight"))

    def int8(self, name: str) -> tuple[torch.Tensor, torch.Tensor]:
        """A Q8_0 or Q5_0 tensor's codes as int8 ``[out, in]`` (Q5_0's q - 16) and its
        float16 scales (as float32) ``[out, in / 32]``, q/k rows reordered: exactly the
        file's dequantization, code * scale."""
        tensor = self.tensors[name + ".weight"]
        data = np.asarray(tensor.data)
        out, inputs = data.shape[0], int(tensor.shape[0])
        codes, scale = byte_codes(tensor.tensor_type.name, data)
        codes_t = torch.from_numpy(codes.reshape(out, inputs))
        scale_t = torch.from_numpy(scale.reshape(out, inputs // 32))
        order = self.row_order(name)
        if order is not None:
            codes_t, scale_t = codes_t[order], scale_t[order]
        return codes_t, scale_t

    def wide(self, key: str, dtype: torch.dtype = ACTIVATIONS) -> torch.Tensor:
        """The tensor in ``dtype``, q/k rows reordered."""
        import gguf

        tensor = self.tensors.get(key)
        if tensor is None:
            raise ValueError(f"{self.file.name}: no tensor {key!r}, which its "
                             f"{self.arch} model needs")
        values = gguf.quants.dequantize(np.asarray(tensor.data), tensor.tensor_type)
        shape = [int(n) for n in reversed(tensor.shape.tolist())]
        out = torch.from_numpy(np.array(values, dtype=np.float32)).reshape(shape)  # a copy
        order = self.row_order(key.removesuffix(".weight"))
        return (out[order] if order is not None else out).to(dtype)

    def row_order(self, name: str) -> torch.Tensor | None:  # [out]
        """The Hugging Face row order of a q or k matrix (llama.cpp stores their rows
        interleaved per head for its rotary embedding)."""
        part = name.rsplit(".", 1)[-1]
        if self.arch not in PERMUTED_ARCHS or part not in ("attn_q", "attn_k"):
            return None
        config = self.config
        heads = int(config.num_attention_heads if part == "attn_q"
                    else config.num_key_value_heads)
        rows = int(self.tensors[name + ".weight"].shape[-1])
        return torch.arange(rows).view(heads, rows // heads // 2, 2).transpose(1, 2).reshape(-1)


class FileEmbedding(nn.Module):
    """An input embedding whose rows are read from the GGUF file as they are looked up
    (the operating system's cache keeps the file's pages, not the process), each row
    gguf's own dequantization in float32, then cast to ``dtype``: bitwise the rows of the
    dequantized table, which is never held (467 MB in bfloat16 for Qwen2.5's 151,936 x
    1,536; the file's own 131 MB of Q4_K rows stay on disk too)."""

    def __init__(self, file: Path, tensor: gguf_file.Tensor,
                 dtype: torch.dtype = ACTIVATIONS) -> None:
        super().__init__()
        data = np.asarray(tensor.data)  # [vocab, bytes a row], a view of the mapping
        self.kind = tensor.tensor_type
        self.num_embeddings, self.row_bytes = data.shape
        self.embedding_dim = int(tensor.shape[0])
        self.offset = mapped_offset(data)
        self.dtype = dtype
        self._fd = os.open(file, os.O_RDONLY)
        weakref.finalize(self, os.close, self._fd)  # closed with the module
        self.file = file
        # no weights of its own: an empty parameter tells whoever asks the model's first
        # parameter its device and dtype
        self.anchor = nn.Parameter(torch.empty(0, dtype=dtype), requires_grad=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:  # [...] -> [..., hidden]
        import gguf

        flat = ids.reshape(-1).tolist()
        raw = np.empty((len(flat), self.row_bytes), dtype=np.uint8)
        for i, row in enumerate(flat):
            if not 0 <= row < self.num_embeddings:
                raise IndexError(f"row {row} out of range for {self.num_embeddings} rows")
            if os.preadv(self._fd, [raw[i]], self.offset + row * self.row_bytes) != self.row_bytes:
                raise OSError(f"{self.file} is shorter than its header says")
        values = gguf.quants.dequantize(raw, self.kind).reshape(len(flat), -1)
        rows = torch.from_numpy(np.array(values, dtype=np.float32)).to(self.dtype)
        return rows.view(*ids.shape, self.embedding_dim)


def mapped_offset(data: np.ndarray) -> int:
    """Where ``data`` (a view of a mapped file, ``gguf_file``'s tensors) starts in the
    file."""
    root = data
    while isinstance(root.base, np.ndarray):
        root = root.base
    if not isinstance(root, np.memmap):
        raise ValueError("the tensor is not a view of a mapped file")
    return int(data.ctypes.data - root.ctypes.data) + int(root.offset)


def drop_pages(data: np.ndarray) -> None:
    """Let the pages of a mapped file under ``data`` go from this process's memory
    (madvise MADV_DONTNEED; the operating system's cache keeps them, and a later read
    maps them again): a tensor read once at load need not stay counted as the server's
    while the rest of the file is read."""
    page = mmap.PAGESIZE
    start = data.ctypes.data // page * page
    end = data.ctypes.data + data.nbytes
    if data.nbytes == 0 or not hasattr(mmap, "MADV_DONTNEED"):
        return
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise(ctypes.c_void_p(start), ctypes.c_size_t(end - start),
                 ctypes.c_int(mmap.MADV_DONTNEED))


def int4_rows(kind: str, data: np.ndarray, inputs: int) -> Int4Rows:
    """The 4-bit codes, scales and minimums of a Q4_0, Q4_1 or Q4_K tensor's blocks
    (``data``: ``[out, bytes per row]``), one scale and minimum per 32 inputs."""
    import gguf

    out = data.shape[0]
    if kind == "Q4_K":
        blocks = data.reshape(-1, 144)
        d = blocks[:, 0:2].copy().view(np.float16).astype(np.float32)  # [n, 1]
        dmin = blocks[:, 2:4].copy().view(np.float16).astype(np.float32)
        sc, mn = gguf.quants.Q4_K.get_scale_min(blocks[:, 4:16].copy())  # [n, 8] each
        scale, low = d * sc.astype(np.float32), -dmin * mn.astype(np.float32)
        qs = blocks[:, 16:].reshape(-1, 4, 1, 32)  # 4 x 32 bytes: sub-blocks 2j and 2j + 1
        codes = (qs >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)) & 15
    elif kind in ("Q4_0", "Q4_1"):
        size = 18 if kind == "Q4_0" else 20
        blocks = data.reshape(-1, size)
        scale = blocks[:, 0:2].copy().view(np.float16).astype(np.float32)  # [n, 1]
        low = (-8 * scale if kind == "Q4_0"
               else blocks[:, 2:4].copy().view(np.float16).astype(np.float32))
        qs = blocks[:, size - 16:]  # byte i: element i (low nibble) and 16 + i (high)
        codes = np.concatenate([qs & 15, qs >> 4], axis=1)
    else:
        raise GGUFTypeError(f"GGUF type {kind} has no int4 codes")
    groups = inputs // 32
    return Int4Rows(torch.from_numpy(np.ascontiguousarray(codes).reshape(out, inputs)),
                    torch.from_numpy(np.ascontiguousarray(scale).reshape(out, groups)),
                    torch.from_numpy(np.ascontiguousarray(low).reshape(out, groups)), 32)


def byte_codes(kind: str, data: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """A Q8_0 or Q5_0 tensor's int8 codes ``[blocks, 32]`` and scales ``[blocks, 1]``."""
    if kind == "Q8_0":
        blocks = data.reshape(-1, 34)  # a float16 scale, then 32 int8 codes
        return (blocks[:, 2:].copy().view(np.int8),
                blocks[:, 0:2].copy().view(np.float16).astype(np.float32))
    if kind != "Q5_0":
        raise GGUFTypeError(f"GGUF type {kind} has no int8 codes")
    # a float16 scale, 32 high bits (bit j: element j's fifth bit), then 16 bytes of low
    # nibbles (byte i: element i's, and element 16 + i's in its high half)
    blocks = data.reshape(-1, 22)
    high = blocks[:, 2:6].copy().view(np.uint32)  # [n, 1]
    fifth = (high >> np.arange(32, dtype=np.uint32)) & 1  # [n, 32]
    qs = blocks[:, 6:]
    low = np.concatenate([qs & 15, qs >> 4], axis=1).astype(np.int16)
    codes = (low | (fifth.astype(np.int16) << 4)) - 16
    return codes.astype(np.int8), blocks[:, 0:2].copy().view(np.float16).astype(np.float32)


def config_and_tokenizer(file: Path) -> tuple[ModelConfig, PreTrainedTokenizerBase]:
    """The model's config and tokenizer: from a model directory holding the file (the
    default model keeps its GGUF beside its converted directory's), else from the file,
    converted by transformers once and kept (``converted``)."""
    beside, kept = file.parent, converted(file)
    for directory in (beside, kept):
        if (directory / "config.json").is_file() and (directory / "tokenizer.json").is_file():
            config = model_config.model_config(directory)
            return config, model_config.tokenizer(directory, config)
    from transformers import AutoConfig, AutoTokenizer

    config = AutoConfig.from_pretrained(beside, gguf_file=file.name)
    tokenizer = AutoTokenizer.from_pretrained(beside, gguf_file=file.name)
    _keep(kept, config, tokenizer)
    return config, tokenizer


def converted(file: Path) -> Path:
    """Where the file's config and tokenizer are kept once transformers has converted them
    (each conversion parses the whole vocabulary: ~31 s for a 262k-token one here), by
    the file's path, size and modification time."""
    stat = file.stat()
    key = hashlib.sha256(f"{file.resolve()}:{stat.st_size}:{stat.st_mtime_ns}".encode())
    return model_store.home() / "gguf" / key.hexdigest()[:20]


def _keep(directory: Path, config: ModelConfig, tokenizer: PreTrainedTokenizerBase) -> None:
    """Save the converted config and tokenizer to ``directory``, whole or not at all (a
    failure costs the next start the conversion, never this one)."""
    staging = directory.with_name(f"{directory.name}.{os.getpid()}.tmp")
    try:
        shutil.rmtree(staging, ignore_errors=True)
        config.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        if not directory.exists():  # else another process kept them first
            staging.replace(directory)
    except OSError as exc:
        log.warning("could not keep the converted config and tokenizer in %s: %s",
                    directory, exc)
    shutil.rmtree(staging, ignore_errors=True)


def _dequantized(file: Path, dtype: str, device: str, kernels: str = "auto") -> CausalLM:
    from transformers import AutoModelForCausalLM

    from runtime.models.checkpoints import DTYPES

    _, tokenizer = config_and_tokenizer(file)
    model = AutoModelForCausalLM.from_pretrained(file.parent, gguf_file=file.name,
                                                 dtype=DTYPES[dtype])
    quantizer = getattr(model, "hf_quantizer", None)
    if quantizer is not None:
        quantizer.remove_quantization_config(model)
    model = torch.nn.Module.to(model, device)  # (transformers types .to oddly)
    return BatchedLM.wrap(model, tokenizer, name=str(file), kernels=kernels)


def _param(tensor: torch.Tensor) -> nn.Parameter:
    return nn.Parameter(tensor, requires_grad=False)
