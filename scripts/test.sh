#!/usr/bin/env bash
# Install kiviq with dev dependencies into .venv and run the test suite
# against a real Redis (started here if none answers on 127.0.0.1:6379).
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/setup_env.sh "[dev]"
if ! .venv/bin/python -c 'import redis,sys; redis.Redis(socket_connect_timeout=1).ping()' 2>/dev/null; then
    if command -v redis-server >/dev/null; then
        redis-server --daemonize yes --bind 127.0.0.1 --port 6379 --save "" --appendonly no \
            --dir "${TMPDIR:-/tmp}" --logfile "${TMPDIR:-/tmp}/kiviq-test-redis.log"
        for _ in $(seq 50); do
            .venv/bin/python -c 'import redis; redis.Redis().ping()' 2>/dev/null && break
            sleep 0.1
        done
    else
        echo "no Redis answers on 127.0.0.1:6379 and no redis-server binary: install redis" >&2
        exit 1
    fi
fi
exec .venv/bin/python -m pytest "$@"
