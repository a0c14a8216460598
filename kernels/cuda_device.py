"""Facts about the CUDA device the kernels are planned for.

MLX's `mx.device_info()` on its CUDA backend (0.32) reports the name, architecture,
compute capability and memory of the device, not its number of streaming
multiprocessors, which the split-K plan needs (`kernels.launch.split_plan`). The SM
count comes from the CUDA runtime instead (`cudaDeviceGetAttribute`), through ctypes,
once per process; the runtime library is the one MLX's CUDA build loads (the
`nvidia-cuda-runtime` wheel or the system's), and the driver API is the fallback.
"""

from __future__ import annotations

import ctypes
import functools
import glob
import os
import sys
import warnings

import mlx.core as mx

# Where no CUDA library answers: an H100 / H200 (the measured target).
FALLBACK_SMS = 132
_MULTIPROCESSOR_COUNT = 16  # cudaDevAttrMultiProcessorCount == CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT
_CUDART_NAMES = ("libcudart.so.13", "libcudart.so.12", "libcudart.so")


def cuda_available() -> bool:
    """Whether MLX has a CUDA backend on this machine."""
    try:
        return bool(mx.cuda.is_available())
    except AttributeError:
        return False


def _cudart_candidates() -> list[str]:
    """Runtime library names for the loader, then the copies inside nvidia-* wheels."""
    found = list(_CUDART_NAMES)
    for site in sys.path:
        found += sorted(glob.glob(os.path.join(site, "nvidia", "*", "lib", "libcudart.so*")), reverse=True)
    return found


def _sms_from_runtime(device: int) -> int | None:
    for name in _cudart_candidates():
        try:
            lib = ctypes.CDLL(name)
        except OSError:
            continue
        value = ctypes.c_int(0)
        if lib.cudaDeviceGetAttribute(ctypes.byref(value), _MULTIPROCESSOR_COUNT, device) == 0 and value.value > 0:
            return value.value
    return None


def _sms_from_driver(device: int) -> int | None:
    try:
        lib = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return None
    handle, value = ctypes.c_int(0), ctypes.c_int(0)
    if lib.cuInit(0) or lib.cuDeviceGet(ctypes.byref(handle), device):
        return None
    if lib.cuDeviceGetAttribute(ctypes.byref(value), _MULTIPROCESSOR_COUNT, handle) or value.value <= 0:
        return None
    return value.value


@functools.cache
def num_sms(device: int = 0) -> int:
    """Streaming multiprocessors of CUDA device `device`, read once per process.

    Returns FALLBACK_SMS, with a warning, where neither the CUDA runtime nor the
    driver library can be loaded and asked (no CUDA here: then nothing launches).
    """
    sms = _sms_from_runtime(device) or _sms_from_driver(device)
    if sms is None:
        if cuda_available():
            warnings.warn(f"could not read the SM count from libcudart or libcuda; planning for {FALLBACK_SMS}",
                          RuntimeWarning, stacklevel=2)
        return FALLBACK_SMS
    return sms
