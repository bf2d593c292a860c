"""The batched families built from the project's own modules (``runtime.models.skeleton``): the
same logits as transformers' model classes, bitwise, and a server that never imports
transformers' modeling code."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from runtime.files.model_config import model_config, read_config, tokenizer
from runtime.models.checkpoints import pretrained, transformers_pretrained
from runtime.models.families import attention_dims, unbatchable
from runtime.models.skeleton import Rotary, Skeleton
from runtime.runner.batched import BatchedLM
from runtime.runner.causal_lm import TransformersLM

SMALL = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 256}


def tiny(out: Path, tokenizer_dir: Path, family: str, **extra: Any) -> Path:
    """A random-weight model of ``family`` with the default model's tokenizer, saved."""
    import transformers
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    classes = {"llama": "Llama", "mistral": "Mistral", "qwen2": "Qwen2", "qwen3": "Qwen3",
               "phi3": "Phi3", "phi": "Phi"}
    config = getattr(transformers, classes[family] + "Config")(
        vocab_size=len(tokenizer), eos_token_id=tokenizer.eos_token_id, **SMALL, **extra)
    torch.manual_seed(3)
    model = getattr(transformers, classes[family] + "ForCausalLM")(config)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.15)  # biases and norms too: a wrong one shows
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


FAMILIES = {
    "llama-tied": ("llama", {"tie_word_embeddings": True}),
    "llama-biases": ("llama", {"attention_bias": True, "mlp_bias": True,
                               "tie_word_embeddings": False}),
    "mistral": ("mistral", {"sliding_window": None, "tie_word_embeddings": False}),
    "qwen2": ("qwen2", {"use_sliding_window": False, "tie_word_embeddings": False}),
    # its own head size (not hidden / heads), each head's q and k normed, biases on all four
    "qwen3": ("qwen3", {"head_dim": 24, "attention_bias": True, "tie_word_embeddings": True}),
}


