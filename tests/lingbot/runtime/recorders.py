"""Recorders of what a real chunk holds and passes, for the budget and kernel tests (CPU, no CUDA needed)."""
from __future__ import annotations

from torch import Tensor


def tensors_in(value) -> list[Tensor]:
    """The tensors in a nest of tuples and lists."""
    if isinstance(value, Tensor):
        return [value]
    if isinstance(value, (tuple, list)):
        return [t for item in value for t in tensors_in(item)]
    return []


def extent_bytes(t: Tensor) -> int:
    """Bytes a tensor's view spans: what `empty_strided(t.size(), t.stride())` allocates (CUDA graph trees'
    static copy of an input)."""
    if t.numel() == 0:
        return 0
    return (sum((n - 1) * s for n, s in zip(t.shape, t.stride())) + 1) * t.element_size()


class GraphInputs:
    """The bytes CUDA graph trees would give static buffers in one DiT forward, read from the calls of the
    compiled regions of a real (eager) forward: every tensor argument of `attention_inputs` and
    `attention_output` that is not the output of an earlier region call of the same forward (parameters are
    reached through the module, not passed). Records the forward that runs while `armed`."""

    def __init__(self, model):
        self.armed = False
        self.recording = False
        self.bytes = 0
        self.calls = 0
        self._outputs: set[int] = set()
        self._kept: list = []              # outputs stay alive: no later tensor reuses their address
        model.register_forward_pre_hook(self._begin)
        model.register_forward_hook(self._end)
        for block in model.blocks:
            for name in ("attention_inputs", "attention_output"):
                setattr(block, name, self._wrap(getattr(block, name)))

    def _begin(self, module, args):
        self.recording, self.armed = self.armed, False

    def _end(self, module, args, output):
        self.recording = False
        self._kept.clear()

    def _wrap(self, region):
        def call(*args):
            if self.recording:
                self.calls += 1
                self.bytes += sum(extent_bytes(t) for t in tensors_in(args)
                                  if t.untyped_storage().data_ptr() not in self._outputs)
            out = region(*args)
            if self.recording:
                self._kept.append(out)
                self._outputs.update(t.untyped_storage().data_ptr() for t in tensors_in(out))
            return out
        return call


class ChunkTransient:
    """The bytes of the camera modulation each chunk prepares (`prepare_chunk`), per chunk."""

    def __init__(self, model):
        self.bytes: list[int] = []
        prepare = model.prepare_chunk

        def call(*args, **kwargs):
            chunk = prepare(*args, **kwargs)
            self.bytes.append(sum(t.numel() * t.element_size() for t in tensors_in(chunk.camera_modulation)))
            return chunk
        model.prepare_chunk = call


class KernelLayouts:
    """(shape, stride, dtype) of q, k, v as layer 0's window attention hands them to its kernel, per call."""

    def __init__(self, attention):
        self.calls: list[tuple] = []
        kernel = attention.attend

        def attend(q, k, v):
            self.calls.append(layout(q, k, v))
            return kernel(q, k, v)
        attention.attend = attend


def layout(*tensors: Tensor) -> tuple:
    return tuple((tuple(t.shape), t.stride(), t.dtype) for t in tensors)

