"""GGUF targets: the file's own 4-bit codes, served as int4; other types refused."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as GT

from runtime.files import model_store
from runtime.loaders.gguf_weights import GGUFTypeError, byte_codes, int4_rows
from runtime.loaders.loading import load_target
from runtime.matrices.quantized import Int4Matrix
from runtime.matrices.weights import Matrix, Stacked
from runtime.runner.batched import BatchedLM

HIDDEN, INTER, LAYERS, HEADS, KV_HEADS = 256, 512, 2, 4, 2  # Q4_K/Q6_K need rows of 256
NAMES = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
         "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
         "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}
# Phi-3's: q/k/v fused as attn_qkv, gate/up as ffn_up (as transformers' modules are)
PHI3_NAMES = {"self_attn.qkv_proj": "attn_qkv", "self_attn.o_proj": "attn_output",
              "mlp.gate_up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}


def k_blocks(kind: GT, rows: int, cols: int, seed: int) -> np.ndarray:
    """Random K-quant blocks (gguf has no quantizer for them), Q4_K's, Q5_K's and Q6_K's
    with sane scales: d (and dmin) of either sign, each block its own."""
    size = gguf.GGML_QUANT_SIZES[kind][1]
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, (rows * cols // 256, size), dtype=np.uint8)

    def halves(magnitude: float) -> np.ndarray:  # [blocks, 2] bytes of float16s
        values = magnitude * rng.uniform(0.5, 1.5, (len(blocks), 1)) * rng.choice([-1, 1], (
            len(blocks), 1))
        return values.astype(np.float16).view(np.uint8)

    if kind in (GT.Q4_K, GT.Q5_K):
        blocks[:, 0:2] = halves(0.002 if kind == GT.Q4_K else 0.001)
        blocks[:, 2:4] = halves(0.001)
    elif kind == GT.Q6_K:  # d is the last two bytes; int8 scales before it
        blocks[:, -2:] = halves(0.0005)
    return blocks.reshape(rows, -1)


def encode(weight: np.ndarray, kind: GT, seed: int) -> np.ndarray:
    if kind in (GT.Q4_K, GT.Q5_K, GT.Q6_K, GT.Q2_K):
        return k_blocks(kind, *weight.shape, seed)
    if kind == GT.F32:
        return weight.astype(np.float32)
    return gguf.quants.quantize(weight.astype(np.float32), kind)


def llama_order(rows: int, heads: int) -> np.ndarray:
    """The row order llama.cpp stores q and k in (its rotary layout)."""
    return np.arange(rows).reshape(heads, 2, rows // heads // 2).swapaxes(1, 2).reshape(-1)


def write_gguf(directory: Path, model_dir: Path, kinds: dict[str, GT],
               arch: str = "llama") -> Path:
    """The tiny model of ``model_dir`` as a GGUF file, each matrix in ``kinds[part]``
    (default Q4_1; ``embed`` for the tied embedding), biases in float32; its config and
    tokenizer beside."""
    from safetensors.torch import load_file

    state = load_file(str(model_dir / "model.safetensors"))
    directory.mkdir(parents=True, exist_ok=True)
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(model_dir / name, directory / name)
    path = directory / "tiny.gguf"
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(LAYERS)
    writer.add_embedding_length(HIDDEN)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)

    def add(name: str, tensor: torch.Tensor, kind: GT, seed: int) -> None:
        data = encode(tensor.float().numpy(), kind, seed)
        writer.add_tensor(name, data, raw_dtype=kind if kind != GT.F32 else None)

    add("token_embd.weight", state["model.embed_tokens.weight"], kinds.get("embed", GT.Q8_0), 0)
    add("output_norm.weight", state["model.norm.weight"], GT.F32, 0)
    for i in range(LAYERS):
        prefix = f"model.layers.{i}."
        add(f"blk.{i}.attn_norm.weight", state[prefix + "input_layernorm.weight"], GT.F32, 0)
        add(f"blk.{i}.ffn_norm.weight", state[prefix + "post_attention_layernorm.weight"],
            GT.F32, 0)
        for hf, part in (PHI3_NAMES if arch == "phi3" else NAMES).items():
            weight = state[prefix + hf + ".weight"]
            if prefix + hf + ".bias" in state:
                add(f"blk.{i}.{part}.bias", state[prefix + hf + ".bias"], GT.F32, 0)
            if part in ("attn_q", "attn_k") and arch == "llama":
                weight = weight[llama_order(weight.shape[0],
                                            HEADS if part == "attn_q" else KV_HEADS)]
            add(f"blk.{i}.{part}.weight", weight, kinds.get(part, GT.Q4_1), 10 * i + len(part))
        for hf, part in (("self_attn.q_norm", "attn_q_norm"), ("self_attn.k_norm", "attn_k_norm")):
            if prefix + hf + ".weight" in state:  # Qwen3's
                add(f"blk.{i}.{part}.weight", state[prefix + hf + ".weight"], GT.F32, 0)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory, default_model_dir: Path) -> Path:
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    out = tmp_path_factory.mktemp("tiny-256")
    tokenizer = AutoTokenizer.from_pretrained(default_model_dir)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=HIDDEN,
                         intermediate_size=INTER, num_hidden_layers=LAYERS,
                         num_attention_heads=HEADS, num_key_value_heads=KV_HEADS,
                         max_position_embeddings=512, tie_word_embeddings=True,
                         eos_token_id=tokenizer.eos_token_id)
    return saved_random(LlamaForCausalLM, config, tokenizer, out)


def saved_random(model_class: Any, config: Any, tokenizer: Any, out: Path) -> Path:
    """A model of ``config`` with random matrices (seeded), saved with ``tokenizer``."""
    torch.manual_seed(0)
    model = model_class(config)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.1)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def dense(product: Any) -> torch.Tensor:  # [out, in]: what a product multiplies by
    if isinstance(product, Stacked):
        return torch.cat([dense(p) for p in product.parts])
    if isinstance(product, Matrix):
        return product.rows
    return product.dequantize()


def file_weights(path: Path) -> dict[str, torch.Tensor]:
    """gguf's own dequantization of every tensor, q and k rows in Hugging Face order."""
    out = {}
    for tensor in gguf.GGUFReader(str(path)).tensors:
        values = torch.from_numpy(gguf.quants.dequantize(np.asarray(tensor.data),
                                                         tensor.tensor_type).copy())
        part = tensor.name.split(".")[-2]
        if part in ("attn_q", "attn_k"):
            order = np.argsort(llama_order(values.shape[0],
                                           HEADS if part == "attn_q" else KV_HEADS))
            values = values[torch.from_numpy(order)]
        out[tensor.name] = values.float()
    return out


