"""lm-evaluation-harness scores the served model as it scores the checkpoint.

A real ``specserve serve`` process serves the default model in float32; the real
``lm_eval`` command line runs the local multiple-choice task of this directory
(``specserve_mc.yaml`` over ``specserve_mc.jsonl``, no hub download) twice: with
``--model local-completions`` against the server (prompt log-probabilities through
``/v1/completions`` with ``echo`` and ``logprobs``, batched token-id prompts) and with
``--model hf`` on the same safetensors weights in float32. Every choice's log-likelihood
agrees within 1e-3, and so do the greedy flags and the accuracies.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

import pytest

from tests.conftest import KEPT_VARIABLES, free_port, wait_for_status

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
TASK = "specserve_mc"
SERVED = "smollm2-float32"
LOGLIK_TOLERANCE = 1e-3
BATCH = 8  # prompts per request (local-completions) and per forward pass (hf)

pytestmark = pytest.mark.timeout(600)


def _read(log: IO[str]) -> str:
    log.seek(0)
    return log.read()


def _env() -> dict[str, str]:
    """Nothing from the hub, and no SPECSERVE_ setting from the caller."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("SPECSERVE_") or k in KEPT_VARIABLES}
    env.update(HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
               TOKENIZERS_PARALLELISM="false")
    return env


@pytest.fixture(scope="module")
def server_url() -> Iterator[str]:
    """The default model served in float32 (its safetensors weights, as they are)."""
    port = free_port()
    with tempfile.TemporaryFile(mode="w+") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "specserve.cli", "serve", "--quantize", "none",
             "--dtype", "float32", "--draft", "none", "--served-model-name", SERVED,
             "--host", "127.0.0.1", "--port", str(port)],
            cwd=REPO, env=_env(), stdout=log, stderr=subprocess.STDOUT, text=True)
        try:
            url = f"http://127.0.0.1:{port}"
            wait_for_status(f"{url}/ready", proc, 300, lambda: _read(log))
            yield url
        finally:
            proc.kill()
            proc.wait(timeout=30)


def _lm_eval(model: str, model_args: str, out: Path) -> tuple[dict[str, Any], list[Any]]:
    """One ``lm_eval`` run of the task: its results and its per-document samples."""
    result = subprocess.run(
        [sys.executable, "-m", "lm_eval", "--model", model, "--model_args", model_args,
         "--tasks", TASK, "--include_path", str(HERE), "--batch_size", str(BATCH),
         "--device", "cpu", "--output_path", str(out), "--log_samples"],
        cwd=HERE, env=_env(), capture_output=True, text=True, timeout=480)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    results = json.loads(next(out.rglob("results_*.json")).read_text())
    samples = [json.loads(line) for line in
               next(out.rglob(f"samples_{TASK}_*.jsonl")).read_text().splitlines()]
    return results["results"][TASK], sorted(samples, key=lambda s: s["doc_id"])


def _choices(sample: dict[str, Any]) -> list[tuple[float, bool]]:
    """Each choice's (log-likelihood, greedy) as lm_eval logged it."""
    return [(float(loglik), greedy == "True") for [[loglik, greedy]] in sample["resps"]]


def test_local_completions_scores_as_hf_does(server_url: str, default_model_dir: Path,
                                             tmp_path: Path) -> None:
    weights = str(default_model_dir)
    served, served_samples = _lm_eval(
        "local-completions",
        f"model={SERVED},base_url={server_url}/v1/completions,tokenizer_backend=huggingface,"
        f"tokenizer={weights},num_concurrent=1,max_retries=1,tokenized_requests=True",
        tmp_path / "served")
    hf, hf_samples = _lm_eval("hf", f"pretrained={weights},dtype=float32", tmp_path / "hf")

    assert [s["doc_id"] for s in served_samples] == [s["doc_id"] for s in hf_samples]
    deltas = []
    for ours, theirs in zip(served_samples, hf_samples, strict=True):
        for (loglik, greedy), (expected, expected_greedy) in zip(
                _choices(ours), _choices(theirs), strict=True):
            deltas.append(abs(loglik - expected))
            assert greedy == expected_greedy, (ours["doc_id"], loglik, expected)
    assert len(deltas) == sum(len(s["doc"]["choices"]) for s in hf_samples)
    print(f"\n{len(deltas)} log-likelihoods, max |delta| {max(deltas):.3g}; acc served "
          f"{served['acc,none']} hf {hf['acc,none']}; acc_norm served "
          f"{served['acc_norm,none']} hf {hf['acc_norm,none']}")
    assert max(deltas) <= LOGLIK_TOLERANCE
    assert served["acc,none"] == hf["acc,none"]
    assert served["acc_norm,none"] == hf["acc_norm,none"]
