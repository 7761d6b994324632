#!/usr/bin/env bash
# Make a Docker daemon answer and build the sandbox test image. Safe to run again.
#   - installs Debian's docker.io when dockerd is missing (apt, needs root);
#   - starts dockerd in the background when it is not running;
#   - waits until `docker info` answers;
#   - builds tangram-sandbox-test:latest from this machine's files (no registry pull).
set -euo pipefail
cd "$(dirname "$0")/.."
IMAGE="${TANGRAM_SANDBOX_IMAGE:-tangram-sandbox-test:latest}"

if ! command -v dockerd >/dev/null 2>&1; then
    apt-get update
    DEBIAN_FRONTEND=noninteractive apt-get install -y docker.io
fi
if ! docker info >/dev/null 2>&1; then
    if ! pgrep -x dockerd >/dev/null 2>&1; then
        nohup dockerd >/tmp/dockerd.log 2>&1 &
    fi
    for _ in $(seq 1 120); do
        docker info >/dev/null 2>&1 && break
        sleep 0.5
    done
    docker info >/dev/null 2>&1 || { echo "dockerd did not come up; see /tmp/dockerd.log" >&2; exit 1; }
fi
if ! docker image inspect "$IMAGE" >/dev/null 2>&1; then
    # Into a file first: a pipe would let a failed build import half a file system.
    rootfs="$(mktemp /tmp/tangram-rootfs.XXXXXX.tar)"
    trap 'rm -f "$rootfs"' EXIT
    python3 .ci/sandbox_image.py >"$rootfs"
    docker import --change 'USER 65534:65534' --change 'WORKDIR /work' \
        --change 'ENV PATH=/usr/bin:/bin' "$rootfs" "$IMAGE" >/dev/null
fi
echo "docker ready, image $IMAGE"
