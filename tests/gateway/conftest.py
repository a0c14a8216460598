"""The gateway tests' fixtures, one set per test module: the suite's Redis emptied, a
real ``kiviq worker`` with SmolLM2 as a subprocess, the gateway (uvicorn in a thread)
and the ``openai`` and ``httpx`` clients on it. Skipped where the gateway's packages are
not installed."""

from __future__ import annotations

import pytest

httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")
pytest.importorskip("uvicorn")

from gateway_common import KEY, ThreadedServer  # noqa: E402
from redis import Redis  # noqa: E402
from worker_procs import launch_worker, stop_worker  # noqa: E402

from kiviq.gateway.app import create_app  # noqa: E402


@pytest.fixture(scope="module")
def gw_redis(redis_server):
    conn = Redis.from_url(redis_server)
    conn.flushdb()
    yield redis_server
    conn.flushdb()


@pytest.fixture(scope="module")
def gw_worker(gw_redis):
    proc = launch_worker(gw_redis)
    yield proc
    stop_worker(proc)


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
