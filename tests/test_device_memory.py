"""How much device memory an engine may hold (engine.device_memory): MLX's memory
limit for the process, and the defaults sized from it, on stand-ins for a GPU of
its own, a GPU another process shares, and a CPU."""

from __future__ import annotations

import types

import mlx.core as mx
import pytest

from kiviq.engine import device_memory
from kiviq.engine.setup import default_batch_tokens

GiB = 1 << 30


class FakeMX:
    """The mlx.core calls device_memory makes, on a device of ``total`` bytes with
    ``free`` free (None: the backend reports no free memory, as MLX's CPU does)."""

    gpu, cpu = "gpu", "cpu"

    def __init__(self, total, free, held=0, device="gpu"):
        self.total, self.free, self.held, self.device = total, free, held, device
        self.limit = int(total * 0.8)  # MLX's own default on CUDA

    def device_info(self):
        info = {"total_memory": self.total}
        if self.free is not None:
            info["free_memory"] = self.free
        return info

    def default_device(self):
        return self.device

    def get_memory_limit(self):
        return self.limit

    def set_memory_limit(self, limit):
        self.limit, previous = limit, self.limit
        return previous

    def get_active_memory(self):
        return self.held

    def get_cache_memory(self):
        return 0


@pytest.fixture
def fake(monkeypatch):
    def make(**kw):
        mx_ = FakeMX(**kw)
        monkeypatch.setattr(device_memory, "mx", mx_)
        monkeypatch.setattr(device_memory, "_mlx_limit", None)
        return mx_
    return make


def test_a_gpu_of_its_own_keeps_mlxs_limit_and_the_devices_defaults(fake):
    gpu = fake(total=80 * GiB, free=79 * GiB, held=8 * GiB)
    assert device_memory.apply_memory_limit() == 64 * GiB == gpu.limit
    assert device_memory.counted_memory() == 80 * GiB
    assert device_memory.default_kv_memory() == 20 * GiB


def test_a_shared_gpu_holds_the_engine_to_what_is_free(fake):
    # Another process holds 30 GiB; this one has loaded an 8 GiB model: 42 GiB free.
    gpu = fake(total=80 * GiB, free=42 * GiB, held=8 * GiB)
    assert device_memory.apply_memory_limit() == 50 * GiB == gpu.limit
    assert device_memory.counted_memory() == int(80 * GiB * 50 / 64)  # the defaults shrink by the share
    assert device_memory.default_kv_memory() == int(80 * GiB * 50 / 64) // 4


def test_a_requested_limit_is_set_as_given(fake):
    gpu = fake(total=80 * GiB, free=79 * GiB)
    assert device_memory.apply_memory_limit(30 * GiB) == 30 * GiB == gpu.limit
    assert device_memory.counted_memory() == int(80 * GiB * 30 / 64)
    assert device_memory.apply_memory_limit(76 * GiB) == 76 * GiB  # above MLX's own: the user's choice
    assert device_memory.counted_memory() == 80 * GiB  # the defaults never count on more than the device


def test_mlxs_own_limit_is_read_once_before_kiviq_sets_one(fake):
    gpu = fake(total=80 * GiB, free=42 * GiB, held=8 * GiB)
    device_memory.apply_memory_limit()
    gpu.free = 20 * GiB  # a second engine in this process, the first one's memory held
    gpu.held = 38 * GiB
    assert device_memory.apply_memory_limit() == 58 * GiB  # min(64, 38 + 20): not min(50, ...)


def test_a_cpu_keeps_mlxs_limit_and_counts_the_hosts_ram(fake):
    cpu = fake(total=24 * GiB, free=None, device="cpu")
    before = cpu.limit
    assert device_memory.apply_memory_limit() == before == cpu.limit
    assert device_memory.counted_memory() == 24 * GiB


def test_the_default_kv_budget_is_at_most_64_gib(fake):
    fake(total=1024 * GiB, free=1000 * GiB)
    device_memory.apply_memory_limit()
    assert device_memory.default_kv_memory() == 64 * GiB


def test_the_default_step_size_counts_the_whole_device(fake):
    # A step's activations are a few GB: sized from the device's memory also where the
    # engine holds a share of it (the prefill keeps its speed).
    model = types.SimpleNamespace(args=types.SimpleNamespace(  # the Qwen3-4B shape, bf16
        hidden_size=2560, intermediate_size=9728, num_attention_heads=32, num_key_value_heads=8, head_dim=128),
        layers=[None] * 36, parameters=lambda: {"w": mx.zeros((1,), dtype=mx.bfloat16)})
    fake(total=80 * GiB, free=79 * GiB)
    device_memory.apply_memory_limit(16 * GiB)
    assert default_batch_tokens(model, on_gpu=True) == 16384
    fake(total=24 * GiB, free=23 * GiB)
    assert default_batch_tokens(model, on_gpu=True) == 4096


def test_build_engine_sets_the_configured_limit_in_mlx(smollm2):
    from kiviq.engine import build_engine

    model, tok = smollm2
    before = mx.get_memory_limit()
    try:
        engine = build_engine(model, tok, kv_memory=1 << 26, max_sequences=2, memory_limit=3 * GiB)
        assert mx.get_memory_limit() == 3 * GiB == engine.config.memory_limit
        engine = build_engine(model, tok, kv_memory=1 << 26, max_sequences=2)
        assert engine.config.memory_limit == mx.get_memory_limit()  # resolved: on this CPU, MLX's own
    finally:
        mx.set_memory_limit(before)


def test_the_worker_flag_reaches_the_config():
    from kiviq.worker.cli import UsageError, build_parser, engine_config

    assert engine_config(build_parser().parse_args(["--memory-limit", "40GiB"]), environ={}).memory_limit == 40 * GiB
    assert engine_config(build_parser().parse_args([]), environ={}).memory_limit is None
    with pytest.raises(UsageError, match="--memory-limit"):
        engine_config(build_parser().parse_args(["--memory-limit", "0"]), environ={})
