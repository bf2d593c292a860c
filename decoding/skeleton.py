"""The batched families' modules, without transformers' model classes.

``BatchedLM`` runs its own forward pass: it reads a model's weights and calls its norms,
rotary embedding and activation, never the model's forward. transformers' model and
config classes cost a server ~175 MB of imports it has no other use for (the modeling
utilities bring torch.distributed, torch._dynamo, sympy and scipy; a config class its
activations and torch.distributed.tensor), so a served target and its draft are built
from these modules, their configs read by ``read_config``: transformers' parameter names
and arithmetic for Llama, Mistral, Qwen2 and Qwen3 (the same logits, bitwise:
``tests/test_skeleton.py``), no forward of the model's own. ``CausalLM`` (any family, one
sequence per pass) and training keep transformers' classes. The linears are made on the
meta device: whoever builds one fills what it reads (``fill``) or replaces the matrices
(a GGUF file's).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Mapping
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
from torch import nn
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS, dynamic_rope_update

from decoding import target
from decoding.target import DTYPES, attention_dims, unbatchable

log = logging.getLogger(__name__)

ACTIVATIONS: dict[str, Callable[[], nn.Module]] = {
    "silu": nn.SiLU, "swish": nn.SiLU, "relu": nn.ReLU, "gelu": nn.GELU,
    "gelu_pytorch_tanh": lambda: nn.GELU(approximate="tanh")}
META = torch.device("meta")
# kept in a file by some checkpoints, computed here
DERIVED = ("rotary_emb.inv_freq",)


# What a config.json may leave out, as transformers' config classes fill it in
DEFAULTS: dict[str, Any] = {
    "hidden_act": "silu", "rms_norm_eps": 1e-6, "attention_bias": False, "mlp_bias": False,
    "head_dim": None, "tie_word_embeddings": False, "num_key_value_heads": None}
FAMILY_DEFAULTS: dict[str, dict[str, Any]] = {
    "llama": {}, "mistral": {"sliding_window": 4096},
    "qwen2": {"sliding_window": 4096, "use_sliding_window": False},
    "qwen3": {"head_dim": 128, "sliding_window": 4096, "use_sliding_window": False}}
REQUIRED = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
            "vocab_size", "max_position_embeddings")
STATED = ("eos_token_id",)  # the families' defaults differ: read_config wants it stated


def read_config(values: Mapping[str, Any]) -> SimpleNamespace | None:
    """A model config's values (config.json's) as the skeleton and the runners read them,
    without transformers' config classes: importing any of them costs a process ~50 MB
    (their validators import the activations, which bring torch.distributed and sympy).
    None where transformers' class should read it: another family, a rope kind other
    than the default (its frequencies come from transformers' functions, given its
    class), a value left to a default not in ``DEFAULTS``."""
    family = values.get("model_type")
    if (family not in FAMILY_DEFAULTS or any(values.get(k) is None for k in REQUIRED)
            or any(k not in values for k in STATED)):
        return None
    rope = dict(values.get("rope_parameters") or values.get("rope_scaling") or {})
    if rope.get("rope_type", rope.get("type", "default")) != "default":
        return None
    theta = rope.get("rope_theta", values.get("rope_theta")) or 10000.0
    config = {**DEFAULTS, **FAMILY_DEFAULTS[family], **values,
              "rope_parameters": {"rope_type": "default", "rope_theta": float(theta)}}
    if config["num_key_value_heads"] is None:
        config["num_key_value_heads"] = config["num_attention_heads"]
    return SimpleNamespace(**config)


def model_config(directory: Path) -> Any:
    """The directory's config: ``read_config``'s, else transformers' ``AutoConfig``."""
    light = read_config(json.loads((directory / "config.json").read_text()))
    if light is not None:
        return light
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(directory)


def tokenizer(directory: Path, config: Any) -> Any:
    """The directory's tokenizer by ``AutoTokenizer``, given ``config`` where it names its
    tokenizer class itself (else AutoTokenizer reads the model's config, by its class)."""
    from transformers import AutoTokenizer

    settings = directory / "tokenizer_config.json"
    named = settings.is_file() and "tokenizer_class" in json.loads(settings.read_text())
    if isinstance(config, SimpleNamespace) and named:
        return AutoTokenizer.from_pretrained(directory, config=config)
    return AutoTokenizer.from_pretrained(directory)


def unbuildable(config: Any) -> str | None:
    """Why ``config``'s model cannot be built from these modules, or None."""
    reason = unbatchable(config)
    if reason is not None:
        return reason
    act = getattr(config, "hidden_act", "silu")
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