@pytest.mark.parametrize("kind", [GT.Q4_0, GT.Q4_1, GT.Q4_K])
def test_int4_codes_are_the_files(kind: GT) -> None:
    """The codes, scales and minimums read from the blocks give back gguf's own
    dequantization; packed for the kernel, the codes are unchanged and only the bfloat16
    scale and zero move the weights."""
    weight = np.random.default_rng(1).normal(0, 0.1, (192, 512)).astype(np.float32)
    data = encode(weight, kind, seed=3)
    want = torch.from_numpy(gguf.quants.dequantize(data, kind).copy())
    rows = int4_rows(kind.name, data, 512)
    assert torch.allclose(rows.dequantize(), want, rtol=1e-6, atol=1e-7)
    matrix = Int4Matrix(rows)
    assert torch.equal(matrix.codes(), rows.codes)
    error = (matrix.dequantize().float() - want).abs().max() / want.abs().max()
    assert 0 < error < 2 ** -7


@pytest.mark.parametrize("kinds", [
    {}, {"attn_q": GT.Q4_0, "attn_k": GT.Q4_0, "ffn_up": GT.Q4_0},
    {part: GT.Q8_0 for part in NAMES.values()},
    {"attn_q": GT.Q4_K, "attn_k": GT.Q4_K, "attn_v": GT.Q6_K, "attn_output": GT.Q5_K,
     "ffn_gate": GT.Q4_K, "ffn_up": GT.Q4_K, "ffn_down": GT.Q6_K, "embed": GT.Q6_K},
    {"attn_q": GT.Q5_0, "attn_k": GT.Q5_0, "attn_v": GT.Q5_1, "ffn_up": GT.Q5_0,
     "ffn_down": GT.Q5_1},
], ids=["q4_1", "q4_0-mixed", "q8_0", "q4_k_m", "q5"])
def test_gguf_target_serves_the_files_weights(tmp_path: Path, tiny_dir: Path,
                                              kinds: dict[str, GT]) -> None:
    """With bfloat16 activations (int8 ones: tests/test_block_products.py)."""
    path = write_gguf(tmp_path, tiny_dir, kinds)
    target = load_target(str(path), quantize="auto", int8_activations=False)
    assert isinstance(target, BatchedLM)
    assert target.dtype == torch.bfloat16 and target.weights_format.startswith("gguf-")
    assert all(p.device.type == "meta" for p in target.model.model.layers[0].mlp.parameters())
    want = file_weights(path)
    layer = target.stack.weights[1]
    for product, names in ((layer.qkv, ("attn_q", "attn_k", "attn_v")),
                           (layer.down, ("ffn_down",))):
        expected = torch.cat([want[f"blk.1.{n}.weight"] for n in names])
        got = dense(product).float()
        scale = expected.abs().max()
        assert (got - expected).abs().max() <= 2 ** -7 * scale, (names, kinds)
    # the whole model against the same model made of gguf's dequantized weights, both
    # with bfloat16 activations: only the kernel's bfloat16 scales differ
    reference = BatchedLM.load(str(tiny_dir), dtype="bfloat16")
    with torch.no_grad():
        for name, module in reference.model.named_modules():
            for hf, part in NAMES.items():
                if name.endswith(hf):
                    i = int(name.split(".")[2])
                    module.weight.copy_(want[f"blk.{i}.{part}.weight"])
        reference.model.model.embed_tokens.weight.copy_(want["token_embd.weight"])
    reference = BatchedLM(reference.model, reference.tokenizer)
    ids = list(range(500, 540))
    got_logits = target.score(target.new_state(), ids).float()
    ref_logits = reference.score(reference.new_state(), ids).float()
    agree = (got_logits.argmax(-1) == ref_logits.argmax(-1)).float().mean()
    if all(kind == GT.Q8_0 for kind in kinds.values()) and kinds:
        assert torch.equal(got_logits, ref_logits)  # bfloat16 both ways: the same product
    else:  # a random model's near-ties flip under the scales' rounding now and then
        assert agree >= 0.85, agree


