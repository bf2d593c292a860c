"""A Hugging Face causal LM with its KV cache kept between rounds, and what a pass takes.

The same runner serves as the target and as a model drafter: prefill a prompt,
score a few tokens in one forward pass, roll the cache back to a length. ``BatchItem``
and ``TargetCapabilities`` are the runtime's side of ``decoding.target.Target``.
"""

from __future__ import annotations

import logging
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import DynamicCache

log = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class TokenizerMismatchError(ValueError):
    """The draft and the target do not share a vocabulary."""


@dataclass(frozen=True)
class TargetCapabilities:
    """What a target runner can do, declared rather than probed."""

    batched: bool  # ``forward_batch`` runs its sequences in one forward pass
    branches: bool  # ``forward_batch`` takes ``BatchItem.alternative`` (a two-branch tree)
    features: bool = False  # a pass gives final hidden states (``BatchItem.features``) and
    # starts from given rows (``BatchItem.inputs``)


@dataclass
class CacheState:
    """One sequence's KV cache and how many tokens it holds."""

    cache: DynamicCache
    length: int = 0


@dataclass(frozen=True)
class BatchItem:
    """Tokens to append to one sequence; the logits after the last ``keep`` of them
    come back (0: none, e.g. a prefill chunk that is not the prompt's last).

    ``alternative``: the last token is not the next in line but a second candidate for
    ``token_ids[1]``'s position (a branch of a token tree): it sees the cache and
    ``token_ids[0]`` only, and only the tokens before it see nothing of it. Only a
    runner with ``branches`` takes one; its KV sits after the others' until
    ``adopt_alternative`` moves it into place."""

    state: Any
    token_ids: Sequence[int]
    keep: int
    alternative: bool = False
    features: bool = False  # the pass also gives every new token's final hidden state
    inputs: torch.Tensor | None = None  # [n, H]: the rows the layers start from, in place
    # of the tokens' embeddings (a draft that reads the target's features makes them)


@dataclass
class PreparedPass:
    """A forward pass made ready to run (``prepare_pass``): its items, and whatever the
    runner built for it before its long call (the layout, the embedded tokens)."""

    items: Sequence[BatchItem]
    work: Any = None
    # after the run, per item: its new tokens' final hidden states (normed by the final
    # norm: what the output head reads), [n, H], where the item asked for them, else None
    features: list[torch.Tensor | None] = field(default_factory=list)
    # and, on a runner capturing layers (``BatchedLM.capture_layers``), those layers'
    # outputs (the residual stream after each), side by side: [n, layers * H]
    layers: list[torch.Tensor | None] = field(default_factory=list)


def head_subset(model: Any) -> torch.Tensor | None:  # [K]
    """The vocabulary ids of the output head's rows when it covers only part of the
    vocabulary (a distilled draft's head keeps ``ids`` and the full ``vocab_size``)."""
    return getattr(model.get_output_embeddings(), "ids", None)


BATCHED_MODEL_TYPES = frozenset({"llama", "mistral", "qwen2", "qwen3", "phi3", "gemma3_text"})
# families whose layers are Gemma's: norms of (1 + weight) after attention and around the MLP,
# scaled embeddings, sliding-window layers with their own rotary base
GEMMA_FAMILIES = frozenset({"gemma3_text"})
# families whose every layer attends within ``sliding_window`` positions, where it is set
WINDOWED_FAMILIES = frozenset({"mistral", "phi3"})
# families whose files fuse q/k/v (``qkv_proj``) and gate/up (``gate_up_proj``)
FUSED_FAMILIES = frozenset({"phi3"})
# Why a family's decoder layers are not the batched runner's, which are Llama's (RMS
# pre-norms, separate q/k/v and gate/up projections, rotary on all of q and k, SiLU gating)
FAMILY_GAPS = {
    "gemma": "its RMS norms scale by 1 + weight, its embeddings by sqrt(hidden), and its MLP "
             "gates with GELU",
    "gemma2": "it soft-caps attention scores and logits, alternates sliding-window and global "
              "layers, adds norms after attention and MLP, and gates with GELU",
    "phi": "its attention and MLP run side by side off one LayerNorm, with a partial rotary "
           "embedding and GELU",
}


