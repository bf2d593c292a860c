"""Gemma 3 in the batched runner: sliding-window and global layers with their own rotary
embeddings, norms around attention and the MLP, a scaled embedding; from a model
directory (transformers' logits) and from a GGUF file (the file's own weights)."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as GT

from runtime.loaders.loading import load_target
from runtime.matrices.quantized import BlockMatrix
from runtime.models.checkpoints import transformers_pretrained
from runtime.models.skeleton import GemmaNorm, Skeleton
from runtime.native.kernels import KernelsUnavailable
from runtime.runner.batched import BatchedLM
from runtime.runner.causal_lm import TransformersLM
from tests.test_gguf import encode

WINDOW = 7
HIDDEN, INTER, HEADS, KV_HEADS, HEAD_DIM = 256, 512, 4, 2, 64  # K-quant rows: 256 inputs
LAYER_TYPES = ["sliding_attention", "full_attention", "sliding_attention"]
# transformers' names of a layer's matrices and norms, by their GGUF names
MATRICES = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
            "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj",
            "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj"}
NORMS = {"attn_norm": "input_layernorm", "post_attention_norm": "post_attention_layernorm",
         "ffn_norm": "pre_feedforward_layernorm", "post_ffw_norm": "post_feedforward_layernorm",
         "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm"}


@pytest.fixture(scope="module")
def gemma_dir(tmp_path_factory: pytest.TempPathFactory, default_model_dir: Path) -> Path:
    """A random Gemma 3 with the default model's tokenizer: a window of 7 positions, its
    own query scale, the global layers' rotary scaled linearly, norms far from zero."""
    return make_gemma(tmp_path_factory.mktemp("gemma3"), default_model_dir, 512)


@pytest.fixture(scope="module")
def long_gemma_dir(tmp_path_factory: pytest.TempPathFactory, default_model_dir: Path) -> Path:
    """The same model taking 2,048 positions: prompts past a whole block of keys."""
    return make_gemma(tmp_path_factory.mktemp("gemma3-long"), default_model_dir, 2048)


