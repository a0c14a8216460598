"""The suite never writes to a Redis it did not start: a user's server, even
one named by the environment variables earlier versions read, keeps its data."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from redis import Redis

from kiviq.client.local_redis import start_redis

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.skipif(shutil.which("redis-server") is None, reason="needs a redis-server binary to play the user's")
def test_a_users_redis_keeps_its_data_through_the_suite():
    user_url, stop, _ = start_redis()  # stands for the user's server on :6379
    try:
        user = Redis.from_url(user_url.rsplit("/", 1)[0] + "/15")
        user.set("precious", "user data")
        env = dict(os.environ, REDIS_URL=user_url, KIVIQ_TEST_REDIS_URL=user_url.rsplit("/", 1)[0] + "/15")
        run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                              "tests/test_claims.py", "tests/test_top.py"],
                             cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
        assert run.returncode == 0, run.stdout[-3000:]
        assert user.get("precious") == b"user data"
        assert user.dbsize() == 1
        assert Redis.from_url(user_url).dbsize() == 0
    finally:
        stop()


def test_the_suites_server_is_its_own(redis_url):
    assert redis_url != "redis://127.0.0.1:6379/15"
    assert Redis.from_url(redis_url).info("server")["tcp_port"] != 6379
