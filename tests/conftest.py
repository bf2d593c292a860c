"""Shared fixtures: tiny random-weight models (fast) and the real default model."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from decoding import model_store
from decoding.target import CausalLM


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--runslow", action="store_true", help="run tests marked slow")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    skip_gpu = pytest.mark.skip(reason="needs an NVIDIA GPU with CUDA; none is present")
    skip_slow = pytest.mark.skip(reason="long-running; run with --runslow (make test-long)")
    for item in items:
        if "gpu" in item.keywords and not torch.cuda.is_available():
            item.add_marker(skip_gpu)
        if "slow" in item.keywords and not config.getoption("--runslow"):
            item.add_marker(skip_slow)


@pytest.fixture(scope="session")
def default_model_dir() -> Path:
    """The real default model (pulled once if missing; `make test` pulls it first)."""
    return Path(model_store.resolve("default"))


@pytest.fixture(scope="session")
def default_target(default_model_dir: Path) -> CausalLM:
    """The real default model in fp32, where greedy speculation is exactly lossless."""
    return CausalLM.load(str(default_model_dir), dtype="float32")


def _tiny_model(out: Path, tokenizer_dir: Path, seed: int, layers: int = 2) -> Path:
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128,
        num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=512, bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=True,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    # Larger-than-default weights give peaked, tie-free distributions.
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.15)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


@pytest.fixture(scope="session")
def tiny_target_dir(tmp_path_factory: pytest.TempPathFactory, default_model_dir: Path) -> Path:
    """A 2-layer random-weight Llama sharing the default model's tokenizer."""
    return _tiny_model(tmp_path_factory.mktemp("tiny-target"), default_model_dir, seed=0)


@pytest.fixture(scope="session")
def tiny_draft_dir(tmp_path_factory: pytest.TempPathFactory, default_model_dir: Path) -> Path:
    """Another random-weight model with the same tokenizer, to use as a (poor) draft."""
    return _tiny_model(tmp_path_factory.mktemp("tiny-draft"), default_model_dir, seed=1, layers=1)


@pytest.fixture(scope="session")
def tiny_target(tiny_target_dir: Path) -> CausalLM:
    return CausalLM.load(str(tiny_target_dir), dtype="float32")


@pytest.fixture(scope="session")
def tiny_draft(tiny_draft_dir: Path) -> CausalLM:
    return CausalLM.load(str(tiny_draft_dir), dtype="float32")
