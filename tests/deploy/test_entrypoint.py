"""The container entry point, run outside Docker with the image's environment."""

from __future__ import annotations

import os
import signal
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from runtime.files import model_store
from tests.conftest import free_port, require_program, wait_for_status
from tests.deploy.conftest import REPO

ENTRYPOINT = REPO / "deploy" / "docker-entrypoint.sh"
MODEL = model_store.DEFAULT_MODEL
VENV_BIN = Path(sys.executable).parent

SHIM = f"""#!/bin/sh
# Stands in for the specserve CLI: records how it was called.
echo "$$ $*" >> "$SHIM_LOG"
if [ "$1 $2" = "models pull" ]; then
    mkdir -p "$SPECSERVE_HOME/models/{MODEL}"
    touch "$SPECSERVE_HOME/models/{MODEL}/{model_store.COMPLETE_MARKER}"
fi
"""


def _image_env(home: Path, **extra: str) -> dict[str, str]:
    """What the image sets, with SPECSERVE_HOME in a temporary directory."""
    env = {
        "PATH": f"{VENV_BIN}:/usr/local/bin:/usr/bin:/bin",
        "HOME": str(home.parent),
        "SPECSERVE_HOME": str(home),
        "HF_HOME": str(home / "huggingface"),
        "XDG_CACHE_HOME": str(home.parent / ".cache"),
        "PYTHONUNBUFFERED": "1",
        "PIP_NO_CACHE_DIR": "1",
    }
    env.update(extra)
    return env