def test_unsupported_type_is_refused_naming_it(tmp_path: Path, tiny_dir: Path) -> None:
    path = write_gguf(tmp_path, tiny_dir, {"ffn_up": GT.Q2_K})
    with pytest.raises(GGUFTypeError, match=r"blk\.0\.ffn_up\.weight.*Q2_K"):
        load_target(str(path), quantize="auto")


@pytest.mark.parametrize("kind", [GT.Q5_0, GT.Q8_0])
def test_byte_codes_are_the_files(kind: GT) -> None:
    """Q5_0's 5-bit codes (their fifth bits apart) and Q8_0's, as int8 codes times the
    blocks' float16 scales: exactly gguf's own dequantization."""
    weight = np.random.default_rng(2).normal(0, 0.1, (96, 256)).astype(np.float32)
    data = encode(weight, kind, seed=0)
    codes, scales = byte_codes(kind.name, data)
    assert codes.dtype == np.int8 and codes.min() >= (-16 if kind == GT.Q5_0 else -127)
    assert codes.max() <= (15 if kind == GT.Q5_0 else 127) and codes.min() < 0 < codes.max()
    want = gguf.quants.dequantize(data, kind)
    assert np.array_equal((codes * scales).reshape(want.shape), want)


def test_a_gguf_file_is_a_target_path(tmp_path: Path, tiny_dir: Path) -> None:
    path = write_gguf(tmp_path, tiny_dir, {})
    assert model_store.resolve(str(path)) == str(path)
    with pytest.raises(ValueError, match="quantized already"):
        load_target(str(path), quantize="int4")
    with pytest.raises(FileNotFoundError, match=r"nor a \.gguf file"):
        model_store.resolve(str(tmp_path / "tokenizer.json"))


def test_default_gguf_codes_are_the_files(default_model_dir: Path) -> None:
    """The real default model's Q4_1 file: every int4 tensor's codes reproduce gguf's own
    dequantization (float32 scales), and the kernel's bfloat16 scales move no weight by
    more than 2^-7 of the tensor's largest."""
    path = model_store.default_gguf()
    reader = gguf.GGUFReader(str(path))
    tensors = [t for t in reader.tensors if t.tensor_type.name == "Q4_1"][:14]
    assert tensors
    for tensor in tensors:
        data = np.asarray(tensor.data)
        want = torch.from_numpy(gguf.quants.dequantize(data, tensor.tensor_type).copy())
        rows = int4_rows("Q4_1", data, int(tensor.shape[0]))
        assert torch.allclose(rows.dequantize(), want, rtol=1e-6, atol=1e-6), tensor.name
        got = Int4Matrix(rows).dequantize().float()
        assert (got - want).abs().max() / want.abs().max() < 2 ** -7, tensor.name


