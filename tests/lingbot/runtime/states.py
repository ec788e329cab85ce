"""Exact comparison of the states the runtime's owners give (`state_dict`): nested dicts, tuples and lists
of tensors (bitwise, same dtype), numbers, None and dataclasses such as the camera state (numpy arrays
compared exactly)."""
import dataclasses

import numpy as np
import torch


def host(t: torch.Tensor) -> torch.Tensor:
    """A copy function as a snapshot's, without the CUDA path: a copy on the host."""
    return t.detach().to("cpu", copy=True)


def assert_same_state(a, b, where: str = "state") -> None:
    assert type(a) is type(b), f"{where}: {type(a).__name__} vs {type(b).__name__}"
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and torch.equal(a.cpu(), b.cpu()), where
    elif isinstance(a, np.ndarray):
        assert a.dtype == b.dtype and np.array_equal(a, b), where
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), f"{where}: keys {sorted(a)} vs {sorted(b)}"
        for key in a:
            assert_same_state(a[key], b[key], f"{where}[{key!r}]")
    elif isinstance(a, (tuple, list)):
        assert len(a) == len(b), f"{where}: length {len(a)} vs {len(b)}"
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same_state(x, y, f"{where}[{i}]")
    elif dataclasses.is_dataclass(a):
        for f in dataclasses.fields(a):
            assert_same_state(getattr(a, f.name), getattr(b, f.name), f"{where}.{f.name}")
    else:
        assert a == b, f"{where}: {a!r} vs {b!r}"
