#!/usr/bin/env bash
# Runs a shell command in a fresh container of an image, then removes the container:
#
#   bash scripts/image_run.sh horovod_quant:cpu 'bash tests/parallel/run.sh'
#
# With docker (a daemon answering) it is `docker run --rm`; otherwise `buildah from` +
# `buildah run --isolation chroot` (podman run needs a runtime that may set RLIMIT_NOFILE, which
# some sandboxes refuse; buildah's chroot isolation does not). HQ_IMAGE_TOOL=docker|buildah
# chooses. The command runs in /opt/horovod_quant with the image's environment.
set -euo pipefail
(($# == 2)) || { echo "usage: $0 IMAGE COMMAND" >&2; exit 2; }
image=$1 command=$2
tool=${HQ_IMAGE_TOOL:-}
if [[ -z $tool ]]; then
  if command -v docker >/dev/null && docker info >/dev/null 2>&1; then tool=docker
  elif command -v buildah >/dev/null; then tool=buildah
  else echo "no docker daemon and no buildah: install one (apt-get install buildah)" >&2; exit 2
  fi
fi
case $tool in
  docker) exec docker run --rm --ipc=host "$image" bash -c "$command" ;;
  buildah)
    ctr=$(buildah from "$image")
    trap 'buildah rm "$ctr" >/dev/null' EXIT
    buildah run --isolation chroot "$ctr" -- bash -c "$command" ;;
  *) echo "HQ_IMAGE_TOOL=$tool: docker or buildah" >&2; exit 2 ;;
esac