def unsupported_family(model_type: str | None, supported: Collection[str]) -> str:
    """One line: the model type is not a batched family, and where it is a known one, what
    its layers do that the batched runner's do not."""
    line = f"model type {model_type!r} is not one of {sorted(supported)}"
    gap = FAMILY_GAPS.get(model_type or "")
    return f"{line}: {gap}" if gap else line


def supports(model: Any) -> str | None:
    """Why ``model`` cannot run batched (``batched.BatchedLM``), or None when it can."""
    reason = unbatchable(model.config)
    if reason is not None:
        return reason
    inner = getattr(model, "model", None)
    if inner is None or not hasattr(inner, "layers") or not hasattr(inner, "rotary_emb"):
        return "the model does not have the usual decoder layout"
    if needs_skeleton(model.config) and not getattr(model, "is_skeleton", False):
        return ("transformers' modules of this model (sliding windows, fused projections or "
                "a rotary embedding per kind of layer) are not the runner's: its skeleton's are")
    return None


def needs_skeleton(config: Any) -> bool:
    """Whether the runner takes a model of ``config`` only as ``skeleton.Skeleton``'s
    modules (which ``BatchedLM.wrap`` rebuilds from transformers' model)."""
    family = getattr(config, "model_type", None)
    return (family in GEMMA_FAMILIES or family in FUSED_FAMILIES
            or any(layer_window(config, i) for i in range(int(config.num_hidden_layers))))


def layer_window(config: Any, index: int) -> int | None:
    """How many positions up to its own a query of layer ``index`` sees (its own
    included), or None: all of them."""
    family = getattr(config, "model_type", None)
    window = getattr(config, "sliding_window", None)
    if family in GEMMA_FAMILIES:
        sliding = config.layer_types[index] == "sliding_attention"
        return int(window) if sliding and window else None
    longest = getattr(config, "max_position_embeddings", None) or 1 << 30
    if family in WINDOWED_FAMILIES and window and window < longest:
        return int(window)
    return None


def activation(config: Any) -> str:
    """The MLP's activation as a config names it (Gemma's ``hidden_activation``)."""
    return str(getattr(config, "hidden_activation", None)
               or getattr(config, "hidden_act", None) or "silu")


def unbatchable(config: Any) -> str | None:
    """Why a model of ``config`` cannot run batched, or None when its family and
    attention can."""
    model_type = getattr(config, "model_type", None)
    if model_type not in BATCHED_MODEL_TYPES:
        return unsupported_family(model_type, BATCHED_MODEL_TYPES)
    if model_type in GEMMA_FAMILIES:
        return _gemma_gap(config)
    if model_type == "phi3":
        rope = config.rope_parameters
        if rope.get("partial_rotary_factor", 1.0) != 1.0:
            return "its rotary embedding covers part of each head (partial_rotary_factor)"
        if rope.get("rope_type", "default") != "default":
            return ("its long-context rotary embedding recomputes every cached position once "
                    "a sequence passes original_max_position_embeddings")
    if model_type in WINDOWED_FAMILIES:
        return None  # each layer's window: layer_window
    window = getattr(config, "sliding_window", None)
    longest = getattr(config, "max_position_embeddings", None) or 1 << 30
    if window and getattr(config, "use_sliding_window", True) and window < longest:
        return "sliding-window attention is not supported"
    return None


def _gemma_gap(config: Any) -> str | None:
    """Why a Gemma 3 model cannot run batched (its sliding-window layers can), or None."""
    if getattr(config, "use_bidirectional_attention", False):
        return "its attention is bidirectional"
    for what in ("attn_logit_softcapping", "final_logit_softcapping"):
        if getattr(config, what, None) is not None:
            return f"it soft-caps scores ({what})"
    kinds = {p.get("rope_type", "default") for p in config.rope_parameters.values() if p}
    if kinds - {"default", "linear"}:
        return f"rope types {sorted(kinds)}: only default and linear run per kind of layer"
    return None


