"""Snapshots as bytes, without pickle: a session's K/V slots and state (snapshot.py) written to a file (a saved
world's, deployments/session/worlds.py) and read back to the same tensors, bitwise, whatever wrote the file.

The file: MAGIC, 8 bytes (the header's length, little-endian), the header (JSON: the structure, and each tensor's
dtype, shape and byte range), then the tensors' bytes. The structure holds only JSON values, tensors, numpy
arrays, lists, tuples, dicts with string keys and the dataclasses of KNOWN (by name); anything else is refused
when written (SnapshotFileError), and a file that names anything else, a dtype not in DTYPES, or tensors that do
not fit its bytes is refused when read. Nothing in a file is ever executed or unpickled.

Plain Python and torch."""
from __future__ import annotations

import dataclasses
import json
import struct
from typing import Any

import numpy as np
import torch

from ..camera import CameraEvent
from ..camera.rig import CameraState
from .snapshot import SlotSnapshot, StateSnapshot

MAGIC = b"LBSNAP1\n"
KNOWN = {cls.__name__: cls for cls in (SlotSnapshot, StateSnapshot, CameraState, CameraEvent)}
DTYPES = {str(dtype).removeprefix("torch."): dtype for dtype in (
    torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.int32, torch.int16, torch.int8,
    torch.uint8, torch.bool)}


class SnapshotFileError(ValueError):
    """A snapshot that cannot be written as a file, or a file that is not a whole snapshot."""


def dump(obj: Any) -> bytes:
    """`obj` (snapshots, lists and tuples of them) as the file's bytes."""
    tensors: list[torch.Tensor] = []

    def encode(x):
        if isinstance(x, torch.Tensor):
            tensors.append(x.detach().to("cpu").contiguous())
            return {"t": len(tensors) - 1}
        if isinstance(x, np.ndarray):
            tensors.append(torch.from_numpy(np.ascontiguousarray(x)))
            return {"n": len(tensors) - 1}
        if x is None or isinstance(x, (bool, int, float, str)):
            return {"v": x}
        if isinstance(x, (list, tuple)):
            return {"l" if isinstance(x, list) else "u": [encode(v) for v in x]}
        if isinstance(x, dict):
            if not all(isinstance(k, str) for k in x):
                raise SnapshotFileError("a snapshot's maps must have string keys")
            return {"d": {k: encode(v) for k, v in x.items()}}
        if dataclasses.is_dataclass(x) and KNOWN.get(type(x).__name__) is type(x):
            return {"c": type(x).__name__, "f": {f.name: encode(getattr(x, f.name)) for f in dataclasses.fields(x)}}
        raise SnapshotFileError(f"a snapshot cannot hold a {type(x).__name__} in a file")

    structure = encode(obj)
    places, offset = [], 0
    for t in tensors:
        if str(t.dtype).removeprefix("torch.") not in DTYPES:
            raise SnapshotFileError(f"a snapshot cannot hold a {t.dtype} tensor in a file")
        nbytes = t.numel() * t.element_size()
        places.append({"dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape), "offset": offset,
                       "nbytes": nbytes})
        offset += nbytes
    header = json.dumps({"structure": structure, "tensors": places}).encode()
    body = b"".join(t.reshape(-1).view(torch.uint8).numpy().tobytes() for t in tensors)
    return MAGIC + struct.pack("<Q", len(header)) + header + body


def load(data: bytes) -> Any:
    """The object `dump` wrote; SnapshotFileError for anything else (truncated, altered, another format)."""
    try:
        return _load(data)
    except SnapshotFileError:
        raise
    except (ValueError, TypeError, KeyError, IndexError, RuntimeError, RecursionError) as e:
        raise SnapshotFileError(f"not a whole snapshot file: {type(e).__name__}: {e}") from None


def _load(data: bytes) -> Any:
    if not data.startswith(MAGIC) or len(data) < len(MAGIC) + 8:
        raise SnapshotFileError("not a snapshot file")
    (length,) = struct.unpack_from("<Q", data, len(MAGIC))
    start = len(MAGIC) + 8 + length
    if start > len(data):
        raise SnapshotFileError("the snapshot file's header is truncated")
    header = json.loads(data[len(MAGIC) + 8:start])
    body = memoryview(data)[start:]
    tensors = []
    for place in header["tensors"]:
        dtype, shape = DTYPES[place["dtype"]], [int(n) for n in place["shape"]]
        offset, nbytes = int(place["offset"]), int(place["nbytes"])
        count = int(np.prod(shape)) if shape else 1
        if offset < 0 or offset + nbytes > len(body) or nbytes != count * torch.empty((), dtype=dtype).element_size():
            raise SnapshotFileError("a tensor of the snapshot file does not fit its bytes")
        raw = torch.frombuffer(bytearray(body[offset:offset + nbytes]), dtype=torch.uint8) if nbytes else \
            torch.empty(0, dtype=torch.uint8)
        tensors.append(raw.view(dtype).reshape(shape))

    def decode(node):
        if not isinstance(node, dict) or len(node) not in (1, 2):
            raise SnapshotFileError("the snapshot file's structure is garbled")
        if "t" in node:
            return tensors[node["t"]]
        if "n" in node:
            return tensors[node["n"]].numpy().copy()
        if "v" in node:
            if not (node["v"] is None or isinstance(node["v"], (bool, int, float, str))):
                raise SnapshotFileError("the snapshot file's structure is garbled")
            return node["v"]
        if "l" in node or "u" in node:
            items = [decode(v) for v in node.get("l", node.get("u"))]
            return items if "l" in node else tuple(items)
        if "d" in node:
            return {str(k): decode(v) for k, v in node["d"].items()}
        cls = KNOWN.get(node.get("c"))
        if cls is None:
            raise SnapshotFileError(f"the snapshot file names an unknown kind {str(node.get('c'))[:40]!r}")
        fields = {f.name for f in dataclasses.fields(cls)}
        if set(node["f"]) != fields:
            raise SnapshotFileError(f"the snapshot file's {cls.__name__} has other fields")
        return cls(**{k: decode(v) for k, v in node["f"].items()})
    return decode(header["structure"])
