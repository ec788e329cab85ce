"""The session path (a session's start and its chunks) moves host data to its device only through
lingbot.transfer.to_device (pinned memory, non_blocking): on CUDA any other host-to-device copy makes
the host wait for the whole device queue.

On the CPU there is no second device to see, so `HostCopies` follows host data instead. While active, a
TorchFunctionMode marks every tensor born on the host - from numpy, lists or numbers, or by a factory given
no device - and every tensor computed from host tensors only. It records each place host data reaches
the device: `.to(device)` / `.cuda()` of a host tensor, a factory given host data and a device
(torch.tensor / as_tensor / asarray, Tensor.new_tensor), a `copy_` from a host tensor into a device
tensor, an op that mixes a non-scalar host tensor with device tensors (on CUDA an implicit copy or an
error; 0-dim host tensors are read as numbers, no copy), and indexing a device tensor with a list or an
array. Tensors that existed before (weights, caches) count as the device's. Each record says whether
`to_device` made it.
"""
from __future__ import annotations

import sys
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_leaves

from lingbot.camera import CameraEvent, Controls
from lingbot.transfer import to_device

HOST = "_lingbot_host_born"                 # attribute on the tensors the recorder saw born on the host
FACTORIES_WITH_DATA = {torch.tensor, torch.as_tensor, torch.asarray}


def is_host(x) -> bool:
    return isinstance(x, Tensor) and getattr(x, HOST, False)


def _mark(out, host: bool) -> None:
    for t in tree_leaves(out):
        if isinstance(t, Tensor):
            setattr(t, HOST, host)


def _host_data(x) -> bool:
    """Data a copy would have to bring from the host: arrays, lists, numbers, host tensors."""
    return is_host(x) or (not isinstance(x, Tensor) and isinstance(x, (np.ndarray, np.generic, list, tuple,
                                                                        int, float, bool)))


def _moves(args, kwargs) -> bool:
    """Whether Tensor.to's arguments name a device (or a tensor to follow), not only a dtype."""
    return kwargs.get("device") is not None or any(isinstance(a, (torch.device, str, int, Tensor))
                                                   and not isinstance(a, bool) for a in args[1:])


@dataclass
class Copy:
    what: str
    by_helper: bool


class HostCopies(TorchFunctionMode):
    """Records host-to-device copies (see the module docstring); `.outside` are those not made by to_device."""

    def __init__(self):
        super().__init__()
        self.copies: list[Copy] = []

    @property
    def outside(self) -> list[Copy]:
        return [c for c in self.copies if not c.by_helper]

    @property
    def by_helper(self) -> list[Copy]:
        return [c for c in self.copies if c.by_helper]

    def _record(self, func, detail: str) -> None:
        frame, helper = sys._getframe(), to_device.__code__
        inside = False
        while frame is not None and not inside:
            inside = frame.f_code is helper
            frame = frame.f_back
        caller = sys._getframe(2)
        self.copies.append(Copy(f"{getattr(func, '__name__', func)}: {detail} "
                                f"({caller.f_code.co_filename.rsplit('/', 1)[-1]}:{caller.f_lineno})", inside))

    def __enter__(self):
        # from_numpy / frombuffer do not reach torch-function modes: wrap them so their tensors are marked
        self._saved = torch.from_numpy, torch.frombuffer
        originals = self._saved

        def host_born(original):
            def made(*args, **kwargs):
                out = original(*args, **kwargs)
                setattr(out, HOST, True)
                return out
            return made
        torch.from_numpy, torch.frombuffer = (host_born(f) for f in originals)
        return super().__enter__()

    def __exit__(self, *exc):
        torch.from_numpy, torch.frombuffer = self._saved
        return super().__exit__(*exc)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        tensors = [t for t in tree_leaves((args, kwargs)) if isinstance(t, Tensor)]
        host = [t for t in tensors if is_host(t)]
        if func in FACTORIES_WITH_DATA:
            onto_device = kwargs.get("device") is not None or any(isinstance(a, torch.device) for a in args[1:])
            if onto_device and _host_data(args[0]):
                self._record(func, f"host data {type(args[0]).__name__} with device={kwargs.get('device')}")
            _mark(out, host=not onto_device and (not isinstance(args[0], Tensor) or is_host(args[0])))
        elif func is Tensor.cuda or (func is Tensor.to and _moves(args, kwargs)):
            if is_host(args[0]):
                self._record(func, f"host tensor {tuple(args[0].shape)} to the device")
            _mark(out, host=False)
        elif func is Tensor.new_tensor:
            if not is_host(args[0]) and _host_data(args[1]):
                self._record(func, f"host data {type(args[1]).__name__} on a device tensor's device")
            _mark(out, host=is_host(args[0]))
        elif func is Tensor.copy_:
            if is_host(args[1]) and not is_host(args[0]):
                self._record(func, f"host tensor {tuple(args[1].shape)} into a device tensor")
        elif func in (Tensor.__getitem__, Tensor.__setitem__) and not is_host(args[0]) and any(
                isinstance(i, (list, np.ndarray)) for i in (args[1] if isinstance(args[1], tuple) else (args[1],))):
            self._record(func, "a list or array index on a device tensor")
        elif func is Tensor.__setitem__ and not is_host(args[0]) and isinstance(args[2], (list, np.ndarray)):
            self._record(func, f"a {type(args[2]).__name__} value into a device tensor")
        elif not tensors:                                   # a factory: on the host unless given a device
            _mark(out, host=kwargs.get("device") is None)
        elif host and len(host) < len(tensors) and any(t.dim() > 0 for t in host):
            self._record(func, f"host tensor {tuple(host[0].shape)} with device tensors")
        elif host and len(host) == len(tensors):
            _mark(out, host=True)                           # computed on the host from host data only
        return out


