#!/usr/bin/env bash
# Install kiviq with dev dependencies into .venv and run the test suite.
# The suite starts its own Redis server (redis-server on a free port, or the
# embedded one) and stops it at the end: it never touches a server you run.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/setup_env.sh "[dev]"
# Up to 4 worker processes (pytest-xdist), one per core: most tests wait on a model
# forward, a subprocess or Redis. Each worker starts its own Redis. "-n 0" runs serially.
# One BLAS thread per process where the processes fill the cores: OpenBLAS's spinning
# threads would compete with the other processes (tests/test_batch_engine.py at -n 2 on
# 2 cores: 217-220 s -> 184-197 s).
case " $* " in
    *" -n 0 "* | *" -n0 "*) ;;
    *) export OPENBLAS_NUM_THREADS="${OPENBLAS_NUM_THREADS:-1}" ;;
esac
exec .venv/bin/python -m pytest -n auto --maxprocesses 4 "$@"