def attention_dims(config: Any) -> tuple[int, int, int]:
    """Query heads, key/value heads and the size of a head, from a transformers config."""
    heads = int(config.num_attention_heads)
    kv_heads = int(getattr(config, "num_key_value_heads", None) or heads)
    head_dim = int(getattr(config, "head_dim", None) or config.hidden_size // heads)
    return heads, kv_heads, head_dim


def kv_position_bytes(config: Any, dtype: torch.dtype) -> int:
    """The keys and values of every layer for one position of one sequence, in bytes."""
    _, kv_heads, head_dim = attention_dims(config)
    element = torch.empty((), dtype=dtype).element_size()
    return 2 * int(config.num_hidden_layers) * kv_heads * head_dim * element


def output_vocab_size(model: Any) -> int:
    """How many vocabulary logits the model returns (all of them, for a subset head)."""
    head = model.get_output_embeddings()
    return int(head.vocab_size if head_subset(model) is not None else head.weight.shape[0])


class CausalLM:
    """Prefill / score / rollback over a transformers causal LM, one sequence per
    forward pass (the ``Target`` of models the batched runner does not cover)."""

    capabilities = TargetCapabilities(batched=False, branches=False)

    def __init__(self, model: Any, tokenizer: Any, name: str = "model") -> None:
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.name = name
        self.device = next(model.parameters()).device
        self.dtype = next(model.parameters()).dtype
        config = model.config
        self.vocab_size = output_vocab_size(model)
        self.max_context = int(getattr(config, "max_position_embeddings", 0) or 1 << 30)
        self.eos_token_ids = frozenset(eos_ids(model, tokenizer))
        self.heads, self.kv_heads, self.head_dim = attention_dims(config)
        self.hidden_size = int(config.hidden_size)
        self.kv_position_bytes = kv_position_bytes(config, self.dtype)

    @classmethod
    def load(cls, path: str, dtype: str = "float32", device: str = "cpu") -> CausalLM:
        return cls.wrap(*pretrained(path, dtype, device), name=str(path))

    @classmethod
    def wrap(cls, model: Any, tokenizer: Any, name: str) -> CausalLM:
        """The runner for a loaded model (a subclass may fall back to this class)."""
        return cls(model, tokenizer, name=name)

    def new_state(self) -> CacheState:
        return CacheState(cache=DynamicCache(config=self.model.config))

    @torch.inference_mode()
    def prefill(self, state: CacheState, token_ids: Sequence[int]) -> torch.Tensor:  # [vocab]
        """Append ``token_ids`` to the cache; return the logits after the last one."""
        return self._forward(state, token_ids, keep=1)[0]

    @torch.inference_mode()
    def score(self, state: CacheState, token_ids: Sequence[int]) -> torch.Tensor:  # [n, vocab]
        """Append ``token_ids`` to the cache; return the logits after each of them."""
        return self._forward(state, token_ids, keep=len(token_ids))

    def adopt_alternative(self, state: Any, start: int, n: int) -> None:
        """After a pass of ``n`` tokens from position ``start`` whose last was an
        alternative that verification took: the cache ends with ``token_ids[0]`` then
        the alternative (everything else of the pass is forgotten)."""
        raise NotImplementedError(f"{self.name} does not run token trees")

    def forward_batch(self, items: Sequence[BatchItem]) -> list[torch.Tensor]:
        """Each item's new tokens, one forward pass per sequence; the kept logits of each."""
        return self.run_pass(self.prepare_pass(items))

    def prepare_pass(self, items: Sequence[BatchItem]) -> PreparedPass:
        """A pass made ready to run (here: checked; every pass is a long call)."""
        if any(item.alternative for item in items):
            raise ValueError(f"{self.name} does not run token trees")
        if any(item.features or item.inputs is not None for item in items):
            raise ValueError(f"{self.name} gives no hidden states and takes no input rows")
        return PreparedPass(items)

    @torch.inference_mode()
    def run_pass(self, prepared: PreparedPass) -> list[torch.Tensor]:
        """Run a prepared pass: the kept logits of each item."""
        return [self._forward(item.state, item.token_ids, keep=max(1, item.keep))[-item.keep:]
                if item.keep else self._forward(item.state, item.token_ids, keep=1)[:0]
                for item in prepared.items]

    def kv_bytes(self, rows: int, positions: int) -> int:
        """At most how much KV ``rows`` sequences of up to ``positions`` tokens hold."""
        return rows * positions * self.kv_position_bytes

    def fit(self, rows: int, positions: int) -> None:
        """Size the KV storage for this many sequences and positions (per-sequence
        caches here grow as they go: nothing to do)."""

    def warmup(self) -> None:
        """Build whatever the first passes would otherwise build while serving."""

    def release(self, state: CacheState) -> None:
        """Free the sequence's cache."""
        self.rollback(state, 0)

    def rollback(self, state: CacheState, length: int) -> None:
        """Forget every cached position at or after ``length``."""
        if length < state.length:
            state.cache.crop(length - state.length)  # transformers 5: a negative count
            state.length = length

    @property
    def num_layers(self) -> int:
        return int(self.model.config.num_hidden_layers)

    def load_kv(
        self, state: CacheState, kv: Sequence[tuple[torch.Tensor, torch.Tensor]]
    ) -> None:
        """Start an empty cache from saved KV: per layer [1, heads, tokens, head_dim] each."""
        if state.length:
            raise ValueError("load_kv needs an empty cache")
        for layer, (keys, values) in enumerate(kv):
            state.cache.update(keys.to(self.device, self.dtype), values.to(self.device, self.dtype),
                               layer)
        state.length = int(kv[0][0].shape[2]) if kv else 0

    def kv(self, state: CacheState) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """The cached KV, per layer [1, heads, length, head_dim] each (views, not copies)."""
        layers: list[Any] = list(state.cache.layers)
        return [(layer.keys, layer.values) for layer in layers]

    def _forward(self, state: CacheState, token_ids: Sequence[int], keep: int) -> torch.Tensor:
        ids = torch.tensor([list(token_ids)], dtype=torch.long, device=self.device)  # [1, n]
        out = self.model(
            input_ids=ids,
            cache=state.cache,
            use_cache=True,
            logits_to_keep=keep,
        )
        state.length += ids.shape[1]
        return out.logits[0]  # [keep, vocab]


def eos_ids(model: Any, tokenizer: Any) -> set[int]:
    ids: set[int] = set()
    for source in (getattr(model, "generation_config", None), model.config):
        value = getattr(source, "eos_token_id", None) if source is not None else None
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, list | tuple):
            ids.update(int(v) for v in value)
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    return ids


def check_same_vocabulary(target_tokenizer: Any, draft_tokenizer: Any, draft_name: str) -> None:
    """Refuse a draft whose tokenizer differs from the target's."""
    target_vocab = target_tokenizer.get_vocab()
    draft_vocab = draft_tokenizer.get_vocab()
    if target_vocab == draft_vocab:
        return
    differing = sum(1 for t, i in draft_vocab.items() if target_vocab.get(t) != i)
    raise TokenizerMismatchError(
        f"draft {draft_name!r} does not share the target's tokenizer: vocabularies of "
        f"{len(draft_vocab)} and {len(target_vocab)} tokens differ on {differing} entries. "
        "A draft must use exactly the target's tokenizer."
    )


def pretrained(path: str, dtype: str, device: str) -> tuple[Any, Any]:
    """A model directory's (or hub id's) model in ``dtype`` on ``device``, and its tokenizer."""
    if dtype not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; choose one of {sorted(DTYPES)}")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=DTYPES[dtype])
    return model.to(device), tokenizer  # type: ignore[arg-type]
