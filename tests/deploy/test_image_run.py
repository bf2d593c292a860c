"""The CPU image built and run with podman: one server, two replicas sharing Redis, and
the Helm chart's pods played with `podman kube play`.

The image is built once per session by `make image`'s script (a rebuild with cached
layers takes seconds). The first server start pulls the default model into a volume that
the later containers reuse; everything is removed at the end.
"""

from __future__ import annotations

import json
import re
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import yaml
from openai.types.chat import ChatCompletionMessageParam

from runtime.native.kernels import host_levels
from tests.deploy import podman as pm
from tests.deploy.conftest import CHART, REPO, load_manifests, require_tool

RELEASE = "play"

# a cold first test builds the image (base images included) and pulls the model
pytestmark = pytest.mark.timeout(3600)

# What `podman kube play` (4.3) runs of the chart, and what it cannot: those kinds stay
# checked by helm, kubernetes-validate and tests/deploy/test_helm_chart.py. A Secret plays,
# but 4.3 cannot read it back into a secretKeyRef variable ("secret ... is not valid JSON"),
# so the chart is played without API keys, and with them only rendered.
PLAYED_KINDS = {"Deployment", "ConfigMap", "PersistentVolumeClaim"}
NOT_PLAYED_KINDS = {"Secret", "Service", "ServiceAccount", "HorizontalPodAutoscaler",
                    "NetworkPolicy", "PodDisruptionBudget", "ServiceMonitor"}

CHAT: list[ChatCompletionMessageParam] = [{"role": "user", "content": "Name three colours."}]


@pytest.fixture(scope="session")
def image() -> str:
    pm.build_image()
    return pm.IMAGE


@pytest.fixture(scope="session")
def pip_mounts(tmp_path_factory: pytest.TempPathFactory) -> list[tuple[str, str]]:
    return pm.pip_passthrough(tmp_path_factory.mktemp("pip"))


@pytest.fixture(scope="session")
def home(image: str) -> Iterator[str]:
    """The model volume: the first server pulls the default model into it."""
    name = pm.unique("home")
    pm.podman("volume", "create", name)
    yield name
    pm.podman("volume", "rm", "-f", name, check=False)


@pytest.fixture(scope="module")
def server(home: str, pip_mounts: list[tuple[str, str]]) -> Iterator[pm.Server]:
    """One container as `docker run` starts it: a first start, so it pulls the model."""
    name = pm.unique("server")
    try:
        started = pm.run_server(name, home=home, mounts=pip_mounts,
                                options=["--read-only", "--tmpfs", "/tmp", "--cap-drop", "ALL"])
        pm.wait_ready(started)
        yield started
    finally:
        pm.remove(name)


# ---------------------------------------------------------------------------- the image


def test_image_config(image: str) -> None:
    config = json.loads(pm.podman("image", "inspect", image).stdout)[0]
    assert config["Config"]["User"] == "10001:10001"
    healthcheck = config.get("Healthcheck") or {}  # kept by the Docker format
    assert "/opt/specserve/healthcheck.py" in healthcheck.get("Test", []), healthcheck
    size_gb = config["Size"] / 1e9
    print(f"\n{image}: {size_gb:.2f} GB")
    assert size_gb < 2.5  # CPU torch and the kernels; no compiler, no CUDA


def test_image_holds_every_kernel_level_and_no_sources(image: str) -> None:
    listing = pm.podman("run", "--rm", "--network", "none", "--entrypoint", "sh", image, "-c",
                        "find /opt/specserve/kernels -name '*.so'; ls -a /; "
                        "command -v g++ || echo no-compiler").stdout
    for level in ("default", "avx2", "avx512", "avx512_vnni"):
        assert f"specserve_kernels_{level}.so" in listing
    assert "no-compiler" in listing
    assert ".git" not in listing.split() and "src" not in listing.split()


# ---------------------------------------------------------------------------- one server