@pytest.fixture()
def shim(tmp_path: Path) -> dict[str, str]:
    """An environment whose `specserve` is the recording shim."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    fake = bin_dir / "specserve"
    fake.write_text(SHIM)
    fake.chmod(0o755)
    env = _image_env(tmp_path / "home", SHIM_LOG=str(tmp_path / "calls.log"))
    env["PATH"] = f"{bin_dir}:/usr/bin:/bin"
    return env


def _run(env: dict[str, str], *args: str) -> tuple[subprocess.CompletedProcess[str], list[str]]:
    process = subprocess.Popen([str(ENTRYPOINT), *args], env=env, stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True)
    stdout, stderr = process.communicate(timeout=30)
    result = subprocess.CompletedProcess(process.args, process.returncode, stdout, stderr)
    log = Path(env["SHIM_LOG"])
    calls = log.read_text().splitlines() if log.exists() else []
    # The serve call must *be* the entry point's process (exec), so it gets SIGTERM.
    for call in calls:
        pid, _, argv = call.partition(" ")
        if argv.startswith("serve"):
            assert int(pid) == process.pid, "specserve serve was not exec'd"
    return result, [call.partition(" ")[2] for call in calls]


def _complete_model(root: Path) -> Path:
    model = root / "models" / MODEL
    model.mkdir(parents=True)
    (model / model_store.COMPLETE_MARKER).write_text("test\n")
    return model


def test_entrypoint_is_an_executable_posix_script() -> None:
    assert ENTRYPOINT.stat().st_mode & stat.S_IXUSR
    assert ENTRYPOINT.read_text().startswith("#!/bin/sh\n")
    subprocess.run(["sh", "-n", str(ENTRYPOINT)], check=True)
    subprocess.run([require_program("shellcheck", "shellcheck"), str(ENTRYPOINT)], check=True)


def test_present_model_starts_serve_without_pulling(shim: dict[str, str]) -> None:
    _complete_model(Path(shim["SPECSERVE_HOME"]))
    result, calls = _run(shim)
    assert result.returncode == 0, result.stderr
    assert calls == ["serve"]


def test_missing_model_is_pulled_first(shim: dict[str, str]) -> None:
    result, calls = _run(shim, "--port", "9000")
    assert result.returncode == 0, result.stderr
    assert calls == ["models pull", "serve --port 9000"]
    assert "pulling" in result.stderr


def test_pull_can_be_turned_off(shim: dict[str, str]) -> None:
    result, calls = _run({**shim, "SPECSERVE_PULL_MODEL": "never"})
    assert result.returncode == 1
    assert calls == []
    assert "SPECSERVE_PULL_MODEL=never" in result.stderr


def test_unknown_pull_mode_is_refused(shim: dict[str, str]) -> None:
    result, calls = _run({**shim, "SPECSERVE_PULL_MODEL": "sometimes"})
    assert result.returncode == 2 and calls == []


def test_baked_model_is_linked_in(shim: dict[str, str], tmp_path: Path) -> None:
    baked = _complete_model(tmp_path / "baked")
    result, calls = _run({**shim, "SPECSERVE_BAKED_HOME": str(tmp_path / "baked")})
    assert result.returncode == 0, result.stderr
    assert calls == ["serve"]
    link = Path(shim["SPECSERVE_HOME"]) / "models" / MODEL
    assert link.is_symlink() and link.resolve() == baked.resolve()


def test_dangling_link_to_a_baked_model_is_replaced_by_a_pull(shim: dict[str, str],
                                                              tmp_path: Path) -> None:
    models = Path(shim["SPECSERVE_HOME"]) / "models"
    models.mkdir(parents=True)
    (models / MODEL).symlink_to(tmp_path / "gone" / MODEL)
    result, calls = _run(shim)
    assert result.returncode == 0, result.stderr
    assert calls == ["models pull", "serve"]
    assert not (models / MODEL).is_symlink()


@pytest.mark.parametrize("target", ["/models/my-own", "org/some-model"])
def test_other_targets_are_not_pulled(shim: dict[str, str], target: str) -> None:
    result, calls = _run({**shim, "SPECSERVE_TARGET": target})
    assert result.returncode == 0, result.stderr
    assert calls == ["serve"]


@pytest.mark.parametrize("args, expected", [
    (["serve", "--log-level", "debug"], ["serve --log-level debug"]),
    (["specserve", "models", "pull"], ["models pull"]),
])
def test_commands_pass_through(shim: dict[str, str], args: list[str],
                               expected: list[str]) -> None:
    _complete_model(Path(shim["SPECSERVE_HOME"]))
    result, calls = _run(shim, *args)
    assert result.returncode == 0, result.stderr
    assert calls == expected


def test_other_programs_run_as_given(shim: dict[str, str]) -> None:
    result, calls = _run(shim, "sh", "-c", "echo hello")
    assert result.returncode == 0
    assert result.stdout == "hello\n" and calls == []


# ---------------------------------------------------------------------------- the real server


@pytest.fixture()
def model_home(tmp_path: Path, default_model_dir: Path) -> Path:
    """A SPECSERVE_HOME holding (a link to) the already pulled default model."""
    home = tmp_path / "home"
    (home / "models").mkdir(parents=True)
    (home / "models" / MODEL).symlink_to(default_model_dir)
    return home


def test_entrypoint_serve_help_parses(model_home: Path) -> None:
    env = _image_env(model_home, SPECSERVE_PULL_MODEL="never")
    result = subprocess.run([str(ENTRYPOINT), "--help"], env=env, capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "usage: specserve serve" in result.stdout


def test_entrypoint_starts_the_real_server_and_drains_on_sigterm(model_home: Path,
                                                                 tmp_path: Path) -> None:
    port, metrics_port = free_port(), free_port()
    env = _image_env(model_home, SPECSERVE_PULL_MODEL="never", SPECSERVE_HOST="127.0.0.1",
                     SPECSERVE_PORT=str(port), SPECSERVE_METRICS_PORT=str(metrics_port),
                     SPECSERVE_SHUTDOWN_TIMEOUT="5", SPECSERVE_THREADS="2",
                     SPECSERVE_LOG_LEVEL="warning")
    log = tmp_path / "server.log"
    with log.open("wb") as sink:
        process = subprocess.Popen([str(ENTRYPOINT)], env=env, stdout=sink, stderr=sink)
    try:
        base = f"http://127.0.0.1:{port}"

        def output() -> str:
            return log.read_text(errors="replace")

        wait_for_status(f"{base}/health", process, 90, output)
        cmdline = Path(f"/proc/{process.pid}/cmdline").read_bytes().split(b"\0")
        assert any(part.endswith(b"specserve") for part in cmdline), cmdline  # exec'd
        assert b"serve" in cmdline
        wait_for_status(f"{base}/ready", process, 180, output)
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=30) == 0, log.read_text(errors="replace")
    finally:
        if process.poll() is None:
            os.kill(process.pid, signal.SIGKILL)
            process.wait()
