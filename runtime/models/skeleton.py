"""The batched families' modules, without transformers' model classes.

``BatchedLM`` runs its own forward pass: it reads a model's weights and calls its norms,
rotary embedding and activation, never the model's forward. transformers' model and
config classes cost a server ~175 MB of imports it has no other use for (the modeling
utilities bring torch.distributed, torch._dynamo, sympy and scipy; a config class its
activations and torch.distributed.tensor), so a served target and its draft are built
from these modules, their configs read by ``model_config.read_config``: transformers'
parameter names and arithmetic for Llama, Mistral, Qwen2 and Qwen3 (the same logits,
bitwise: ``tests/test_skeleton.py``), Phi-3 (its fused projections split into these) and
Gemma 3 (transformers' logits to float32's rounding: ``tests/test_gemma.py``), no forward
of the model's own. ``TransformersLM`` (any family, one
sequence per pass) and training keep transformers' classes. The linears are made on the
meta device: whoever builds one fills what it reads (``fill``) or replaces the matrices
(a GGUF file's).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from pathlib import Path
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS, dynamic_rope_update

from runtime.models.families import (
    FUSED_FAMILIES,
    GEMMA_FAMILIES,
    activation,
    attention_dims,
    layer_window,
    unbatchable,
)

if TYPE_CHECKING:
    from transformers import PreTrainedModel

    from runtime.files.model_config import ModelConfig

log = logging.getLogger(__name__)

ACTIVATIONS: dict[str, Callable[[], nn.Module]] = {
    "silu": nn.SiLU, "swish": nn.SiLU, "relu": nn.ReLU, "gelu": nn.GELU,
    "gelu_pytorch_tanh": lambda: nn.GELU(approximate="tanh")}
META = torch.device("meta")
# kept in a file by some checkpoints, computed here
DERIVED = ("rotary_emb.inv_freq",)


def unbuildable(config: ModelConfig) -> str | None:
    """Why ``config``'s model cannot be built from these modules, or None."""
    reason = unbatchable(config)
    if reason is not None:
        return reason
    act = activation(config)
    if act not in ACTIVATIONS:
        return f"activation {act!r} is not one of {sorted(ACTIVATIONS)}"
    return None