def test_ready_and_streamed_chat(server: pm.Server) -> None:
    assert httpx.get(f"{server.url}/ready", timeout=10).status_code == 200
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none")
    stream = client.chat.completions.create(model="default", messages=CHAT, max_tokens=24,
                                            temperature=0, stream=True)
    deltas, finish = [], None
    for chunk in stream:
        if chunk.choices:
            deltas.append(chunk.choices[0].delta.content or "")
            finish = chunk.choices[0].finish_reason or finish
    assert len([d for d in deltas if d]) >= 2, deltas  # streamed, not one block
    assert "".join(deltas).strip()
    assert finish in {"stop", "length"}


def test_kernels_use_the_hosts_best_level(server: pm.Server) -> None:
    """The image holds every level; the container loads this CPU's best one."""
    models = httpx.get(f"{server.url}/v1/models", timeout=10).json()["data"]
    kernels = {m["id"]: m["metadata"]["kernels"] for m in models}
    print(f"\n/v1/models kernels: {kernels}")
    assert set(kernels.values()) == {f"native-{host_levels()[-1]}"}


def test_runs_as_non_root(server: pm.Server) -> None:
    status = pm.podman("exec", server.name, "cat", "/proc/1/status").stdout
    uids = re.search(r"^Uid:\s+(\d+)\s+(\d+)", status, re.M)
    assert uids is not None and uids.groups() == ("10001", "10001")
    assert "specserve" in pm.podman("exec", server.name, "cat", "/proc/1/cmdline").stdout


def test_healthcheck_answers(server: pm.Server) -> None:
    result = pm.podman("healthcheck", "run", server.name, check=False)
    assert result.returncode == 0, result.stdout + result.stderr
    health = pm.inspect(server.name)["State"]["Health"]
    assert health["Status"] == "healthy", health


def test_sigterm_drains_the_stream(server: pm.Server) -> None:
    """SIGTERM while a stream runs: the stream still ends normally, the server exits 0.
    (Last in the module: it stops the server.)"""
    chunks: list[dict[str, Any]] = []
    after_signal = threading.Event()
    after_count: list[int] = []
    done = False

    def stream() -> None:
        nonlocal done
        body = {"model": "default", "messages": [{"role": "user", "content":
                "Write the numbers from 1 to 300, one per line."}],
                "max_tokens": 300, "temperature": 0, "stream": True}
        with httpx.stream("POST", f"{server.url}/v1/chat/completions", json=body,
                          timeout=120) as response:
            for line in response.iter_lines():
                if line == "data: [DONE]":
                    done = True
                elif line.startswith("data: "):
                    chunks.append(json.loads(line[6:]))
                    if after_signal.is_set():
                        after_count.append(1)

    reader = threading.Thread(target=stream)
    reader.start()
    deadline = time.monotonic() + 60
    while len(chunks) < 3 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert len(chunks) >= 3, "the stream did not start"
    pm.podman("kill", "--signal", "TERM", server.name)
    after_signal.set()
    reader.join(timeout=120)
    assert not reader.is_alive()
    assert done, "the stream was cut, not drained"
    assert after_count, "no chunk came after SIGTERM"
    assert chunks[-1]["choices"][0]["finish_reason"] in {"stop", "length"}
    code = pm.podman("wait", server.name, timeout=120).stdout.strip()
    assert code == "0", pm.logs(server.name)


# ---------------------------------------------------------------------------- two replicas


def _compose_service(name: str) -> dict[str, Any]:
    compose = yaml.safe_load((REPO / "docker-compose.yml").read_text())
    return compose["services"][name]


def _replica_options(service: dict[str, Any]) -> tuple[dict[str, str], list[str]]:
    """docker-compose.yml's specserve service as podman run settings (environment,
    read-only root, tmpfs, dropped capabilities, security options); the tracing endpoint
    is left out, since this stack has no Jaeger."""
    env = {k: str(v) for k, v in service["environment"].items()
           if v is not None and not k.startswith("OTEL_EXPORTER")}
    options: list[str] = []
    if service.get("read_only"):
        options.append("--read-only")
    for path in service.get("tmpfs", []):
        options += ["--tmpfs", path]
    for cap in service.get("cap_drop", []):
        options += ["--cap-drop", cap]
    for opt in service.get("security_opt", []):
        options += ["--security-opt", opt]
    return env, options


