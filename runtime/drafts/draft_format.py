"""The distilled draft: a self-describing directory that holds only what the target lacks.

A draft directory holds ``draft.json`` (format, the target it was made for, the
draft's Llama config, which target layers it started from, how it was made) and
``draft.safetensors`` (its decoder layers, final norm and output head in
float16, plus the ids of the output head's rows). The input embedding is the
target's own, frozen during training and taken from the target at load time,
so it is never stored. A head over the K most frequent target tokens returns
logits over the full vocabulary with the lowest finite value outside its set:
the draft can only propose tokens in the set, the target still verifies over
the full vocabulary, and sampled draft probabilities are exactly zero outside.
"""

from __future__ import annotations

import copy
import json
import logging
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any, TypedDict

import torch
from torch import nn

from runtime.files.model_config import read_config
from runtime.models.causal_model import CausalModel, InputEmbedding, input_embedding
from runtime.models.checkpoints import DTYPES
from runtime.models.skeleton import ConvertedEmbedding, Skeleton
from runtime.runner.batched import BatchedLM
from runtime.runner.causal_lm import CausalLM

if TYPE_CHECKING:
    from runtime.files.model_config import ModelConfig

log = logging.getLogger(__name__)

FORMAT = "specserve-draft"
VERSION = 1
CONFIG_NAME = "draft.json"
WEIGHTS_NAME = "draft.safetensors"
VOCAB_IDS = "lm_head.ids"
EMBEDDING = "model.embed_tokens.weight"
DEFAULT_DRAFT = "default-draft"  # the spec naming the draft shipped for the default model
DEFAULT_DRAFT_DIR = Path(__file__).resolve().parent / "smollm2-135m-instruct"
PROBE_ROWS = 16  # embedding rows whose norms identify the target
PROBE_RTOL = 2e-2  # loose enough for a bfloat16 target


class DraftFormatError(ValueError):
    """A draft directory is malformed or was made for another target."""


class TargetIdentity(TypedDict):
    """``draft.json``'s ``target``: what identifies the target a draft was made for."""

    name: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    embedding_probe: list[float]  # [PROBE_ROWS] the norms of its first embedding rows


@dataclass(frozen=True)
class DraftInfo:
    """``draft.json``."""

    target: TargetIdentity
    model: dict[str, object]  # the draft's transformers (Llama) config
    source_layers: list[int]  # the target layers the draft's layers started from
    vocab_top_k: int | None  # rows of the output head; None: the full vocabulary
    dtype: str = "float16"
    seed: int = 0
    made_with: dict[str, object] = field(default_factory=dict)  # command, data, training, results
    format: str = FORMAT
    version: int = VERSION
    kind: str = "causal-lm"

    def save(self, directory: Path) -> None:
        text = json.dumps(asdict(self), indent=2, sort_keys=False)
        (directory / CONFIG_NAME).write_text(text + "\n", encoding="utf-8")

    @staticmethod
    def load(directory: Path) -> DraftInfo:
        try:
            raw = json.loads((directory / CONFIG_NAME).read_text(encoding="utf-8"))
        except (OSError, ValueError) as exc:
            raise DraftFormatError(f"{directory}: cannot read {CONFIG_NAME}: {exc}") from exc
        if raw.get("format") != FORMAT or raw.get("version") != VERSION:
            raise DraftFormatError(
                f"{directory}: not a {FORMAT} v{VERSION} draft "
                f"(format={raw.get('format')!r}, version={raw.get('version')!r})")
        return DraftInfo(**raw)


class SubsetHead(nn.Module):
    """An output head over ``ids`` (K of the vocabulary's tokens), scattered into the full
    vocabulary; every token outside the set gets the dtype's lowest finite logit."""

    ids: torch.Tensor  # [K] vocabulary id of each row

    def __init__(self, weight: torch.Tensor, ids: torch.Tensor, vocab_size: int) -> None:
        super().__init__()  # weight: [K, hidden]; ids: [K]
        self.weight = nn.Parameter(weight)
        self.register_buffer("ids", ids.long())
        self.vocab_size = vocab_size

    def subset_logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [..., hidden] -> [..., K]
        return nn.functional.linear(hidden, self.weight)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:  # [..., hidden] -> [..., vocab]
        sub = self.subset_logits(hidden)  # [..., K]
        full = sub.new_full((*sub.shape[:-1], self.vocab_size), torch.finfo(sub.dtype).min)
        index = self.ids.expand_as(sub)
        return full.scatter(-1, index, sub)


