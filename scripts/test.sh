#!/usr/bin/env bash
# Install kiviq with dev dependencies into .venv and run the test suite.
# The suite starts its own Redis server (redis-server on a free port, or the
# embedded one) and stops it at the end: it never touches a server you run.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/setup_env.sh "[dev]"
exec .venv/bin/python -m pytest "$@"
