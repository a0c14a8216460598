#!/usr/bin/env bash
# Install kiviq with dev dependencies into .venv and run the test suite.
# The suite starts its own Redis server (redis-server on a free port, or the
# embedded one) and stops it at the end: it never touches a server you run.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/setup_env.sh "[dev]"
# Up to 4 worker processes (pytest-xdist), one per core: most tests wait on a model
# forward, a subprocess or Redis. Each worker starts its own Redis. "-n 0" runs serially.
exec .venv/bin/python -m pytest -n auto --maxprocesses 4 "$@"
