#!/usr/bin/env bash
# A 2-rank gloo job with a codec on a host whose own name does not resolve, as in a container
# or chroot without its name in /etc/hosts. Horovod 0.28.1 as released segfaults there (its
# process-set contexts ignore HOROVOD_GLOO_IFACE, and gloo reads the unset result of the failed
# getaddrinfo); the Horovod that scripts/install.sh builds (patch 3) must run it to identical
# weights. The job runs in a new UTS namespace with a hostname under .invalid (RFC 6761: never
# resolves), so it needs root and unshare(1); without them it says SKIP and exits 0. horovodrun
# runs through tests/horovodrun.py, as in the other runners: the same launch, its build probe
# importing torch (or reading the answers kept from the runners' earlier launches), not
# TensorFlow, which took most of this job's time on 2 cores.
set -euo pipefail
cd "$(dirname "$0")/../.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" OMP_NUM_THREADS=1
name=hq-unresolvable.invalid
if [[ $(id -u) != 0 ]] || ! unshare --uts true 2>/dev/null; then
  echo "SKIP tests/parallel/unresolved_hostname.sh: needs root and unshare --uts"
  exit 0
fi
command -v horovodrun >/dev/null || { echo "FAIL: horovodrun not on PATH"; exit 1; }
echo "== tests/parallel/unresolved_hostname.sh: 2 ranks, gloo, hostname $name =="
# shellcheck disable=SC2016  # expanded by the inner shell
unshare --uts env NAME="$name" bash -c '
  hostname "$NAME"
  if getent hosts "$NAME" >/dev/null; then echo "FAIL: $NAME resolves here"; exit 1; fi
  timeout --kill-after=30 300 python3 tests/horovodrun.py -np 2 -H localhost:2 --gloo \
    python3 tests/parallel/compressed_training.py --codec qsgd
' && exit 0
rc=$?
echo "!! tests/parallel/unresolved_hostname.sh failed (exit $rc). Ranks of an unpatched Horovod"
echo "   die here with SIGSEGV: run scripts/install.sh, which rebuilds Horovod with patch 3"
exit 1