class Rotary(nn.Module):
    """cos/sin of each position times the inverse frequencies (repeated over both halves
    of a head), scaled; the frequencies from the config's rope type."""

    inv_freq: torch.Tensor

    def __init__(self, config: Any) -> None:
        super().__init__()
        self.config = config
        self.rope_type = config.rope_parameters["rope_type"]
        self.max_seq_len_cached = self.original_max_seq_len = config.max_position_embeddings
        if self.rope_type == "default":
            _, _, dim = attention_dims(config)
            steps = torch.arange(0, dim, 2, dtype=torch.float, device="cpu")
            inv_freq = 1.0 / (config.rope_parameters["rope_theta"] ** (steps / dim))
            self.attention_scaling = 1.0
        else:
            inv_freq, self.attention_scaling = ROPE_INIT_FUNCTIONS[self.rope_type](
                config, torch.device("cpu"))
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
    def __init__(self, config: Any, dtype: torch.dtype) -> None:
        super().__init__()
        heads, kv_heads, self.head_dim = attention_dims(config)
        hidden = int(config.hidden_size)
        family = config.model_type
        qkv_bias = family == "qwen2" or bool(getattr(config, "attention_bias", False))
        o_bias = family in ("llama", "qwen3") and bool(getattr(config, "attention_bias", False))
        self.q_proj = _linear(hidden, heads * self.head_dim, qkv_bias, dtype)
        self.k_proj = _linear(hidden, kv_heads * self.head_dim, qkv_bias, dtype)
        self.v_proj = _linear(hidden, kv_heads * self.head_dim, qkv_bias, dtype)
        self.o_proj = _linear(heads * self.head_dim, hidden, o_bias, dtype)
        self.scaling = self.head_dim ** -0.5
        if family == "qwen3":  # each head's q and k normed before the rotary embedding
            eps = float(config.rms_norm_eps)
            self.q_norm = RMSNorm(self.head_dim, eps, dtype)
            self.k_norm = RMSNorm(self.head_dim, eps, dtype)


class MLP(nn.Module):
    def __init__(self, config: Any, dtype: torch.dtype) -> None:
        super().__init__()
        hidden, inner = int(config.hidden_size), int(config.intermediate_size)
        bias = config.model_type == "llama" and bool(getattr(config, "mlp_bias", False))
        self.gate_proj = _linear(hidden, inner, bias, dtype)
        self.up_proj = _linear(hidden, inner, bias, dtype)
        self.down_proj = _linear(inner, hidden, bias, dtype)
        self.act_fn = ACTIVATIONS[getattr(config, "hidden_act", "silu")]()


class Layer(nn.Module):
    def __init__(self, config: Any, dtype: torch.dtype) -> None:
        super().__init__()
        self.self_attn = Attention(config, dtype)
        self.mlp = MLP(config, dtype)
        eps = float(config.rms_norm_eps)
        self.input_layernorm = RMSNorm(config.hidden_size, eps, dtype)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps, dtype)


class Decoder(nn.Module):
    def __init__(self, config: Any, dtype: torch.dtype) -> None:
        super().__init__()
        self.embed_tokens = Embedding(config.vocab_size, config.hidden_size, device=META,
                                        dtype=dtype)
        self.embed_tokens.requires_grad_(False)
        self.layers = nn.ModuleList(Layer(config, dtype)
                                    for _ in range(int(config.num_hidden_layers)))
        self.norm = RMSNorm(config.hidden_size, float(config.rms_norm_eps), dtype)
        self.rotary_emb = Rotary(config)


class Skeleton(nn.Module):
    """A causal LM's modules under transformers' names (``model.layers.N...``,
    ``lm_head``), for ``BatchedLM`` to run."""

    weight_files: tuple[Path, ...] = ()  # the safetensors files it was filled from

    def __init__(self, config: Any, dtype: torch.dtype,
                 generation: Mapping[str, Any] | None = None, name: str = "model") -> None:
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

    def get_output_embeddings(self) -> nn.Module:
        return self.lm_head

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError("a skeleton has no forward pass of its own: BatchedLM "
                                  "runs its modules")

    def fill(self, state: Mapping[str, torch.Tensor], where: str) -> None:
        """Every parameter from ``state`` (transformers' names), converted to the
        skeleton's dtype; a tied head is the embedding. Raises naming what is missing."""
        tied = getattr(self.config, "tie_word_embeddings", False)
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


def generation_settings(directory: Path) -> dict[str, Any]:
    """A model directory's ``generation_config.json`` (its end-of-sequence ids), or {}."""
    path = directory / "generation_config.json"
    if not path.is_file():
        return {}
    settings: dict[str, Any] = json.loads(path.read_text())
    return settings


def safetensors_files(directory: Path) -> list[Path]:
    """The directory's safetensors weights (one file or an index's shards), or []."""
    single = directory / "model.safetensors"
    if single.is_file():
        return [single]
    index = directory / "model.safetensors.index.json"
    if not index.is_file():
        return []
    shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    return [directory / name for name in shards]


def pretrained(path: str, dtype: str, device: str) -> tuple[Any, Any]:
    """A model directory's model in ``dtype`` on ``device`` and its tokenizer: a skeleton
    where it can be one (a batched family in safetensors), else transformers' model
    (``target.pretrained``)."""
    if dtype not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; choose one of {sorted(DTYPES)}")
    directory = Path(path)
    files = safetensors_files(directory) if directory.is_dir() else []
    config = model_config(directory) if files else None
    if config is None or unbuildable(config) is not None:
        return target.pretrained(path, dtype, device)
    model = Skeleton(config, DTYPES[dtype], generation_settings(directory))
    model.fill(read_safetensors(files), str(directory))
    model.weight_files = tuple(files)  # where a server may read rows later (its input embedding)
    return model.to(device).eval(), tokenizer(directory, config)


def read_safetensors(files: list[Path]) -> dict[str, torch.Tensor]:
    from safetensors import safe_open

    state: dict[str, torch.Tensor] = {}
    for file in files:
        with safe_open(str(file), framework="pt") as weights:
            for key in weights.keys():  # noqa: SIM118 (a safetensors handle, not a dict)
                state[key] = weights.get_tensor(key)
    return state
