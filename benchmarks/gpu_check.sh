#!/bin/sh
# The GPU check as the lent GPU machine runs it, from the checkout's root (that machine has torch, transformers and
# the other dependencies, no lm-eval, no mteb, and no network):
#
#     sh benchmarks/gpu_check.sh --out "$OUT/gpu_check.json"
#
# It installs this checkout without dependencies into a scratch folder first: the built-in plugins live in
# plugins/ and install as repgeom_eval.plugins, so the checkout's own repgeom_eval folder alone registers none.
# PYTHON (default python3) and REPGEOM_CHECK_SITE (default /tmp/repgeom-site) may be set; tests/test_gpu_check_script.py
# runs this file with --device cpu --quick.
set -eu
PYTHON=${PYTHON:-python3}
SITE=${REPGEOM_CHECK_SITE:-/tmp/repgeom-site}
# shellcheck disable=SC2086 # PYTHON may carry flags (the test passes -S)
$PYTHON -m pip install -q --no-deps --no-build-isolation --no-index --no-compile --upgrade --target "$SITE" .
SCRIPT=benchmarks/gpu_check.py
if [ "${1:-}" = "--profile" ]; then SCRIPT=benchmarks/gpu_profile.py; shift; fi  # where the time goes, instead
PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 exec $PYTHON $SCRIPT "$@"