@pytest.mark.parametrize("kernels", ["torch", "native"])
@pytest.mark.parametrize("name", list(FAMILIES))
def test_a_skeleton_runs_transformers_logits_bitwise(tmp_path: Path, default_model_dir: Path,
                                                     name: str, kernels: str) -> None:
    family, extra = FAMILIES[name]
    path = str(tiny(tmp_path, default_model_dir, family, **extra))
    own = BatchedLM.load(path, dtype="float32", kernels=kernels)
    assert isinstance(own, BatchedLM) and isinstance(own.model, Skeleton)
    theirs = BatchedLM.wrap(*transformers_pretrained(path, "float32", "cpu"), name=path,
                            kernels=kernels)
    assert isinstance(theirs, BatchedLM) and not isinstance(theirs.model, Skeleton)
    assert own.eos_token_ids == theirs.eos_token_ids
    ids = [500 + 37 * i for i in range(24)]
    want = theirs.score(theirs.new_state(), ids)
    assert torch.equal(own.score(own.new_state(), ids), want)
    # and transformers' own forward pass over the same weights (its biases included)
    forward = TransformersLM.load(path, dtype="float32")
    torch.testing.assert_close(forward.score(forward.new_state(), ids), want,
                               rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("kernels", ["torch", "native"])
def test_a_qwen3_model_speculates_losslessly_in_batches(tmp_path: Path, default_model_dir: Path,
                                                        kernels: str) -> None:
    """Qwen3 runs batched (its per-head q/k norms on both paths) in bfloat16: served at
    three streams with itself as the draft (every draft accepted, so passes verify several
    tokens beside other sequences), each output is its plain greedy decoding alone."""
    from drafters.model import ModelDrafter
    from tests.batching import PROMPTS, _alone, _greedy, _serve, _tokens

    family, extra = FAMILIES["qwen3"]
    path = str(tiny(tmp_path, default_model_dir, family, **extra))
    target = BatchedLM.load(path, dtype="bfloat16", kernels=kernels)
    assert isinstance(target, BatchedLM) and target.kernels == kernels
    assert all(w.qk_norms is not None for w in target.stack.weights)
    draft = ModelDrafter(BatchedLM.load(path, dtype="bfloat16", kernels=kernels), target)
    requests = _greedy(target, PROMPTS[:3], 24)
    plain = [_alone(target, None, r) for r in requests]
    served = _serve(target, {"model": draft}, requests, default_drafter="model")
    assert [_tokens(events) for events in served] == plain
    assert max(len(e.token_ids) for events in served for e in events) > 2


@pytest.mark.parametrize("rope", [
    None, {"rope_type": "linear", "factor": 2.0},
    {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
     "original_max_position_embeddings": 64},
    {"rope_type": "dynamic", "factor": 2.0},
    {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64},
], ids=["default", "linear", "llama3", "dynamic", "yarn"])
def test_rotary_tables_are_transformers(rope: dict[str, Any] | None) -> None:
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    settings = {**SMALL, "rope_theta": 50000.0}
    if rope is not None:
        settings["rope_scaling"] = rope
    config = LlamaConfig(**settings)
    own, theirs = Rotary(config), LlamaRotaryEmbedding(config)
    assert own.rope_type == theirs.rope_type
    x = torch.zeros(1, 4, dtype=torch.bfloat16)
    for positions in (torch.arange(40)[None], torch.arange(600)[None]):  # past the max
        for a, b in zip(own(x, positions), theirs(x, positions), strict=True):
            assert torch.equal(a, b), rope


def test_missing_weights_are_named(tmp_path: Path, default_model_dir: Path) -> None:
    path = tiny(tmp_path, default_model_dir, "llama", tie_word_embeddings=True)
    state = load_file(str(path / "model.safetensors"))
    del state["model.layers.1.mlp.up_proj.weight"]
    save_file(state, str(path / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"lacks 1 .*layers\.1\.mlp\.up_proj"):
        BatchedLM.load(str(path))


@pytest.mark.parametrize("window", [None, 6], ids=["global", "sliding"])
def test_a_phi3_model_runs_batched(tmp_path: Path, default_model_dir: Path,
                                   window: int | None) -> None:
    """Phi-3's fused q/k/v and gate/up matrices are split into the skeleton's: transformers'
    forward pass's logits (to float32's rounding), with its sliding window too (then in
    PyTorch's ops: the native kernels attend without one); transformers' own modules are
    rebuilt as the same skeleton; its long-context rotary embedding is refused in a line."""
    path = str(tiny(tmp_path, default_model_dir, "phi3", tie_word_embeddings=False,
                    pad_token_id=None, sliding_window=window))
    own = BatchedLM.load(path, dtype="float32")
    assert isinstance(own, BatchedLM) and isinstance(own.model, Skeleton)
    assert [w.window for w in own.stack.weights] == [window] * SMALL["num_hidden_layers"]
    assert own.kernels == ("native" if window is None else "torch")
    ids = [500 + 37 * i for i in range(24)]
    got = own.score(own.new_state(), ids)
    forward = TransformersLM.load(path, dtype="float32")
    torch.testing.assert_close(got, forward.score(forward.new_state(), ids),
                               rtol=1e-4, atol=1e-4)
    rebuilt = BatchedLM.wrap(*transformers_pretrained(path, "float32", "cpu"), name=path)
    assert isinstance(rebuilt, BatchedLM) and isinstance(rebuilt.model, Skeleton)
    assert torch.equal(rebuilt.score(rebuilt.new_state(), ids), got)
    from transformers import Phi3Config

    longrope = Phi3Config(**SMALL, rope_scaling={
        "rope_type": "longrope", "short_factor": [1.0] * 8, "long_factor": [2.0] * 8},
        original_max_position_embeddings=128)
    assert "original_max_position_embeddings" in str(unbatchable(longrope))


def test_other_families_keep_transformers_models(tmp_path: Path,
                                                 default_model_dir: Path) -> None:
    path = tiny(tmp_path, default_model_dir, "phi", tie_word_embeddings=True,
                pad_token_id=None)
    model, _ = pretrained(str(path), "float32", "cpu")
    assert not isinstance(model, Skeleton) and type(model).__name__ == "PhiForCausalLM"
    runner = BatchedLM.load(str(path))
    assert type(runner) is TransformersLM  # one sequence a pass, transformers' forward
    assert runner.score(runner.new_state(), [5, 6, 7]).shape[0] == 3
    with pytest.raises(ValueError, match="unknown dtype"):
        pretrained(str(path), "float8", "cpu")


def test_a_skeleton_has_no_forward_of_its_own(tiny_target: BatchedLM) -> None:
    assert isinstance(tiny_target.model, Skeleton)
    with pytest.raises(NotImplementedError, match="BatchedLM"):
        tiny_target.model(torch.tensor([[1, 2]]))


HEAVY = ("transformers.modeling_utils", "transformers.activations", "transformers.models."
         "llama.configuration_llama", "torch.distributed.tensor", "torch._dynamo", "sympy",
         "scipy")


@pytest.mark.parametrize("args", [[], ["--quantize", "int4"]], ids=["default", "int4"])
def test_a_server_never_imports_transformers_models(args: list[str]) -> None:
    """The default engine (the GGUF target, the shipped draft, the prefix cache), and a
    model directory quantized at load, are built without transformers' model and config
    classes and the ~175 MB their imports hold."""
    script = (
        "import sys, json\n"
        "from gateway.server import build_engine\n"
        "from gateway.service.settings import Settings\n"
        f"settings = Settings(quantize={args[1] if args else 'auto'!r})\n"
        "engine = build_engine(settings)\n"
        "print(json.dumps({'target': type(engine.target.model).__name__,\n"
        f"    'heavy': sorted(m for m in {HEAVY!r} if m in sys.modules)}}))\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=600, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    assert seen == {"target": "Skeleton", "heavy": []}, seen


READ = ("model_type", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
        "num_attention_heads", "num_key_value_heads", "hidden_act", "rms_norm_eps",
        "max_position_embeddings", "tie_word_embeddings", "rope_parameters", "eos_token_id")


def same_reading(light: Any, full: Any) -> None:
    for key in READ:
        assert getattr(light, key) == getattr(full, key), key
    assert attention_dims(light) == attention_dims(full)
    assert unbatchable(light) == unbatchable(full)
    probe = Skeleton(light, torch.float32) if unbatchable(full) is None else None
    if probe is not None:  # biases where transformers' classes have them
        want = {k for k, _ in Skeleton(full, torch.float32).named_parameters()}
        assert {k for k, _ in probe.named_parameters()} == want


@pytest.mark.parametrize("name", list(FAMILIES))
def test_configs_read_as_transformers_reads_them(tmp_path: Path, default_model_dir: Path,
                                                 name: str) -> None:
    from transformers import AutoConfig

    family, extra = FAMILIES[name]
    path = tiny(tmp_path, default_model_dir, family, **extra)
    light = read_config(json.loads((path / "config.json").read_text()))
    assert light is not None
    same_reading(light, AutoConfig.from_pretrained(path))


@pytest.mark.parametrize("family", ["llama", "mistral", "qwen2", "qwen3"])
def test_a_config_s_missing_values_are_transformers_defaults(family: str) -> None:
    import transformers

    cls = {"llama": "LlamaConfig", "mistral": "MistralConfig", "qwen2": "Qwen2Config",
           "qwen3": "Qwen3Config"}[family]
    light = read_config({"model_type": family, "vocab_size": 300, "eos_token_id": 7, **SMALL})
    assert light is not None
    same_reading(light, getattr(transformers, cls)(vocab_size=300, eos_token_id=7, **SMALL))
    assert read_config({"model_type": family, "vocab_size": 300, **SMALL}) is None
    scaled = {"model_type": family, "vocab_size": 300, "eos_token_id": 7, **SMALL,
              "rope_scaling": {"rope_type": "linear", "factor": 2.0}}
    assert read_config(scaled) is None  # transformers' class computes those frequencies
    assert read_config({"model_type": "phi3", "vocab_size": 300, "eos_token_id": 7,
                        **SMALL}) is None


def test_the_tokenizer_is_autotokenizer_s(default_model_dir: Path) -> None:
    from transformers import AutoTokenizer

    config = model_config(default_model_dir)
    assert isinstance(config, SimpleNamespace)
    ours, theirs = tokenizer(default_model_dir, config), AutoTokenizer.from_pretrained(
        default_model_dir)
    assert type(ours) is type(theirs)
    assert ours.get_vocab() == theirs.get_vocab()
    assert ours.chat_template == theirs.chat_template
    assert ours.all_special_tokens == theirs.all_special_tokens
    assert ours.eos_token_id == theirs.eos_token_id and ours.pad_token_id == theirs.pad_token_id
    text = "Speculative decoding keeps the target's text: 12 + 7 = 19, naïve café 🚀"
    assert ours(text)["input_ids"] == theirs(text)["input_ids"]
    chat = [{"role": "user", "content": "hi"}]
    assert (ours.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
            == theirs.apply_chat_template(chat, tokenize=False, add_generation_prompt=True))
