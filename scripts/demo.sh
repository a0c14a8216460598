#!/usr/bin/env bash
# Quick start: install kiviq into .venv and run the demo on embedded defaults
# (a Redis it starts, or the one $REDIS_URL names; SmolLM2 model).
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/setup_env.sh ""
exec .venv/bin/kiviq demo "$@"
