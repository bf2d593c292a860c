#!/bin/sh
# Container entry point.
#
# With no arguments, or only options, it makes sure the target model is on disk
# and then replaces itself with `specserve serve [options]`, so the server is PID 1
# and receives SIGTERM directly (graceful drain, exit 0).
#   - SPECSERVE_TARGET=default (the default): the default model must be complete in
#     $SPECSERVE_HOME/models. If it is not, a copy baked into the image (build arg
#     BAKE_MODEL=true) is linked in, or else `specserve models pull` fetches it.
#   - SPECSERVE_PULL_MODEL=never turns the pull off (fail instead), for clusters
#     where an init container or a pre-filled volume provides the model.
# Any other command (`specserve models pull`, `bash`, ...) is run as given.
set -eu

DEFAULT_MODEL=SmolLM2-135M-Instruct  # runtime.files.model_store.DEFAULT_MODEL
COMPLETE_MARKER=.complete            # runtime.files.model_store.COMPLETE_MARKER

home=${SPECSERVE_HOME:-${HOME:-/tmp}/.cache/specserve}
target=${SPECSERVE_TARGET:-default}
pull=${SPECSERVE_PULL_MODEL:-if-missing}
baked=${SPECSERVE_BAKED_HOME:-/opt/specserve}

log() {
    echo "docker-entrypoint: $*" >&2
}

is_default_model() {
    case "$1" in
        default | "$DEFAULT_MODEL" | smollm2-135m-instruct | smollm2-135m) return 0 ;;
        *) return 1 ;;
    esac
}

ensure_default_model() {
    dir="$home/models/$DEFAULT_MODEL"
    if [ -f "$dir/$COMPLETE_MARKER" ]; then
        return 0
    fi
    if [ -L "$dir" ]; then
        rm -f "$dir"  # a link to a baked copy that this image does not have
    fi
    if [ -f "$baked/models/$DEFAULT_MODEL/$COMPLETE_MARKER" ]; then
        log "using the default model baked into the image"
        mkdir -p "$home/models"
        ln -s "$baked/models/$DEFAULT_MODEL" "$dir"
        return 0
    fi
    case "$pull" in
        never)
            log "the default model is not in $dir and SPECSERVE_PULL_MODEL=never"
            exit 1
            ;;
        if-missing) ;;
        *)
            log "SPECSERVE_PULL_MODEL must be 'if-missing' or 'never', not '$pull'"
            exit 2
            ;;
    esac
    log "the default model is not in $dir; pulling it"
    specserve models pull
}

if [ "${1:-}" = serve ]; then
    shift
fi
case "${1:-}" in
    "" | -*) ;;
    *) exec "$@" ;;
esac

if is_default_model "$target"; then
    ensure_default_model
fi
exec specserve serve "$@"
