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


@pytest.mark.parametrize("kind", ["redis-server", "embedded"])
def test_start_redis_never_takes_a_server_that_got_its_port_first(redis_server, monkeypatch, kind):
    """A port is free when start_redis picks it, but another process (a second test
    run starting at the same moment) may bind it first: the server that answers
    there is not ours, so start_redis tries another port and leaves that one alone."""
    from kiviq.client import local_redis

    if kind == "redis-server" and shutil.which("redis-server") is None:
        pytest.skip("needs a redis-server binary")
    if kind == "embedded":
        monkeypatch.setattr(local_redis.shutil, "which", lambda _name: None)
    taken = int(redis_server.rsplit(":", 1)[1].split("/")[0])
    picks = iter([taken])
    real = local_redis.free_port
    monkeypatch.setattr(local_redis, "free_port", lambda: next(picks, None) or real())
    other = Redis.from_url(redis_server)
    other.set("theirs", "1")
    url, stop, got = start_redis()
    try:
        assert got == kind and url != redis_server
        assert int(url.rsplit(":", 1)[1].split("/")[0]) != taken
        Redis.from_url(url).set("ours", "1")
        assert other.get("theirs") == b"1" and other.get("ours") is None
    finally:
        stop()
        other.delete("theirs")
