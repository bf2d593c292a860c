"""A draft that reads the target's features: one decoder layer over the target's final
hidden states (EAGLE; Li et al. 2024, arXiv 2401.15077).

Draft position j reads the token t_j and the target's final hidden state f_{j-1} (after
its final norm: what the output head reads, the state that predicted t_j):
``x_j = fc([embed(t_j), f_{j-1}])``, then one Llama decoder layer and a final norm give
``y_j``, meant to be f_j, and the target's own output rows over its most frequent tokens
give the next token. A draft step past the committed tokens reads its own ``y`` in place
of the target's f. The layer runs as a one-layer ``BatchedLM`` (its KV rows, batching,
native kernels and quantized matrices) that starts from the ``fc`` rows
(``BatchItem.inputs``).

With ``"feature": "layers"`` (EAGLE-3; Li et al. 2025, arXiv 2503.01840) the target's
feature is fused from the outputs of its ``layers`` (``"layers": [2, 15, 27]``, the
residual stream after each): each RMS-normed with its part of ``fuse_norm.weight``
``[L*H]``, then ``fuse.weight`` ``[H, L*H]``; the target's verify passes capture those
layers (``BatchedLM.capture_layers``) and hand them to the drafter after its final states
(``[n, H + L*H]``; a draft that reads the final states takes their first H columns).
``"feature": "final_norm"`` (the first heads) reads the final states as they are.

A directory holds ``draft.json`` (format, the target it was made for, the one-layer
Llama config, the feature, how it was made) and ``draft.safetensors``: ``fc.weight``
``[H, 2H]``, the layer and final norm under transformers' Llama names, ``lm_head.ids``,
and the fusion's two tensors where it has them. The input embedding and the output rows
are the target's, taken at load.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from runtime.drafts import draft_format
from runtime.matrices.quantized import block_kernels, quantized
from runtime.matrices.weights import Matrix, Product
from runtime.models.causal_model import CausalModel
from runtime.models.checkpoints import DTYPES
from runtime.native.kernels import resolve
from runtime.runner.batched import BatchedLM, BatchedState
from runtime.runner.causal_lm import CausalLM
from runtime.runner.passes import DraftSteps

log = logging.getLogger(__name__)

FORMAT = "specserve-feature-draft"
VERSION = 1
FC = "fc.weight"
FUSE = "fuse.weight"
FUSE_NORM = "fuse_norm.weight"
FEATURES = ("final_norm", "layers")  # the target's final states, or its layers' fused
DEFAULT_FEATURE_DRAFT = "feature-draft"  # the spec naming the one shipped for the default model
DEFAULT_FEATURE_DRAFT_DIR = Path(__file__).resolve().parent / "smollm2-135m-instruct-feature"


@dataclass
class FeatureDraft:
    """The draft's runner (one layer, final norm, subset head over input rows) and the
    product that makes those rows."""

    runner: BatchedLM
    fc: Product  # [n, 2H] -> [n, H]
    name: str
    layers: tuple[int, ...] = ()  # the target's layers it fuses (none: its final states)
    fuse: Product | None = None  # [n, L*H] -> [n, H]
    fuse_norm: torch.Tensor | None = None  # [L*H]
    eps: float = 1e-6

    @property
    def hidden_size(self) -> int:
        return self.runner.hidden_size

    def target_feature(self, rows: torch.Tensor) -> torch.Tensor:  # [n, H (+ L*H)] -> [n, H]
        """The target's rows as the draft reads them: the final states (their first H
        columns), or fused from the captured layers' outputs that follow them."""
        hidden = self.hidden_size
        if self.fuse is None or self.fuse_norm is None:
            return rows[:, :hidden]
        if rows.shape[1] != hidden * (1 + len(self.layers)):
            raise ValueError(f"{self.name} fuses {len(self.layers)} layers: the target's rows "
                             f"have {rows.shape[1]} columns, not {hidden * (1 + len(self.layers))}")
        parts = rows[:, hidden:].to(self.fuse_norm.dtype).unflatten(-1, (len(self.layers), -1))
        parts = parts * torch.rsqrt(parts.pow(2).mean(-1, keepdim=True) + self.eps)
        normed = (self.fuse_norm * parts.flatten(-2)).to(self.runner.dtype).contiguous()
        return self.fuse(normed).to(self.runner.dtype)

    @property
    def fusion(self) -> tuple[Product, int]:
        """The chain's input fusion: ``fc`` over [embedding | carried state], as
        ``inputs`` makes the rows."""
        return self.fc, 2 * self.hidden_size

    def chains(self, vocab: int) -> bool:
        """Whether greedy steps draft in one native call (``draft_chain``)."""
        return self.runner.batch_invariant and self.runner.chain(vocab, self.fusion) is not None

    def draft_chain(self, caches: Sequence[BatchedState], feeds: Sequence[Sequence[int]],
                    steps: Sequence[int], vocab: int,
                    carried: Sequence[torch.Tensor]) -> list[DraftSteps]:
        """The runner's chain (``BatchedLM.draft_chain``), each call's first rows fused
        from its carried states."""
        return self.runner.draft_chain(caches, feeds, steps, vocab, carried, self.fusion)

    def inputs(self, token_ids: Sequence[int],
               features: torch.Tensor) -> torch.Tensor:  # features: [n, H] -> [n, H]
        """The rows draft positions start from: each token's embedding beside the
        feature before it."""
        embed = self.runner.model.model.embed_tokens
        ids = torch.tensor(list(token_ids), dtype=torch.long, device=self.runner.device)
        rows = embed(ids).to(self.runner.dtype)  # [n, H]
        joined = torch.cat([rows, features.to(self.runner.dtype)], dim=-1)  # [n, 2H]
        return self.fc(joined.contiguous()).to(self.runner.dtype)