def head_ids(directory: Path) -> torch.Tensor | None:  # [K]
    """The vocabulary ids a draft directory's output head covers, read without loading
    the draft; None when it covers the whole vocabulary."""
    from safetensors import safe_open

    with safe_open(str(directory / WEIGHTS_NAME), framework="pt") as weights:
        names = weights.keys()  # safe_open has no membership test of its own
        return weights.get_tensor(VOCAB_IDS).long() if VOCAB_IDS in names else None


def is_draft_dir(spec: str | Path) -> bool:
    return Path(spec).expanduser().joinpath(CONFIG_NAME).is_file()


def resolve_draft_dir(spec: str) -> Path | None:
    """The draft directory ``spec`` names (``default-draft`` or a path), else None."""
    if spec == DEFAULT_DRAFT:
        if not is_draft_dir(DEFAULT_DRAFT_DIR):
            raise FileNotFoundError(f"the default draft is missing from {DEFAULT_DRAFT_DIR}")
        return DEFAULT_DRAFT_DIR
    return Path(spec).expanduser() if is_draft_dir(spec) else None


def default_draft_fits(target: CausalLM) -> bool:
    """Whether the draft shipped for the default model was made for ``target``."""
    try:
        check_target(DraftInfo.load(DEFAULT_DRAFT_DIR), target.model, DEFAULT_DRAFT_DIR)
    except DraftFormatError:
        return False
    return True


def embedding_rows(embed: InputEmbedding, count: int) -> torch.Tensor:  # [count, hidden]
    """The first ``count`` rows of an input embedding (an ``nn.Embedding``, or a
    ``quantized.BlockEmbedding`` that holds no table), by looking them up."""
    anchor = next(embed.parameters())
    return embed(torch.arange(count, device=anchor.device))


def target_identity(target_model: CausalModel, name: str) -> TargetIdentity:
    embed = input_embedding(target_model)
    probe = embedding_rows(embed, PROBE_ROWS).float().norm(dim=-1)  # [PROBE_ROWS]
    config = target_model.config
    return {"name": name, "vocab_size": int(embed.num_embeddings),
            "hidden_size": int(embed.embedding_dim),
            "num_layers": int(config.num_hidden_layers),
            "embedding_probe": [round(float(x), 5) for x in probe]}


def check_target(info: DraftInfo, target_model: CausalModel, where: Path | str) -> None:
    embed = input_embedding(target_model)
    want = info.target
    vocab, hidden = int(embed.num_embeddings), int(embed.embedding_dim)
    if (vocab, hidden) != (want["vocab_size"], want["hidden_size"]):
        raise DraftFormatError(
            f"draft {where} was made for {want['name']!r} (vocab {want['vocab_size']}, hidden "
            f"{want['hidden_size']}); this target has vocab {vocab}, hidden {hidden}")
    probe = embedding_rows(embed, PROBE_ROWS).float().norm(dim=-1).cpu()
    expected = torch.tensor(want["embedding_probe"])
    if not torch.allclose(probe, expected, rtol=PROBE_RTOL, atol=1e-3):
        raise DraftFormatError(
            f"draft {where} was made for {want['name']!r}, whose input embedding differs from "
            "this target's; a distilled draft only works with the target it was made for")


def draft_config(target_config: ModelConfig, layers: int) -> Any:
    """transformers' config for a draft of ``layers`` of the target's layers (a target
    config ``model_config.read_config`` read becomes transformers' class)."""
    if isinstance(target_config, SimpleNamespace):
        from transformers import LlamaConfig

        target_config = LlamaConfig.from_dict(dict(vars(target_config)))
    config = copy.deepcopy(target_config)
    config.num_hidden_layers = layers
    if getattr(config, "layer_types", None):
        config.layer_types = list(config.layer_types)[:layers]
    config.tie_word_embeddings = False
    return config


def init_from_target(target_model: CausalModel, source_layers: list[int],
                     vocab_ids: torch.Tensor | None) -> Any:
    """A fresh draft: the target's ``source_layers``, final norm and input embedding (shared),
    and an output head made of the target's output rows for ``vocab_ids`` (all when None)."""
    from transformers import LlamaForCausalLM

    config = draft_config(target_model.config, len(source_layers))
    draft: Any = LlamaForCausalLM(config)
    draft = draft.to(target_model.dtype)
    draft.model.embed_tokens = target_model.get_input_embeddings()
    for mine, theirs in zip(draft.model.layers, source_layers, strict=True):
        mine.load_state_dict(target_model.model.layers[theirs].state_dict())
    draft.model.norm.load_state_dict(target_model.model.norm.state_dict())
    out_rows = target_model.get_output_embeddings().weight.detach()
    vocab = int(out_rows.shape[0])
    ids = vocab_ids if vocab_ids is not None else torch.arange(vocab)
    draft.lm_head = SubsetHead(out_rows[ids].clone(), ids, vocab)
    return draft.eval()


