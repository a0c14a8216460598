"""benchmarks/kernel_attend.py's copy reference and targets, on any machine: a small
copy (MLX's CPU backend here), with the device trace stood in for where it needs a GPU."""

from __future__ import annotations

import numpy as np

from benchmarks import kernel_attend


def test_the_copy_reference_is_per_call_and_in_device_time(monkeypatch):
    n = 2**16
    traced = []

    def device_times(variants, inputs, repeats, calls=16):
        traced.append((list(variants), len(inputs), calls))
        return {"copy": [2e-6, 1e-6, 3e-6]}, {}

    monkeypatch.setattr(kernel_attend, "device_times", device_times)
    per_call, times, device = kernel_attend.copy_bandwidth(2, device_time=True, n=n)
    assert device == 4 * n / 2e-6  # read + write of n fp16 values over the median device time
    assert per_call == 4 * n / float(np.median(times)) and len(times) == 2
    assert traced == [(["copy"], 3, 4)]
    assert kernel_attend.copy_bandwidth(1, n=n)[2] is None and len(traced) == 1  # no trace unless asked


def test_the_2bit_targets_name_issue_23s_shapes():
    results = [dict(b=32, s=8192, bits=2, pct=0.7, pct_device=0.82, ok=True, x_sdpa=3.0, x_sdpa_device=3.1,
                    x_deq=None),
               dict(b=64, s=16384, bits=4, pct=0.9, ok=True, x_sdpa=2.0, x_deq=None)]
    lines = kernel_attend.targets(results)
    assert "- >=80% of copy BW at B=32 S=8192 2-bit: 70% MISSED" in lines
    assert "- >=80% of copy BW at B=32 S=8192 2-bit (device time): 82% MET" in lines
    assert not any("80%" in line and "S=16384" in line for line in lines)  # 4-bit there