def is_feature_draft_dir(spec: str | Path) -> bool:
    path = Path(spec).expanduser() / draft_format.CONFIG_NAME
    if not path.is_file():
        return False
    try:
        return bool(json.loads(path.read_text(encoding="utf-8")).get("format") == FORMAT)
    except ValueError:
        return False


def resolve_feature_draft_dir(spec: str) -> Path | None:
    """The feature-draft directory ``spec`` names (``feature-draft`` or a path), else None."""
    if spec == DEFAULT_FEATURE_DRAFT:
        if not is_feature_draft_dir(DEFAULT_FEATURE_DRAFT_DIR):
            raise FileNotFoundError(
                f"the default feature draft is missing from {DEFAULT_FEATURE_DRAFT_DIR}")
        return DEFAULT_FEATURE_DRAFT_DIR
    return Path(spec).expanduser() if is_feature_draft_dir(spec) else None


def default_fits(target: CausalLM) -> bool:
    """Whether the feature draft shipped for the default model was made for ``target``
    (and ``target`` gives its hidden states)."""
    if not target.capabilities.features or not is_feature_draft_dir(DEFAULT_FEATURE_DRAFT_DIR):
        return False
    try:
        check_target(read_info(DEFAULT_FEATURE_DRAFT_DIR), target, DEFAULT_FEATURE_DRAFT_DIR)
    except draft_format.DraftFormatError:
        return False
    return True


def check_target(raw: dict[str, Any], target: CausalLM, where: Path) -> None:
    """Refuse ``target`` unless the draft whose ``draft.json`` is ``raw`` was made for it."""
    info = draft_format.DraftInfo(target=raw["target"], model=raw["model"], source_layers=[],
                                  vocab_top_k=raw.get("vocab_top_k"))
    draft_format.check_target(info, target.model, where)


