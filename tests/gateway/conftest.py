"""The gateway tests' fixtures, one set per test module: the suite's Redis emptied, a
real ``kiviq worker`` with SmolLM2 as a subprocess, the gateway (uvicorn in a thread)
and the ``openai`` and ``httpx`` clients on it. Skipped where the gateway's packages are
not installed."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")
pytest.importorskip("uvicorn")

from gateway_common import KEY, ROOT, ThreadedServer  # noqa: E402
from redis import Redis  # noqa: E402

from kiviq.gateway.app import create_app  # noqa: E402


@pytest.fixture(scope="module")
def gw_redis(redis_server):
    conn = Redis.from_url(redis_server)
    conn.flushdb()
    yield redis_server
    conn.flushdb()


@pytest.fixture(scope="module")
def gw_worker(gw_redis):
    from rq import Worker

    log_path = Path(os.environ.get("PYTEST_TMPDIR", "/tmp")) / f"kiviq-gw-worker-{os.getpid()}.log"
    log_file = open(log_path, "w")
    env = dict(os.environ, PYTHONPATH=str(ROOT), PYTHONUNBUFFERED="1")
    proc = subprocess.Popen([sys.executable, "-m", "kiviq.worker", "--redis-url", gw_redis], cwd=ROOT, env=env,
                            stdout=log_file, stderr=subprocess.STDOUT)
    conn = Redis.from_url(gw_redis)
    deadline = time.monotonic() + 180
    while not Worker.count(connection=conn):
        if proc.poll() is not None or time.monotonic() > deadline:
            pytest.fail(f"worker did not start:\n{log_path.read_text()[-4000:]}")
        time.sleep(0.2)
    yield proc
    proc.terminate()
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
    log_file.close()


@pytest.fixture(scope="module")
def gateway(gw_redis, gw_worker, tmp_path_factory):
    server = ThreadedServer(create_app(gw_redis, [KEY, "sk-second"], files_dir=str(tmp_path_factory.mktemp("gw-files")),
                                batch_max_in_flight=2))
    yield server
    server.stop()


@pytest.fixture(scope="module")
def oai(gateway):
    return openai.OpenAI(base_url=gateway.base + "/v1", api_key=KEY, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def http(gateway):
    with httpx.Client(base_url=gateway.base, headers={"Authorization": f"Bearer {KEY}"}, timeout=120) as c:
        yield c
