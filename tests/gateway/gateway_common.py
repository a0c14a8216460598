"""What the gateway tests share besides their fixtures (tests/gateway/conftest.py): the
constants of their requests, a free port, uvicorn serving an app in a thread, and the
check of an OpenAI-shaped error."""

from __future__ import annotations

import socket
import threading
import time
from pathlib import Path

import uvicorn

ROOT = Path(__file__).resolve().parents[2]
KEY = "sk-test-gateway"
MODEL = "SmolLM2-135M-Instruct"
MAX_TOKENS = 12
MESSAGES = [{"role": "user", "content": "What is the capital of France?"}]
PROMPT = "The three primary colors are"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ThreadedServer:
    """uvicorn serving an app in a thread, on a free port."""

    def __init__(self, app):
        self.port = free_port()
        config = uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning", lifespan="on")
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            assert time.monotonic() < deadline and self.thread.is_alive(), "gateway did not start"
            time.sleep(0.05)
        self.base = f"http://127.0.0.1:{self.port}"

    def stop(self):
        self.server.should_exit = True
        self.thread.join(timeout=30)


def assert_openai_error(response, status: int, param: str | None = None):
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["message"] and "Traceback" not in error["message"]
    if param is not None:
        assert error["param"] == param, error
    return error