def same_logits_as_directory(target: Any, model_dir: Path) -> None:
    """``target`` (a file written from ``model_dir`` in float32) gives the directory's
    logits, both run in bfloat16."""
    reference = BatchedLM.load(str(model_dir), dtype="bfloat16")
    ids = list(range(500, 540))
    got = target.score(target.new_state(), ids).float()
    expected = reference.score(reference.new_state(), ids).float()
    torch.testing.assert_close(got, expected, rtol=0.02, atol=0.02)
    assert torch.equal(got.argmax(-1), expected.argmax(-1))


@pytest.mark.parametrize("family", ["qwen2", "qwen3"])
def test_a_qwen_file_s_biases_and_norms_are_served(tmp_path: Path, default_model_dir: Path,
                                                  family: str) -> None:
    """Qwen2's q, k and v biases and Qwen3's per-head q and k norms come from the file:
    the same logits as the model directory it was written from (float32 tensors, both
    run in bfloat16); a file without the norms its model needs is refused naming one."""
    import transformers
    from transformers import AutoTokenizer

    name = {"qwen2": "Qwen2", "qwen3": "Qwen3"}[family]
    tokenizer = AutoTokenizer.from_pretrained(default_model_dir)
    config = getattr(transformers, name + "Config")(
        vocab_size=len(tokenizer), hidden_size=HIDDEN, intermediate_size=INTER,
        num_hidden_layers=LAYERS, num_attention_heads=HEADS, num_key_value_heads=KV_HEADS,
        head_dim=HIDDEN // HEADS, max_position_embeddings=512, tie_word_embeddings=True,
        use_sliding_window=False, eos_token_id=tokenizer.eos_token_id,
        attention_bias=family == "qwen3")
    torch.manual_seed(0)
    model = getattr(transformers, name + "ForCausalLM")(config)
    with torch.no_grad():
        for key, p in model.named_parameters():
            if p.dim() > 1 or key.endswith("bias"):
                p.normal_(0.0, 0.5 if key.endswith("bias") else 0.1)
            elif "q_norm" in key or "k_norm" in key:
                p.normal_(1.0, 0.5)  # a norm that is not all ones shows
    model_dir = tmp_path / "model"
    model.save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    wide = {"embed": GT.F32, **{part: GT.F32 for part in NAMES.values()}}
    path = write_gguf(tmp_path / "gguf", model_dir, wide, arch=family)
    target = load_target(str(path), quantize="auto", int8_activations=False)
    assert isinstance(target, BatchedLM)
    bias = target.stack.weights[1].qkv.bias
    want = model.model.layers[1].self_attn
    assert bias is not None and torch.equal(
        bias, torch.cat([want.q_proj.bias, want.k_proj.bias, want.v_proj.bias]).bfloat16())
    norms = target.stack.weights[1].qk_norms
    if family == "qwen3":
        assert norms is not None
        assert torch.equal(norms[0].weight, want.q_norm.weight.bfloat16())
        assert torch.equal(norms[1].weight, want.k_norm.weight.bfloat16())
    else:
        assert norms is None
    same_logits_as_directory(target, model_dir)
    if family == "qwen3":
        from safetensors.torch import load_file, save_file

        state = load_file(str(model_dir / "model.safetensors"))
        del state["model.layers.0.self_attn.k_norm.weight"]
        save_file(state, str(model_dir / "model.safetensors"), metadata={"format": "pt"})
        broken = write_gguf(tmp_path / "broken", model_dir, wide, arch=family)
        with pytest.raises(ValueError, match=r"no tensor 'blk\.0\.attn_k_norm\.weight'"):
            load_target(str(broken), quantize="auto")


def test_a_phi3_file_s_fused_matrices_are_served(tmp_path: Path, default_model_dir: Path) -> None:
    """Phi-3's file keeps q/k/v as one tensor and gate/up as another: served as the fused
    products they are, the same logits as the model directory it was written from (float32
    tensors, both run in bfloat16)."""
    from transformers import AutoTokenizer, Phi3Config, Phi3ForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(default_model_dir)
    config = Phi3Config(vocab_size=len(tokenizer), hidden_size=HIDDEN, intermediate_size=INTER,
                        num_hidden_layers=LAYERS, num_attention_heads=HEADS,
                        num_key_value_heads=KV_HEADS, max_position_embeddings=512,
                        tie_word_embeddings=True, pad_token_id=None,
                        eos_token_id=tokenizer.eos_token_id)
    model_dir = saved_random(Phi3ForCausalLM, config, tokenizer, tmp_path / "model")
    wide = {"embed": GT.F32, **{part: GT.F32 for part in PHI3_NAMES.values()}}
    path = write_gguf(tmp_path / "gguf", model_dir, wide, arch="phi3")
    target = load_target(str(path), quantize="auto", int8_activations=False)
    assert isinstance(target, BatchedLM)
    same_logits_as_directory(target, model_dir)


