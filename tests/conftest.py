"""Shared fixtures: tiny random-weight models (fast) and the real default model."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from decoding.drafter import Drafter
from drafters.combined import CombinedDrafter
from drafters.model import ModelDrafter
from drafters.ngram import NgramDrafter
from runtime.files import model_store
from runtime.runner.batched import BatchedLM
from runtime.runner.causal_lm import CausalLM, TransformersLM


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--runslow", action="store_true", help="run tests marked slow")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    skip_gpu = pytest.mark.skip(reason="needs an NVIDIA GPU with CUDA; none is present")
    skip_slow = pytest.mark.skip(reason="long-running; run with --runslow (make test-long)")
    for item in items:
        if item.get_closest_marker("gpu") and not torch.cuda.is_available():
            item.add_marker(skip_gpu)
        if item.get_closest_marker("slow") and not config.getoption("--runslow"):
            item.add_marker(skip_slow)


# what the tests keep of the caller's SPECSERVE_ variables: where models are, and where the
# session's measured verify curves are (every other setting comes from each test)
KEPT_VARIABLES = ("SPECSERVE_HOME", "SPECSERVE_VERIFY_CURVE_DIR")


@pytest.fixture(scope="session", autouse=True)
def _verify_curves_of_their_own(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """Servers the tests start, in process or not, keep their measured verify curves in
    the session's own directory: a curve timed on a machine as busy as a test run makes
    it is never read by a server started outside the tests."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("SPECSERVE_VERIFY_CURVE_DIR", str(tmp_path_factory.mktemp("curves")))
        yield


@pytest.fixture(scope="session")
def default_model_dir() -> Path:
    """The real default model (pulled once if missing; `make test` pulls it first)."""
    return Path(model_store.resolve("default"))


@pytest.fixture(scope="session")
def default_target(default_model_dir: Path) -> CausalLM:
    """The real default model in fp32, where greedy speculation is exactly lossless."""
    return BatchedLM.load(str(default_model_dir), dtype="float32")


def _tiny_model(out: Path, tokenizer_dir: Path, seed: int, layers: int = 2,
                context: int = 512) -> Path:
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128,
        num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=context, bos_token_id=tokenizer.bos_token_id,
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
    return BatchedLM.load(str(tiny_target_dir), dtype="float32")


@pytest.fixture(scope="session")
def tiny_reference(tiny_target_dir: Path) -> CausalLM:
    """The tiny target as transformers runs it: its own model class and forward pass."""
    return TransformersLM.load(str(tiny_target_dir), dtype="float32")


@pytest.fixture(scope="session")
def tiny_long_context_dir(tmp_path_factory: pytest.TempPathFactory,
                          default_model_dir: Path) -> Path:
    """The tiny target with a 16,384-token context: a request can ask for far more tokens
    than a test's time limit allows on any machine (the 512 of ``tiny_target_dir`` took
    a fast machine 0.3 s), so a test that needs work still running when its clock runs
    out does not race the machine's speed."""
    return _tiny_model(tmp_path_factory.mktemp("tiny-long-context"), default_model_dir,
                       seed=0, context=16384)


@pytest.fixture(scope="session")
def tiny_long_target(tmp_path_factory: pytest.TempPathFactory,
                     default_model_dir: Path) -> BatchedLM:
    """The tiny target with a 2,048-token context: room for more positions than the KV
    buffers first hold (512)."""
    path = _tiny_model(tmp_path_factory.mktemp("tiny-long"), default_model_dir, seed=0,
                       context=2048)
    target = BatchedLM.load(str(path), dtype="float32")
    assert isinstance(target, BatchedLM)
    return target


@pytest.fixture(scope="session")
def tiny_draft(tiny_draft_dir: Path) -> CausalLM:
    return TransformersLM.load(str(tiny_draft_dir), dtype="float32")


def require_program(name: str, package: str) -> str:
    """The path of a system program the tests run for real; a missing one fails the
    test (never a skip), saying how to install it."""
    path = shutil.which(name)
    if path is None:
        pytest.fail(f"{name} is not installed: run `make system-deps` (as root it runs "
                    f"apt-get install {package}), or install the Debian package {package}",
                    pytrace=False)
    return path


class RedisServer:
    """A throwaway redis-server on a free loopback port, no persistence."""

    def __init__(self, *extra: str) -> None:
        self.binary = require_program("redis-server", "redis-server")
        self.extra = extra
        self.port = free_port()
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        self.process = subprocess.Popen(
            [self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
             "--appendonly", "no", *self.extra],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.2) as s:
                    s.sendall(b"PING\r\n")
                    if s.recv(16).startswith(b"+PONG"):
                        return
            except OSError:
                time.sleep(0.05)
        raise RuntimeError("redis-server did not start")

    def stop(self) -> None:
        if self.process is not None:
            self.process.kill()
            self.process.wait(timeout=10)
            self.process = None


def stop_process(process: subprocess.Popen[Any], grace: float = 20) -> None:
    """SIGTERM, then SIGKILL if it has not exited within ``grace`` seconds."""
    process.terminate()
    try:
        process.wait(timeout=grace)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait(timeout=10)


def free_port() -> int:
    """A loopback TCP port nobody listens on right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def http_status(url: str) -> int | None:
    """The status of GET ``url``; None when nothing answers."""
    try:
        with urllib.request.urlopen(url, timeout=2) as response:
            return int(response.status)
    except urllib.error.HTTPError as exc:
        return exc.code
    except OSError:
        return None


def wait_for_status(url: str, process: subprocess.Popen[Any], timeout: float,
                    output: Callable[[], str] = lambda: "", status: int = 200) -> None:
    """Poll ``url`` until it answers ``status``; fail with the server's ``output`` if
    its process exits first or ``timeout`` seconds pass."""
    deadline = time.monotonic() + timeout
    while True:
        if process.poll() is not None:
            pytest.fail(f"the server exited with {process.returncode}:\n{output()}")
        if http_status(url) == status:
            return
        if time.monotonic() > deadline:
            pytest.fail(f"{url} did not answer {status} within {timeout:.0f} s:\n{output()}")
        time.sleep(0.1)


@pytest.fixture()
def redis_server() -> Iterator[RedisServer]:
    """A fresh redis-server for one test (killable, restartable)."""
    server = RedisServer()
    server.start()
    yield server
    server.stop()


@pytest.fixture()
def redis_url(redis_server: RedisServer) -> str:
    """REDIS_URL when given (a shared server), else a throwaway one."""
    return os.environ.get("REDIS_URL") or redis_server.url


@pytest.fixture()
def drafters(tiny_target: CausalLM, tiny_draft: CausalLM) -> dict[str, Drafter]:
    return {"ngram": NgramDrafter(), "model": ModelDrafter(tiny_draft, tiny_target),
            "ngram+model": CombinedDrafter([NgramDrafter()], ModelDrafter(tiny_draft, tiny_target))}
