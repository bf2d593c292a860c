"""What a feature draft takes from its target: float weights to start from, its embedding
and output-head rows, and the identity block a draft directory records."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from runtime.drafts import draft_format
from specdistill.feature import LAYER_KEYS

GGUF_NAMES = {  # transformers' name in a layer -> the GGUF tensor's
    "self_attn.q_proj.weight": "attn_q.weight", "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight", "self_attn.o_proj.weight": "attn_output.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight", "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight", "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
}


def config_dict(target: Any) -> dict[str, Any]:
    config = target.model.config
    return dict(config) if isinstance(config, dict) else {
        k: v for k, v in (config.to_dict() if hasattr(config, "to_dict") else vars(config)).items()}


def embedding_table(target: Any) -> torch.Tensor:  # [vocab, H] float32
    """The target's input embedding rows, as its runner looks them up."""
    embed = target.model.get_input_embeddings()
    rows = [draft_format.embedding_rows(embed, int(embed.num_embeddings)).detach()]
    return rows[0].float().cpu().contiguous()


def head_table(target: Any, embedding: torch.Tensor) -> torch.Tensor:  # [vocab, H]
    """The target's output-head rows: its embedding when tied, else its head's weight."""
    if config_dict(target).get("tie_word_embeddings", False):
        return embedding
    weight = target.model.get_output_embeddings().weight
    if weight.device.type == "meta":
        return _gguf(target).wide("output.weight", torch.float32)
    return weight.detach().float().cpu()


def _gguf(target: Any) -> Any:
    from runtime.loaders.gguf_weights import GGUFModel

    return GGUFModel(Path(target.name))


def last_layer_weights(target: Any) -> dict[str, torch.Tensor]:
    """The target's last decoder layer (``model.layers.0.``-named, for the draft) and its
    final norm, in float32: dequantized from a GGUF file, else read from its weights."""
    last = int(config_dict(target)["num_hidden_layers"]) - 1
    out: dict[str, torch.Tensor] = {}
    if str(target.name).endswith(".gguf"):
        gguf = _gguf(target)
        for key in LAYER_KEYS:
            out["model.layers.0." + key] = gguf.wide(f"blk.{last}.{GGUF_NAMES[key]}",
                                                     torch.float32)
        out["model.norm.weight"] = gguf.wide("output_norm.weight", torch.float32)
        return out
    state = target.model.state_dict()
    for key in LAYER_KEYS:
        out["model.layers.0." + key] = state[f"model.layers.{last}.{key}"].float().cpu()
    out["model.norm.weight"] = state["model.norm.weight"].float().cpu()
    if any(t.device.type == "meta" for t in out.values()):
        raise ValueError(f"{target.name}: the target's layer weights are not readable here")
    return out


def identity(target: Any) -> draft_format.TargetIdentity:
    """The same target identity block ``runtime.drafts.draft_format`` writes."""
    return draft_format.target_identity(target.model, Path(str(target.name)).name)