def test_a_lone_file_s_config_and_tokenizer_are_converted_once(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """A GGUF with no model directory beside it: transformers converts its config and
    tokenizer from the file once (parsing its whole vocabulary), and later starts read
    the kept copy, which tokenizes as the conversion does; where nothing can be kept, the
    start still succeeds and says why."""
    import transformers

    from runtime.loaders.gguf_weights import config_and_tokenizer, converted

    lone = tmp_path / "files" / "model.gguf"
    lone.parent.mkdir()
    lone.symlink_to(model_store.default_gguf())
    monkeypatch.setenv("SPECSERVE_HOME", str(tmp_path / "home"))
    config, tokenizer = config_and_tokenizer(lone)
    kept = converted(lone)
    assert (kept / "config.json").is_file() and (kept / "tokenizer.json").is_file()

    with monkeypatch.context() as patch:
        for cls in (transformers.AutoConfig, transformers.AutoTokenizer):
            own = cls.from_pretrained

            def from_pretrained(*args: Any, _own: Any = own, **kwargs: Any) -> Any:
                assert "gguf_file" not in kwargs, "converted again"
                return _own(*args, **kwargs)

            patch.setattr(cls, "from_pretrained", from_pretrained)
        config2, tokenizer2 = config_and_tokenizer(lone)
    assert config2.model_type == config.model_type == "llama"
    assert config2.eos_token_id == config.eos_token_id
    text = "<|im_start|>user\nHow do I sort a list?<|im_end|> ünïcode 日本"
    assert tokenizer2(text)["input_ids"] == tokenizer(text)["input_ids"]
    assert tokenizer2.chat_template == tokenizer.chat_template

    monkeypatch.setenv("SPECSERVE_HOME", str(lone))  # a file: nothing can be kept under it
    with caplog.at_level("WARNING"):
        config3, _ = config_and_tokenizer(lone)
    assert config3.model_type == "llama" and "could not keep" in caplog.text


def test_the_loader_s_reader_reads_what_gguf_s_reads(tmp_path: Path, tiny_dir: Path) -> None:
    """``gguf_file.read`` steps over the metadata arrays (the vocabulary) that gguf's
    reader builds: the same tensors (names, types, shapes, bytes) and scalar values, for
    the real default file and one of every type the loader takes; a file that is not a
    GGUF, or ends early, is refused saying so."""
    from runtime.files import gguf_file

    kinds = {"attn_q": GT.Q4_K, "attn_k": GT.Q5_0, "attn_v": GT.Q5_1, "attn_output": GT.Q6_K,
             "ffn_gate": GT.Q4_0, "ffn_up": GT.F16, "ffn_down": GT.Q8_0, "embed": GT.F32}
    written = write_gguf(tmp_path, tiny_dir, kinds)
    for path in (model_store.default_gguf(), written):
        ours = gguf_file.read(Path(path))
        theirs = gguf.GGUFReader(str(path))
        assert list(ours.tensors) == [t.name for t in theirs.tensors]
        for tensor in theirs.tensors:
            own = ours.tensors[tensor.name]
            assert own.tensor_type == tensor.tensor_type
            assert np.array_equal(own.shape, tensor.shape)
            assert own.data.dtype == tensor.data.dtype and own.data.shape == tensor.data.shape
            assert np.array_equal(own.data, tensor.data)
        scalars = {k: f.contents() for k, f in theirs.fields.items()
                   if not k.startswith("GGUF.") and not isinstance(f.contents(), list)}
        assert scalars and all(ours.values[k] == pytest.approx(v) if isinstance(v, float)
                               else ours.values[k] == v for k, v in scalars.items())
    default = gguf_file.read(Path(model_store.default_gguf()))
    assert default.values["general.architecture"] == "llama"
    with pytest.raises(ValueError, match="not a GGUF file"):
        gguf_file.read(tiny_dir / "tokenizer.json")
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(written.read_bytes()[:200])
    with pytest.raises(ValueError, match="ends inside its header"):
        gguf_file.read(cut)
