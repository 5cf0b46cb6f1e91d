#!/usr/bin/env bash
# The doors' agreement (tests/doors): each multi-rank runner clears the results its 2-rank door
# jobs write before it runs them (`compare.sh clear DOOR...`), then compares every door's result
# found with the reference and with each other (`compare.sh DOOR...`: those doors must be there).
# Results live in $HQ_DOORS_DIR (default ${TMPDIR:-/tmp}/hq-doors).
set -euo pipefail
cd "$(dirname "$0")/../.."
export HQ_DOORS_DIR=${HQ_DOORS_DIR:-${TMPDIR:-/tmp}/hq-doors}
# pytest loads no plugin by itself: hypothesis's costs 2.7 s in each rank; these suites use none
export PYTEST_DISABLE_PLUGIN_AUTOLOAD=1
if [ "${1:-}" = clear ]; then
  shift
  for door in "$@"; do rm -f "$HQ_DOORS_DIR/$door.npz"; done
  exit 0
fi
echo "== tests/doors: the doors' results in $HQ_DOORS_DIR (this runner's: $*) =="
HQ_DOORS_REQUIRE="$*" exec "${PYTHON:-python3}" -m pytest -q -p no:cacheprovider tests/doors
