#!/usr/bin/env bash
# The test suite as CI runs it (.ci/run): every test but the `serial` ones on two worker processes (a CI
# machine has 2 cores; most tests wait on subprocesses), then the `serial` ones alone, since they start
# engines and clusters against deadlines or compare measured speeds. Either part failing, or finding no
# test (pytest's exit code 5), fails the run.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=.venv/bin/python
"$PY" -m pytest -q -p no:cacheprovider -n "${TKCC_TEST_WORKERS:-2}" --dist loadfile -m "not serial" --durations=25
"$PY" -m pytest -q -p no:cacheprovider -m serial --durations=25