def _long_prompt(topic: str, tokens_wanted: int = 2000) -> str:
    """About tokens_wanted tokens of distinct text (about 19 tokens a line)."""
    lines = [f"Note {i} on {topic}: entry {i * 7 % 101} follows entry {i * 13 % 97}."
             for i in range(tokens_wanted // 19)]
    return "\n".join(lines) + "\nSummarise the notes in one sentence."


def _ttft(url: str, prompt: str) -> tuple[float, str, int]:
    """Time to the first content token of a streamed chat completion, the text, and the
    prompt's token count."""
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", timeout=600)
    start = time.perf_counter()
    first = None
    text = []
    usage = 0
    stream = client.chat.completions.create(
        model="default", messages=[{"role": "user", "content": prompt}], max_tokens=8,
        temperature=0, stream=True, stream_options={"include_usage": True})
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            first = first or time.perf_counter()
            text.append(chunk.choices[0].delta.content)
        if chunk.usage:
            usage = chunk.usage.prompt_tokens
    assert first is not None
    return first - start, "".join(text), usage


def _hit_tokens(metrics_url: str) -> float:
    text = httpx.get(f"{metrics_url}/metrics", timeout=10).text
    return sum(float(v) for v in re.findall(
        r"^specserve_prefix_cache_hit_tokens_total(?:\{[^}]*\})?\s+(\S+)", text, re.M))


def _wait_redis_settled(redis: str, at_least: int, timeout: float = 120) -> int:
    """Redis's key count once it holds at_least keys and stops growing (writes are
    queued in the background)."""
    deadline = time.monotonic() + timeout
    last = -1
    while time.monotonic() < deadline:
        count = int(pm.podman("exec", redis, "redis-cli", "dbsize").stdout.strip())
        if count >= at_least and count == last:
            return count
        last = count
        time.sleep(1)
    pytest.fail(f"Redis holds {last} keys, expected at least {at_least}", pytrace=False)


@pytest.fixture(scope="module")
def redis_image() -> str:
    pm.make_redis_image()
    return pm.REDIS_IMAGE


def test_two_replicas_share_a_prefix_through_redis(
        server: pm.Server, home: str, pip_mounts: list[tuple[str, str]],
        redis_image: str) -> None:
    network, redis = pm.unique("net"), pm.unique("redis")
    replicas = [pm.unique("replica-a"), pm.unique("replica-b")]
    env, options = _replica_options(_compose_service("specserve"))
    env["SPECSERVE_REDIS_URL"] = f"redis://{redis}:6379/0"
    redis_command = _compose_service("redis")["command"]
    pm.podman("network", "create", network)
    try:
        pm.podman("run", "-d", "--name", redis, "--network", network, redis_image,
                  *redis_command)
        a, b = (pm.run_server(name, home=home, mounts=pip_mounts, env=env, network=network,
                              options=options) for name in replicas)
        for replica in (a, b):
            pm.wait_ready(replica)
            # the replicas find Redis by its container name: the network's DNS must answer
            cache = httpx.get(f"{replica.url}/ready", timeout=10).json()["prefix_cache"]
            assert cache["store"] == "redis" and cache["reachable"], (
                f"{replica.name} cannot reach Redis as {redis!r} on network {network}: "
                f"{cache['error']} (podman resolves container names through its network "
                "backend's DNS plugin, which `make system-deps` installs)")
            _ttft(replica.url, "Hello")  # the first request's one-off costs

        shared, other = _long_prompt("harbours"), _long_prompt("orchards")
        a_uncached, a_text, prompt_tokens = _ttft(a.url, shared)
        blocks = prompt_tokens // 64
        keys = _wait_redis_settled(redis, at_least=blocks)
        b_uncached, _, other_tokens = _ttft(b.url, other)
        hits_before = _hit_tokens(b.metrics_url)
        b_cached, b_text, _ = _ttft(b.url, shared)
        hit = _hit_tokens(b.metrics_url) - hits_before
        print(f"\nprompt {prompt_tokens} tokens ({keys} Redis keys): replica A uncached TTFT "
              f"{a_uncached:.2f} s; replica B uncached {b_uncached:.2f} s ({other_tokens} "
              f"tokens), cached from A through Redis {b_cached:.2f} s ({hit:.0f} tokens hit)")
        assert 1800 <= prompt_tokens <= 2300
        assert hit >= blocks * 64 - 64  # all full blocks but possibly the last
        assert b_text == a_text  # the same greedy answer from A's KV
        assert b_cached < 0.7 * b_uncached
    finally:
        pm.remove(*replicas, redis)
        pm.podman("network", "rm", "-f", network, check=False)


# ---------------------------------------------------------------------------- the chart


def _chart_manifests(pip_mounts: list[tuple[str, str]]) -> list[dict[str, Any]]:
    """helm template with the local image and a model PVC, with two changes for podman:
    the pip setup handed to the model-pull init container (as to the image build), and
    restartPolicy OnFailure, since podman 4.3 restarts a finished init container under
    the Deployment's Always and then fails to remove it."""
    helm = require_tool("helm")
    rendered = subprocess.run(
        [helm, "template", RELEASE, str(CHART), "--set", "image.repository=localhost/specserve",
         "--set", "image.tag=0.1.0", "--set", "image.pullPolicy=Never",
         "--set", "model.persistence.enabled=true"],
        capture_output=True, text=True, check=True, timeout=60).stdout
    manifests = load_manifests(rendered)
    kinds = {m["kind"] for m in manifests}
    assert kinds >= PLAYED_KINDS, kinds
    assert kinds - PLAYED_KINDS <= NOT_PLAYED_KINDS, kinds - PLAYED_KINDS
    played = [m for m in manifests if m["kind"] in PLAYED_KINDS]
    (deployment,) = [m for m in played if m["kind"] == "Deployment"]
    pod = deployment["spec"]["template"]["spec"]
    pod["restartPolicy"] = "OnFailure"
    (init,) = pod["initContainers"]
    for i, (host, inside) in enumerate(pip_mounts):
        volume = f"pip-{i}"
        pod["volumes"].append({"name": volume, "hostPath": {"path": host}})
        init["volumeMounts"].append({"name": volume, "mountPath": inside, "readOnly": True})
    return played


def _pod_address(pod: str) -> str:
    infra = json.loads(pm.podman("pod", "inspect", pod).stdout)["InfraContainerID"]
    networks = pm.inspect(infra)["NetworkSettings"]["Networks"]
    (address,) = [n["IPAddress"] for n in networks.values() if n["IPAddress"]]
    return address


def test_chart_pods_play(image: str, pip_mounts: list[tuple[str, str]],
                         tmp_path: Path) -> None:
    manifests = _chart_manifests(pip_mounts)
    (deployment,) = [m for m in manifests if m["kind"] == "Deployment"]
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    ready_path = container["readinessProbe"]["httpGet"]["path"]
    live_path = container["livenessProbe"]["httpGet"]["path"]
    kube = tmp_path / "chart.yaml"
    kube.write_text(yaml.safe_dump_all(manifests))
    played = pm.podman("kube", "play", str(kube), timeout=600)
    pods = re.findall(r"^Pod:\n([0-9a-f]{64})", played.stdout, re.M)
    assert len(pods) == 1, played.stdout
    try:
        containers = json.loads(pm.podman("ps", "-a", "--filter", f"pod={pods[0]}",
                                          "--format", "json").stdout)
        (server_name,) = [name for c in containers for name in c["Names"]
                          if name.endswith("-specserve")]
        url = f"http://{_pod_address(pods[0])}:8000"
        seen = pm.wait_url_ready(url, server_name)
        print(f"\nplayed {sorted({m['kind'] for m in manifests})}; pod ready after "
              f"{len(seen)} polls; readiness {ready_path}, liveness {live_path}")
        # the readiness path is what tells "cannot serve yet" from "serves": while the
        # model loads, the liveness path answers and the readiness path does not
        assert ready_path == "/ready" and live_path != ready_path
        assert (200, 503) in seen, seen
        body = {"model": "default", "messages": CHAT, "max_tokens": 8}
        answer = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=120)
        assert answer.status_code == 200, answer.text
        assert answer.json()["choices"][0]["message"]["content"]
    finally:
        pm.podman("kube", "down", str(kube), check=False, timeout=300)
        pm.podman("volume", "rm", "-f", f"{RELEASE}-specserve-models", check=False)