def stored_state(draft: Any) -> dict[str, torch.Tensor]:
    """What a draft directory stores: everything but the shared input embedding."""
    state = {k: v for k, v in draft.state_dict().items() if k != EMBEDDING}
    state[VOCAB_IDS] = draft.lm_head.ids
    return state


def save(draft: nn.Module, info: DraftInfo, directory: Path) -> None:
    from safetensors.torch import save_file

    directory.mkdir(parents=True, exist_ok=True)
    half = DTYPES[info.dtype]
    state = {k: (v if k == VOCAB_IDS else v.to(half)).contiguous().cpu()
             for k, v in stored_state(draft).items()}
    tmp = directory / (WEIGHTS_NAME + ".tmp")
    save_file(state, str(tmp), metadata={"format": FORMAT})
    tmp.chmod(0o644)
    tmp.replace(directory / WEIGHTS_NAME)
    info.save(directory)


def load_model(directory: Path, target_model: CausalModel, dtype: str = "float32",
               runnable: bool = True) -> Any:
    """The draft as a transformers causal LM that shares ``target_model``'s input embedding
    (a float copy of it when the dtypes differ); ``runnable=False``: as a
    ``skeleton.Skeleton``, the modules ``BatchedLM`` runs without the model's forward
    (converting the embedding's rows as they are looked up when the dtypes differ)."""
    from safetensors.torch import load_file

    info = DraftInfo.load(directory)
    check_target(info, target_model, directory)
    state = load_file(str(directory / WEIGHTS_NAME))
    ids = state.pop(VOCAB_IDS).long()
    return build_model(info.model, state, ids, state.pop("lm_head.weight"), target_model,
                       dtype, runnable, directory)


def build_model(model_config: Mapping[str, object], state: dict[str, torch.Tensor],
                ids: torch.Tensor, head_weight: torch.Tensor, target_model: CausalModel,
                dtype: str, runnable: bool, directory: Path) -> Any:
    """A draft of ``model_config`` (a Llama config) from ``state`` (its layers and final
    norm), with an output head of ``head_weight`` over the vocabulary ``ids`` and
    ``target_model``'s input embedding; see ``load_model``."""
    config: Any = None if runnable else read_config({**model_config, "model_type": "llama"})
    if config is None:  # transformers' class: to train, or a config read_config leaves to it
        from transformers import LlamaConfig

        config = LlamaConfig.from_dict(dict(model_config))
    config.tie_word_embeddings = False
    torch_dtype = DTYPES[dtype]
    embed = input_embedding(target_model)
    head_weight = head_weight.to(torch_dtype)
    draft: Any
    if runnable:
        from transformers import LlamaForCausalLM

        draft = LlamaForCausalLM(config)
        draft = draft.to(torch_dtype)
    else:
        draft = Skeleton(config, torch_dtype)
    draft.lm_head = SubsetHead(head_weight, ids, int(embed.num_embeddings))
    expected = {k for k in draft.model.state_dict() if k != "embed_tokens.weight"}
    got = {k.removeprefix("model.") for k in state}
    if expected - got:
        raise DraftFormatError(f"{directory}: {WEIGHTS_NAME} lacks {sorted(expected - got)[:4]}")
    # assign: a skeleton's parameters are on the meta device; copies, since a view of the
    # file's mapping (the safetensors dtype already) would keep all of it resident
    draft.model.load_state_dict(
        {k.removeprefix("model."): v.to(torch_dtype, copy=True) for k, v in state.items()},
        strict=False, assign=not runnable)
    anchor = next(embed.parameters())  # the embedding's device and dtype
    device = anchor.device
    if anchor.dtype == torch_dtype:
        draft.model.embed_tokens = embed
    elif not runnable:  # what BatchedLM runs only looks rows up
        draft.model.embed_tokens = ConvertedEmbedding(target_model.get_input_embeddings(),
                                                      torch_dtype)
    else:
        draft.model.embed_tokens = nn.Embedding.from_pretrained(
            embedding_rows(embed, int(embed.num_embeddings)).detach().to(torch_dtype),
            freeze=True)
    return draft.to(device).eval()


def load_causal_lm(directory: Path, target: CausalLM, dtype: str = "float32",
                   quantize: str = "none") -> CausalLM:
    """The draft as the runner the model drafter uses (tokenizer shared with the target);
    ``quantize`` (int8, int4) quantizes its matrices and head, in ``dtype`` bfloat16."""
    model = load_model(directory, target.model, dtype, runnable=False)
    if quantize != "none":
        return BatchedLM(model, target.tokenizer, name=str(directory), quantize=quantize)
    return BatchedLM.wrap(model, target.tokenizer, name=str(directory))