def test_the_recorder_sees_each_kind_of_host_to_device_copy():
    """A check of the check: each kind of copy is recorded (outside the helper), the helper's are its own,
    and what moves nothing is not recorded."""
    on_device = torch.zeros(4)                                  # made before: the device's
    array = np.arange(4, dtype=np.float32)
    with HostCopies() as copies:
        torch.as_tensor(array, device="cpu")
        torch.tensor([1.0, 2.0], device="cpu")
        torch.from_numpy(array).float().mul(2).to("cpu")        # host-born, computed on the host, then moved
        on_device.copy_(torch.ones(4))                          # a factory without a device: the host's
        on_device + torch.from_numpy(array)                     # mixed into a device op
        on_device[[0, 2]]
        on_device.new_tensor([1.0])
        kinds = len(copies.copies)
        to_device(array, "cpu", torch.float32)
        to_device(torch.from_numpy(array), "cpu")
        # moves nothing: device factories, dtype casts, host numbers and 0-dim host tensors, device indexing
        torch.zeros(3, device="cpu").to(torch.float64)
        on_device * 2.0 + torch.tensor(3.0)
        on_device[2:4] = on_device[:2]
    assert kinds == 7 and len(copies.outside) == 7, [c.what for c in copies.copies]
    assert len(copies.by_helper) == 2, [c.what for c in copies.copies]
    assert not hasattr(torch.from_numpy(array), HOST)           # from_numpy is itself again


def test_the_session_path_copies_host_data_only_through_to_device(tiny, tiny_pipeline):
    """A session's start (uint8 numpy first frame, a prompt and a flow shift no other test uses, so the
    encoder, the tokenizer and the schedule run here) and chunks with keys, a camera event and a prompt
    transition: every host-to-device copy is to_device's."""
    image = np.random.RandomState(11).randint(0, 256, (tiny.height, tiny.width, 3), dtype=np.uint8)
    turn = CameraEvent("velocity", (0.0, 0.0, 0.05), (0.0, 0.0, 0.0, 1.0))
    with HostCopies() as copies:
        session = tiny_pipeline.new_session(image, "host copies: a lighthouse", seed=4, flow_shift=7.5)
        session.step(Controls(keys=("w", "", "l")))
        session.step(Controls(camera=turn), prompt=("host copies: a harbour at dusk", 2))
        session.step(Controls(keys=("i", "a", "")))
    assert copies.outside == [], "\n".join(c.what for c in copies.outside)
    made = "\n".join(c.what for c in copies.by_helper)
    # the first frame, the 5 time embeddings of the new shift, token ids and mask of 2 prompts, 2 per chunk
    assert len(copies.by_helper) == 1 + 5 + 2 * 2 + 2 * 3, made
