"""The official ``openai`` npm package (tests/sdk/node, pinned in package-lock.json)
against a real server of the default model: ``node --test`` must pass every check."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.reliability.support import ServeProcess
from tests.sdk.conftest import MODEL

pytestmark = [pytest.mark.real_model, pytest.mark.timeout(600)]

NODE_DIR = Path(__file__).parent / "node"
CHECKS = 11  # the test() calls in sdk.test.mjs


def node() -> str:
    path = shutil.which("node")
    if path is None:
        pytest.fail("node is not installed: run `make system-deps` (as root it runs apt-get "
                    "install nodejs npm)", pytrace=False)
    if not (NODE_DIR / "node_modules" / "openai").is_dir():
        pytest.fail(f"the openai npm package is not installed: run `make node-deps` (npm ci "
                    f"in {NODE_DIR})", pytrace=False)
    return path


def test_the_official_node_sdk_passes_every_check(default_server: ServeProcess) -> None:
    env = {**os.environ, "SPECSERVE_URL": default_server.url, "SPECSERVE_MODEL": MODEL}
    run = subprocess.run([node(), "--test", "--test-reporter=tap", "sdk.test.mjs"],
                         cwd=NODE_DIR, env=env, capture_output=True, text=True, timeout=540)
    report = run.stdout + run.stderr
    assert run.returncode == 0, report[-6000:]
    counts = dict(re.findall(r"^# (pass|fail|skipped|cancelled) (\d+)$", report, re.M))
    assert counts == {"pass": str(CHECKS), "fail": "0", "skipped": "0", "cancelled": "0"}, report


def test_the_sdk_version_is_pinned() -> None:
    import json

    package = json.loads((NODE_DIR / "package.json").read_text())
    lock = json.loads((NODE_DIR / "package-lock.json").read_text())
    pinned = package["dependencies"]["openai"]
    assert re.fullmatch(r"\d+\.\d+\.\d+", pinned), "an exact version, not a range"
    assert lock["packages"]["node_modules/openai"]["version"] == pinned