class RMSNorm(nn.Module):
    """x / rms(x) * weight, computed in float32 and rounded to the input's dtype before
    the weight multiplies it (as transformers' Llama does)."""

    def __init__(self, size: int, eps: float, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(size, dtype=dtype, device=META),
                                   requires_grad=False)
        self.variance_epsilon = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        wide = x.to(torch.float32)
        wide = wide * torch.rsqrt(wide.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        return self.weight * wide.to(x.dtype)


class GemmaNorm(nn.Module):
    """Gemma's RMS norm: x / rms(x) * (offset + weight), all in float32, then rounded to
    the input's dtype (as transformers' Gemma 3 does). ``offset`` is 1 for transformers'
    weights and 0 for a GGUF file's, which hold 1 + weight."""

    def __init__(self, size: int, eps: float, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(size, dtype=dtype, device=META),
                                   requires_grad=False)
        self.eps = eps
        self.offset = 1.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        wide = x.to(torch.float32)
        wide = wide * torch.rsqrt(wide.pow(2).mean(-1, keepdim=True) + self.eps)
        return (wide * (self.offset + self.weight.float())).to(x.dtype)


def _norm(config: ModelConfig, size: int, dtype: torch.dtype) -> nn.Module:
    kind = GemmaNorm if config.model_type in GEMMA_FAMILIES else RMSNorm
    return kind(size, float(config.rms_norm_eps), dtype)


class Rotary(nn.Module):
    """cos/sin of each position times the inverse frequencies (repeated over both halves
    of a head), scaled; the frequencies from the config's rope type (``layer_type``'s,
    where the config has rope parameters per kind of layer: Gemma 3's)."""

    inv_freq: torch.Tensor

    def __init__(self, config: ModelConfig, layer_type: str | None = None) -> None:
        super().__init__()
        self.config = config
        params = config.rope_parameters
        params = params[layer_type] if layer_type is not None else params
        self.rope_type = params["rope_type"]
        self.max_seq_len_cached = self.original_max_seq_len = config.max_position_embeddings
        if self.rope_type == "default":
            _, _, dim = attention_dims(config)
            steps = torch.arange(0, dim, 2, dtype=torch.float, device="cpu")
            inv_freq = 1.0 / (params["rope_theta"] ** (steps / dim))
            self.attention_scaling = 1.0
        else:
            kind = {} if layer_type is None else {"layer_type": layer_type}
            inv_freq, self.attention_scaling = ROPE_INIT_FUNCTIONS[self.rope_type](
                config, torch.device("cpu"), **kind)
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.register_buffer("original_inv_freq", inv_freq.clone(), persistent=False)

    @dynamic_rope_update  # rope types whose frequencies follow the sequence's length
    def forward(self, x: torch.Tensor, positions: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
        angles = positions[..., None].float() * self.inv_freq.to(x.device, torch.float)
        both = torch.cat((angles, angles), dim=-1)
        return ((both.cos() * self.attention_scaling).to(x.dtype),
                (both.sin() * self.attention_scaling).to(x.dtype))


class _Linear(nn.Linear):
    def reset_parameters(self) -> None:  # made on the meta device, to be filled: no init
        pass


class Embedding(nn.Embedding):
    """An input embedding whose rows may be read from elsewhere than a table it holds:
    from ``rows`` (``memory.FileRows``: the weights file), each looked-up row converted
    to the embedding's dtype, bitwise the table's row."""

    rows: Callable[[torch.Tensor], torch.Tensor] | None = None

    def reset_parameters(self) -> None:  # (initializing a meta tensor imports torch._dynamo)
        pass

    def forward(self, ids: torch.Tensor) -> torch.Tensor:  # [...] -> [..., hidden]
        if self.rows is None:
            return super().forward(ids)
        return self.rows(ids).to(self.weight.dtype)

    def read_rows_from(self, rows: Callable[[torch.Tensor], torch.Tensor]) -> None:
        """Look rows up with ``rows`` (ids ``[...]`` -> ``[..., hidden]``; converted to
        this embedding's dtype, its own rows) and let the table go; the weight becomes
        an empty tensor that still tells the embedding's dtype and device."""
        self.rows = rows
        self.weight = nn.Parameter(self.weight.new_empty(0), requires_grad=False)


class ConvertedEmbedding(nn.Module):
    """Another embedding's rows converted to ``dtype`` as they are looked up (a draft in
    bfloat16 beside a float32 target): bitwise the rows of a converted copy of the table,
    which is then never held. ``source`` stays its owner's module, not a submodule."""

    def __init__(self, source: nn.Module, dtype: torch.dtype) -> None:
        super().__init__()
        self.source = (source,)
        self.num_embeddings = int(getattr(source, "num_embeddings", 0))
        self.embedding_dim = int(getattr(source, "embedding_dim", 0))
        device = next(source.parameters()).device
        # no table: an empty parameter tells whoever asks its dtype and device
        self.weight = nn.Parameter(torch.empty(0, dtype=dtype, device=device),
                                   requires_grad=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:  # [...] -> [..., hidden]
        rows: torch.Tensor = self.source[0](ids)
        return rows.to(self.weight.dtype)


def _linear(inputs: int, outputs: int, bias: bool, dtype: torch.dtype) -> nn.Linear:
    linear = _Linear(inputs, outputs, bias=bias, device=META, dtype=dtype)
    linear.requires_grad_(False)
    return linear


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, dtype: torch.dtype, index: int) -> None:
        super().__init__()
        heads, kv_heads, self.head_dim = attention_dims(config)
        hidden = int(config.hidden_size)
        family = config.model_type
        gemma = family in GEMMA_FAMILIES
        qkv_bias = family == "qwen2" or bool(getattr(config, "attention_bias", False))
        o_bias = (family in ("llama", "qwen3") or gemma) and bool(
            getattr(config, "attention_bias", False))
        self.q_proj = _linear(hidden, heads * self.head_dim, qkv_bias, dtype)
        self.k_proj = _linear(hidden, kv_heads * self.head_dim, qkv_bias, dtype)
        self.v_proj = _linear(hidden, kv_heads * self.head_dim, qkv_bias, dtype)
        self.o_proj = _linear(heads * self.head_dim, hidden, o_bias, dtype)
        self.scaling = (float(config.query_pre_attn_scalar) if gemma else self.head_dim) ** -0.5
        # keys a query sees: its own and those of the window - 1 positions before it (None: all)
        self.window = layer_window(config, index)
        if family == "qwen3" or gemma:  # each head's q and k normed before the rotary embedding
            self.q_norm = _norm(config, self.head_dim, dtype)
            self.k_norm = _norm(config, self.head_dim, dtype)


class MLP(nn.Module):
    def __init__(self, config: ModelConfig, dtype: torch.dtype) -> None:
        super().__init__()
        hidden, inner = int(config.hidden_size), int(config.intermediate_size)
        bias = config.model_type == "llama" and bool(getattr(config, "mlp_bias", False))
        self.gate_proj = _linear(hidden, inner, bias, dtype)
        self.up_proj = _linear(hidden, inner, bias, dtype)
        self.down_proj = _linear(inner, hidden, bias, dtype)
        self.act_fn = ACTIVATIONS[activation(config)]()


class Layer(nn.Module):
    """A decoder layer. Gemma's norm attention's output (``post_attention_layernorm``)
    and the MLP's input and output (``pre_``/``post_feedforward_layernorm``) too."""

    def __init__(self, config: ModelConfig, dtype: torch.dtype, index: int) -> None:
        super().__init__()
        self.self_attn = Attention(config, dtype, index)
        self.mlp = MLP(config, dtype)
        size = int(config.hidden_size)
        self.input_layernorm = _norm(config, size, dtype)
        self.post_attention_layernorm = _norm(config, size, dtype)
        if config.model_type in GEMMA_FAMILIES:
            self.pre_feedforward_layernorm = _norm(config, size, dtype)
            self.post_feedforward_layernorm = _norm(config, size, dtype)


class Decoder(nn.Module):
    def __init__(self, config: ModelConfig, dtype: torch.dtype) -> None:
        super().__init__()
        self.embed_tokens = Embedding(config.vocab_size, config.hidden_size, device=META,
                                        dtype=dtype)
        self.embed_tokens.requires_grad_(False)
        self.layers = nn.ModuleList(Layer(config, dtype, i)
                                    for i in range(int(config.num_hidden_layers)))
        self.norm = _norm(config, int(config.hidden_size), dtype)
        gemma = config.model_type in GEMMA_FAMILIES
        # what the embedding's rows are multiplied by (Gemma's sqrt(hidden)), or None
        self.embed_scale = float(config.hidden_size) ** 0.5 if gemma else None
        # Gemma 3: the global layers' rotary embedding, and the sliding-window layers' own
        self.rotary_emb = Rotary(config, "full_attention" if gemma else None)
        if gemma:
            self.rotary_local = Rotary(config, "sliding_attention")


class Skeleton(nn.Module):
    """A causal LM's modules under transformers' names (``model.layers.N...``,
    ``lm_head``), for ``BatchedLM`` to run."""

    weight_files: tuple[Path, ...] = ()  # the safetensors files it was filled from
    is_skeleton = True  # (``families.supports``: these modules, not transformers')

    def __init__(self, config: ModelConfig, dtype: torch.dtype,
                 generation: Mapping[str, object] | None = None, name: str = "model") -> None:
        super().__init__()
        reason = unbuildable(config)
        if reason is not None:
            raise ValueError(f"{name}: cannot run batched: {reason}")
        self.config = config
        self.model = Decoder(config, dtype)
        self.lm_head = _linear(config.hidden_size, config.vocab_size, False, dtype)
        eos = (generation or {}).get("eos_token_id", getattr(config, "eos_token_id", None))
        self.generation_config = SimpleNamespace(eos_token_id=eos)
        if getattr(config, "tie_word_embeddings", False):
            self.lm_head.weight = self.model.embed_tokens.weight

    @property
    def dtype(self) -> torch.dtype:
        return next(self.parameters()).dtype

    def get_input_embeddings(self) -> nn.Module:
        return self.model.embed_tokens

    def get_output_embeddings(self) -> nn.Linear:
        return self.lm_head

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError("a skeleton has no forward pass of its own: BatchedLM "
                                  "runs its modules")

    def fill(self, state: Mapping[str, torch.Tensor], where: str) -> None:
        """Every parameter from ``state`` (transformers' names), converted to the
        skeleton's dtype; a tied head is the embedding. Raises naming what is missing."""
        tied = getattr(self.config, "tie_word_embeddings", False)
        if self.config.model_type in FUSED_FAMILIES:
            state = split_fused(state, self.config)
        own = dict(self.named_parameters(remove_duplicate=False))
        missing = sorted(k for k in own if k not in state and not (tied and k == "lm_head.weight"))
        if missing:
            raise ValueError(f"{where} lacks {len(missing)} of the model's weights, e.g. "
                             f"{missing[:3]}")
        unknown = sorted(k for k in state if k not in own and not k.endswith(DERIVED))
        if unknown:
            log.warning("%s: %d weights the model does not use, e.g. %s", where, len(unknown),
                        unknown[:3])
        for name, param in own.items():
            if tied and name == "lm_head.weight":
                continue
            parent, _, leaf = name.rpartition(".")
            setattr(self.get_submodule(parent), leaf,
                    nn.Parameter(state[name].to(param.dtype), requires_grad=False))
        if tied:
            self.lm_head.weight = self.model.embed_tokens.weight


def split_fused(state: Mapping[str, torch.Tensor],
                config: ModelConfig) -> dict[str, torch.Tensor]:
    """``state`` with fused projections (Phi-3's ``qkv_proj``, ``gate_up_proj``) as the
    separate ones the skeleton has: views of their rows."""
    heads, kv_heads, dim = attention_dims(config)
    parts = {"self_attn.qkv_proj.weight": (("q_proj", heads * dim), ("k_proj", kv_heads * dim),
                                           ("v_proj", kv_heads * dim)),
             "mlp.gate_up_proj.weight": (("gate_proj", int(config.intermediate_size)),
                                         ("up_proj", int(config.intermediate_size)))}
    out: dict[str, torch.Tensor] = {}
    for key, tensor in state.items():
        fused = next((f for f in parts if key.endswith(f)), None)
        if fused is None:
            out[key] = tensor
            continue
        module = key.removesuffix(fused) + fused.split(".")[0]
        names, sizes = zip(*parts[fused], strict=True)
        for part, rows in zip(names, tensor.split(list(sizes)), strict=True):
            out[f"{module}.{part}.weight"] = rows
    return out


def rebuilt(model: PreTrainedModel, name: str) -> Skeleton:
    """transformers' ``model`` (a batched family's) as a skeleton over the same tensors, for
    the models the runner takes only as a skeleton (``families.needs_skeleton``)."""
    eos = getattr(model.generation_config, "eos_token_id", None)
    skeleton = Skeleton(model.config, model.dtype, {"eos_token_id": eos}, name=name)
    skeleton.fill(model.state_dict(), name)  # no copy: the same dtype
    return skeleton.to(next(model.parameters()).device).eval()
