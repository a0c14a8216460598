"""Keeping a prefill forward's queue on the device short.

MLX's CUDA backend keeps every op's inputs alive until the device has run the op,
and the host builds a prefill forward (about a dozen ops a layer, ~10 us each) far
faster than the device runs it (~8 ms a layer at 16,384 tokens of the Qwen3-4B
shape). Built in one go, a forward had most of its layers queued at once, each
holding its activations: on an H100 a 16,384-token step of the Qwen3-4B shape peaked
22.3 GiB above the weights and the KV store; paced, it peaks at 6.8 GiB
(docs/performance.md, "What a prefill step holds").
"""

from __future__ import annotations

from collections import deque

import mlx.core as mx

# Layers a forward keeps queued on the device while the host builds the next: enough
# that the device never waits for the host (a layer's ops take the host ~0.15 ms to
# build, the device 0.5 ms at 1,024 tokens and more at longer steps).
LAYERS_AHEAD = 2


class LayerPacer:
    """Called with each layer's output as the forward is built: launches it, and
    waits until the device has run the layer ``ahead`` before it, so at most
    ``ahead + 1`` layers' activations are alive at once."""

    def __init__(self, ahead: int = LAYERS_AHEAD):
        self.ahead = ahead
        self._queued: deque[mx.array] = deque()

    def __call__(self, out: mx.array) -> mx.array:
        mx.async_eval(out)
        self._queued.append(out)
        if len(self._queued) > self.ahead:
            mx.eval(self._queued.popleft())  # already launched: this waits for it
        return out