def make_gemma(out: Path, default_model_dir: Path, positions: int) -> Path:
    from transformers import AutoTokenizer, Gemma3ForCausalLM, Gemma3TextConfig

    tokenizer = AutoTokenizer.from_pretrained(default_model_dir)
    config = Gemma3TextConfig(
        vocab_size=len(tokenizer), hidden_size=HIDDEN, intermediate_size=INTER,
        num_hidden_layers=len(LAYER_TYPES), num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS, head_dim=HEAD_DIM, sliding_window=WINDOW,
        layer_types=LAYER_TYPES, query_pre_attn_scalar=48, max_position_embeddings=positions,
        eos_token_id=tokenizer.eos_token_id, bos_token_id=tokenizer.bos_token_id,
        pad_token_id=0, tie_word_embeddings=True,
        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                         "full_attention": {"rope_type": "linear", "factor": 2.0,
                                            "rope_theta": 1e6}})
    torch.manual_seed(5)
    model = Gemma3ForCausalLM(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.normal_(0.0, 0.3 if name.endswith("norm.weight") else 0.06)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


IDS = [500 + 37 * i for i in range(40)]  # well past the window


def test_a_gemma3_model_runs_batched_with_transformers_logits(gemma_dir: Path) -> None:
    """Batched from its directory: transformers' forward pass's logits (to float32's
    rounding) over a sequence several windows long, each one-token step bitwise the full
    pass's row; transformers' own modules are rebuilt as the same skeleton; the native
    kernels say why they cannot run it."""
    own = BatchedLM.load(str(gemma_dir), dtype="float32")
    assert isinstance(own, BatchedLM) and isinstance(own.model, Skeleton)
    assert own.kernels == "torch"
    assert [w.window for w in own.stack.weights] == [WINDOW, None, WINDOW]
    full = own.score(own.new_state(), IDS)
    reference = TransformersLM.load(str(gemma_dir), dtype="float32")  # transformers' forward
    want = reference.score(reference.new_state(), IDS)
    torch.testing.assert_close(full, want, rtol=1e-4, atol=1e-4)
    assert torch.equal(full.argmax(-1), want.argmax(-1))

    state = own.new_state()
    own.prefill(state, IDS[:5])
    steps = torch.stack([own.score(state, [t])[0] for t in IDS[5:]])
    assert torch.equal(steps, full[5:])

    rebuilt = BatchedLM.wrap(*transformers_pretrained(str(gemma_dir), "float32", "cpu"),
                             name="gemma")
    assert isinstance(rebuilt, BatchedLM) and isinstance(rebuilt.model, Skeleton)
    assert torch.equal(rebuilt.score(rebuilt.new_state(), IDS), full)
    with pytest.raises(KernelsUnavailable, match="Gemma"):
        BatchedLM.load(str(gemma_dir), dtype="float32", kernels="native")


def test_a_gemma3_model_speculates_losslessly_in_batches(gemma_dir: Path) -> None:
    """In bfloat16 at three streams with itself as the draft (passes verify several
    tokens beside other sequences, past the window), each output is its plain greedy
    decoding alone."""
    from drafters.model import ModelDrafter
    from tests.batching import PROMPTS, _alone, _greedy, _serve, _tokens

    target = BatchedLM.load(str(gemma_dir), dtype="bfloat16")
    draft = ModelDrafter(BatchedLM.load(str(gemma_dir), dtype="bfloat16"), target)
    requests = _greedy(target, PROMPTS[:3], 24)
    plain = [_alone(target, None, r) for r in requests]
    served = _serve(target, {"model": draft}, requests, default_drafter="model")
    assert [_tokens(events) for events in served] == plain
    assert max(len(e.token_ids) for events in served for e in events) > 2


def test_windowed_layers_leave_out_whole_blocks_of_keys_before_the_window(
        long_gemma_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A prompt read in chunks past a whole block of keys (``SPAN_ALIGN``): the windowed
    layers read keys from the block their window starts in, and the logits are bitwise
    those of reading every key, chunk by chunk and step by step, and transformers' to
    float32's rounding."""
    from runtime.runner.layout import SPAN_ALIGN, Group

    ids = [(500 + 37 * i) % 40000 for i in range(1200)]
    chunks = [ids[:600], ids[600:1100], *([t] for t in ids[1100:1104])]
    starts: list[int] = []
    window_start = Group.window_start

    def recorded(group: Group, window: int) -> int:
        starts.append(window_start(group, window))
        return starts[-1]

    def run() -> torch.Tensor:
        own = BatchedLM.load(str(long_gemma_dir), dtype="float32")
        state = own.new_state()
        return torch.cat([own.score(state, chunk) for chunk in chunks])

    monkeypatch.setattr(Group, "window_start", recorded)
    cut = run()
    assert max(starts) >= SPAN_ALIGN and set(starts) <= {0, 512, 1024}  # keys were left out
    monkeypatch.setattr(Group, "window_start", lambda group, window: 0)
    every = run()
    assert torch.equal(cut, every)
    reference = TransformersLM.load(str(long_gemma_dir), dtype="float32")
    want = reference.score(reference.new_state(), ids[:1104])
    torch.testing.assert_close(cut, want, rtol=1e-4, atol=1e-4)


def test_an_alternative_sees_its_window_and_itself(gemma_dir: Path) -> None:
    """A row verifying drafts plus an alternative for its first draft, past the window,
    among other rows: the drafts' logits are the chain's alone and the alternative's
    those it gets as the next token (transformers' forward pass), once adopted the cache
    continues as if it had been fed."""
    from tests.batching import check_alternatives

    target = BatchedLM.load(str(gemma_dir), dtype="float32")
    reference = TransformersLM.load(str(gemma_dir), dtype="float32")
    assert isinstance(target, BatchedLM)
    check_alternatives(target, reference, [IDS[:11], IDS[3:26], IDS[:3]],
                       [[901, 902, 903, 904], [905], [906, 907, 908]], [True, False, True],
                       IDS[30:38])


def write_gemma_gguf(directory: Path, model_dir: Path, kinds: dict[str, GT]) -> Path:
    """The model of ``model_dir`` as a Gemma 3 GGUF file (norms as llama.cpp writes them,
    1 + weight), each matrix in ``kinds[part]`` (default Q5_0; ``embed``: Q8_0); its config
    and tokenizer beside."""
    from safetensors.torch import load_file

    state = load_file(str(model_dir / "model.safetensors"))
    directory.mkdir(parents=True, exist_ok=True)
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(model_dir / name, directory / name)
    path = directory / "gemma.gguf"
    writer = gguf.GGUFWriter(str(path), "gemma3")
    writer.add_block_count(len(LAYER_TYPES))

    def add(name: str, tensor: torch.Tensor, kind: GT) -> None:
        data = encode(tensor.float().numpy(), kind, seed=len(name))
        writer.add_tensor(name, data, raw_dtype=kind if kind != GT.F32 else None)

    add("token_embd.weight", state["model.embed_tokens.weight"], kinds.get("embed", GT.Q8_0))
    add("output_norm.weight", state["model.norm.weight"] + 1, GT.F32)
    for i in range(len(LAYER_TYPES)):
        prefix = f"model.layers.{i}."
        for part, hf in MATRICES.items():
            add(f"blk.{i}.{part}.weight", state[prefix + hf + ".weight"],
                kinds.get(part, GT.Q5_0))
        for part, hf in NORMS.items():
            add(f"blk.{i}.{part}.weight", state[prefix + hf + ".weight"] + 1, GT.F32)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def file_model(path: Path, model_dir: Path) -> BatchedLM:
    """The directory's model in float32 with the file's dequantized matrices."""
    reference = BatchedLM.load(str(model_dir), dtype="float32")
    assert isinstance(reference, BatchedLM)
    skeleton: Any = reference.model
    with torch.no_grad():
        for tensor in gguf.GGUFReader(str(path)).tensors:
            part = tensor.name.split(".")[-2]
            values = torch.from_numpy(gguf.quants.dequantize(
                np.asarray(tensor.data), tensor.tensor_type).copy())
            if part in MATRICES:
                layer = skeleton.model.layers[int(tensor.name.split(".")[1])]
                layer.get_submodule(MATRICES[part]).weight.copy_(values)
            elif tensor.name == "token_embd.weight":
                skeleton.model.embed_tokens.weight.copy_(values)
    return BatchedLM(skeleton, reference.tokenizer)


@pytest.mark.parametrize("int8_activations", [False, True], ids=["bfloat16", "int8"])
def test_a_gemma3_gguf_file_serves_its_own_weights(tmp_path: Path, gemma_dir: Path,
                                                   int8_activations: bool) -> None:
    """A Gemma 3 GGUF as llama.cpp's converter writes one (norms holding 1 + weight, q/k/v
    in Q5_0 and Q8_0, a Q4_K and a Q6_K matrix): batched, its norms the file's float32
    values, its logits those of the same model made of gguf's dequantization of the file.
    With int8 activations its Q5_0 and Q8_0 matrices keep their codes as block
    matrices."""
    kinds = {"attn_v": GT.Q8_0, "attn_output": GT.Q4_K, "ffn_down": GT.Q6_K}
    path = write_gemma_gguf(tmp_path, gemma_dir, kinds)
    blocks = int8_activations
    target = load_target(str(path), quantize="auto", int8_activations=int8_activations)
    assert isinstance(target, BatchedLM) and isinstance(target.model, Skeleton)
    assert target.weights_format == "gguf-q4_k+q5_0+q6_k+q8_0"
    assert [w.window for w in target.stack.weights] == [WINDOW, None, WINDOW]
    assert isinstance(target.stack.weights[0].qkv, BlockMatrix) == blocks
    norm = target.stack.weights[1].out_norms[0] if target.stack.weights[1].out_norms else None
    assert isinstance(norm, GemmaNorm) and norm.offset == 0.0
    file_norm = next(t for t in gguf.GGUFReader(str(path)).tensors
                     if t.name == "blk.1.post_attention_norm.weight")
    assert torch.equal(norm.weight, torch.from_numpy(np.asarray(file_norm.data).copy()))

    reference = file_model(path, gemma_dir)
    got = target.score(target.new_state(), IDS).float()
    want = reference.score(reference.new_state(), IDS)
    agree = (got.argmax(-1) == want.argmax(-1)).float().mean()
    centred = got - got.mean(-1, keepdim=True), want - want.mean(-1, keepdim=True)
    cosine = torch.nn.functional.cosine_similarity(*centred, dim=-1)
    # bfloat16 activations and weights against float32: near-ties of a random model flip
    assert agree >= 0.9 and cosine.min() >= 0.99, (agree, cosine.min())