def read_info(directory: Path) -> dict[str, Any]:
    """``draft.json``, checked to be this format."""
    try:
        raw: dict[str, Any] = json.loads(
            (directory / draft_format.CONFIG_NAME).read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise draft_format.DraftFormatError(f"{directory}: cannot read draft.json: {exc}") from exc
    if raw.get("format") != FORMAT or raw.get("version") != VERSION:
        raise draft_format.DraftFormatError(
            f"{directory}: not a {FORMAT} v{VERSION} draft "
            f"(format={raw.get('format')!r}, version={raw.get('version')!r})")
    if int(raw["model"].get("num_hidden_layers", 1)) != 1:
        raise draft_format.DraftFormatError(f"{directory}: a feature draft has one layer")
    feature_layers(raw, directory)
    return raw


def feature_layers(raw: dict[str, Any], where: Path) -> tuple[int, ...]:
    """The target layers a draft fuses (``"feature": "layers"``), or none (its final
    states, ``"final_norm"``, the first heads' feature)."""
    feature = raw.get("feature", "final_norm")
    if feature not in FEATURES:
        raise draft_format.DraftFormatError(f"{where}: unknown feature {feature!r}")
    if feature == "final_norm":
        return ()
    layers = raw.get("layers")
    if (not isinstance(layers, list) or not layers
            or not all(isinstance(i, int) and i >= 0 for i in layers)):
        raise draft_format.DraftFormatError(
            f"{where}: a fused feature names its target layers (\"layers\": [2, 15, 27])")
    return tuple(layers)


def output_rows(target_model: CausalModel, ids: torch.Tensor) -> torch.Tensor:  # [K, H]
    """The target's output-head rows for ``ids``: its input embedding's where the two are
    tied (a quantized or released head keeps no plain rows), else the head's."""
    config = target_model.config
    head = target_model.get_output_embeddings()
    weight = getattr(head, "weight", None)
    if getattr(config, "tie_word_embeddings", False) or weight is None or weight.is_meta:
        if not getattr(config, "tie_word_embeddings", False):
            raise draft_format.DraftFormatError(
                "the target's output head keeps no plain rows to share with a feature draft")
        embed = target_model.get_input_embeddings()
        return embed(ids.to(next(embed.parameters()).device)).detach().float()
    return weight.detach()[ids].float()


def load(directory: Path, target: CausalLM, dtype: str = "float32",
         quantize: str = "none", kernels: str = "auto") -> FeatureDraft:
    """The feature draft in ``directory`` for ``target`` (checked to be the one it was
    made for), its matrices quantized by ``quantize`` (none, int8, int4)."""
    from safetensors.torch import load_file

    raw = read_info(directory)
    check_target(raw, target, directory)
    layers = feature_layers(raw, directory)
    count = int(target.model.config.num_hidden_layers)
    if any(i >= count for i in layers):
        raise draft_format.DraftFormatError(
            f"{directory}: fuses layers {list(layers)} of a target with {count}")
    state = load_file(str(directory / draft_format.WEIGHTS_NAME))
    fc_weight = state.pop(FC).to(DTYPES[dtype], copy=True)  # [H, 2H]
    fuse_weight = state.pop(FUSE, None)  # [H, L*H]
    fuse_norm = state.pop(FUSE_NORM, None)  # [L*H]
    if layers and (fuse_weight is None or fuse_norm is None):
        raise draft_format.DraftFormatError(f"{directory}: a fused feature needs {FUSE} "
                                            f"and {FUSE_NORM}")
    ids = state.pop(draft_format.VOCAB_IDS).long()
    model = draft_format.build_model(raw["model"], state, ids, output_rows(target.model, ids),
                                     target.model, dtype, False, directory)
    name = str(directory)
    runner: BatchedLM
    if quantize != "none":
        runner = BatchedLM(model, target.tokenizer, name=name, quantize=quantize,
                           kernels=kernels)
    else:
        runner = BatchedLM(model, target.tokenizer, name=name, kernels=kernels)
    hidden = runner.hidden_size
    if tuple(fc_weight.shape) != (hidden, 2 * hidden):
        raise draft_format.DraftFormatError(
            f"{directory}: {FC} has shape {tuple(fc_weight.shape)}, not {(hidden, 2 * hidden)}")
    fc = _product(fc_weight, runner, quantize, kernels)
    fuse = None
    if layers:
        assert fuse_weight is not None and fuse_norm is not None
        if (tuple(fuse_weight.shape) != (hidden, len(layers) * hidden)
                or tuple(fuse_norm.shape) != (len(layers) * hidden,)):
            raise draft_format.DraftFormatError(
                f"{directory}: {FUSE} {tuple(fuse_weight.shape)} or {FUSE_NORM} "
                f"{tuple(fuse_norm.shape)} do not fit {len(layers)} layers of {hidden}")
        if not isinstance(target, BatchedLM):
            raise draft_format.DraftFormatError(
                f"{directory}: a fused feature needs the batched runner's captured layers")
        try:
            target.capture_layers(layers)
        except ValueError as exc:
            raise draft_format.DraftFormatError(f"{directory}: {exc}") from exc
        fuse = _product(fuse_weight.to(DTYPES[dtype], copy=True), runner, quantize, kernels)
    log.info("feature draft %s: one layer, head over %d tokens, %s, feature %s", name,
             len(ids), runner.weights_format,
             f"fused from layers {list(layers)}" if layers else "the final states")
    return FeatureDraft(runner, fc, name, layers, fuse,
                        None if fuse_norm is None else fuse_norm.float(),
                        float(raw["model"].get("rms_norm_eps", 1e-6)))


def _product(weight: torch.Tensor, runner: BatchedLM, quantize: str, kernels: str) -> Product:
    if quantize != "none":
        native = resolve(kernels, runner.device) if quantize == "int4" else None
        return quantized(weight, None, quantize, block_kernels(native, True))
    matrix = Matrix(weight.contiguous(), None)
    matrix.use_native(runner.stack.kernels)
    return matrix


def save(directory: Path, target: CausalLM, model_config: dict[str, Any],
         tensors: dict[str, torch.Tensor], made_with: dict[str, Any] | None = None,
         dtype: torch.dtype = torch.float16, layers: Sequence[int] = ()) -> None:
    """Write a feature draft for ``target``: ``tensors`` holds ``fc.weight``, the layer
    and final norm (transformers' Llama names) and ``lm_head.ids``, and with ``layers``
    (the target layers it fuses) ``fuse.weight`` and ``fuse_norm.weight``."""
    needed = {FC, draft_format.VOCAB_IDS, "model.norm.weight"} | (
        {FUSE, FUSE_NORM} if layers else set())
    missing = needed - set(tensors)
    if missing:
        raise ValueError(f"a feature draft needs {sorted(missing)}")
    feature: dict[str, Any] = ({"feature": "layers", "layers": [int(i) for i in layers]}
                               if layers else {"feature": "final_norm"})
    write(directory, {"target": draft_format.target_identity(target.model, target.name),
                      "model": {**model_config, "num_hidden_layers": 1},
                      "vocab_top_k": int(tensors[draft_format.VOCAB_IDS].numel()),
                      **feature, "made_with": made_with or {}}, tensors, dtype)


def write(directory: Path, info: dict[str, Any], tensors: dict[str, torch.Tensor],
          dtype: torch.dtype = torch.float16) -> None:
    """``draft.safetensors`` (floats in ``dtype``, ``lm_head.ids`` as int64) and
    ``draft.json`` (``info`` under this format and version), each replaced in one step: a
    reader never sees half of either."""
    from safetensors.torch import save_file

    directory.mkdir(parents=True, exist_ok=True)
    stored = {k: (v.long() if k == draft_format.VOCAB_IDS else v.detach().to(dtype))
              .contiguous().cpu() for k, v in tensors.items()}
    tmp = directory / (draft_format.WEIGHTS_NAME + ".tmp")
    save_file(stored, str(tmp), metadata={"format": FORMAT})
    tmp.chmod(0o644)
    tmp.replace(directory / draft_format.WEIGHTS_NAME)
    text = json.dumps({"format": FORMAT, "version": VERSION, **info}, indent=2) + "\n"
    tmp = directory / (draft_format.CONFIG_NAME + ".tmp")
    tmp.write_text(text, encoding="utf-8")
    tmp.replace(directory / draft_format.CONFIG_NAME)
