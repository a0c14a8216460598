#!/usr/bin/env bash
# Quick start: install kiviq into .venv and run the demo on embedded defaults
# (Redis from $REDIS_URL / 127.0.0.1:6379, else one it starts; SmolLM2 model).
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/setup_env.sh ""
exec .venv/bin/kiviq demo "$@"
