"""Process groups and the collectives sequence parallelism uses, behind one counting wrapper.

`Comm` is the only object in lingbot/ that calls torch.distributed. Every call is counted by kind,
with the bytes this rank sends and the module it was issued from (set by `track_modules`), so tests
can pin where communication happens and benchmarks can report bytes per chunk.
"""
from __future__ import annotations

import logging
import os
import socket
from collections import Counter, defaultdict
from collections.abc import Sequence
from contextlib import contextmanager
from datetime import timedelta
from typing import Optional

import torch
import torch.distributed as dist
from torch import Tensor, nn

log = logging.getLogger(__name__)


class ParallelError(RuntimeError):
    """A sequence-parallel group failed (a peer raised, died or timed out); names rank and operation."""


NCCL_ERROR_HANDLING = "TORCH_NCCL_ASYNC_ERROR_HANDLING"
NCCL_ERROR_HANDLING_ENDS_PROCESS = ("1", "3")     # tear down; skip clean-up (torch's default)


def nccl_failures_end_the_process(environ=os.environ) -> None:
    """Make an NCCL failure end this process, so that it reaches the group's failure path.

    NCCL collectives are asynchronous: the call returns once the kernel is queued, and a peer that died or
    hangs shows only in the process group's watchdog, which aborts the communicator after the collective
    timeout. With error handling 1 (tear down) or 3 (skip clean-up, torch's default) the watchdog then ends
    the process: the rank actor dies, every call in flight to it raises in the group (RankExecutor), and
    the group fails and its sessions resume elsewhere; the surviving ranks learn it at their next control
    collective (gloo: the closed connection raises at once). With 0 (no handling) or 2 (clean up only) the
    process would live on an aborted communicator and the chunk would return whatever the aborted kernels
    left, as if it had succeeded. Those two are overridden, with a warning. Read by torch when the process
    group is made: call this before."""
    value = environ.get(NCCL_ERROR_HANDLING, environ.get("NCCL_ASYNC_ERROR_HANDLING"))   # (the old name)
    if value is not None and value.strip() in NCCL_ERROR_HANDLING_ENDS_PROCESS:
        return
    if value is not None:
        log.warning("%s=%s would let a rank run on after an NCCL failure; using 3 (end the process)",
                    NCCL_ERROR_HANDLING, value)
    environ[NCCL_ERROR_HANDLING] = "3"


def backend_for_device(device: torch.device | str) -> str:
    """cuda -> nccl, npu -> hccl (torch_npu), cpu -> gloo."""
    kind = torch.device(device).type
    if kind == "cuda":
        return "nccl"
    if kind == "npu":
        try:
            import torch_npu  # noqa: F401
        except ImportError as e:
            raise ParallelError("device npu needs torch_npu (pip install torch-npu) for the hccl backend") from e
        return "hccl"
    if kind == "cpu":
        return "gloo"
    raise ParallelError(f"no process-group backend for device type {kind!r}")


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _pad_to(x: Tensor, dim: int, size: int) -> Tensor:
    """Zero-pad x along `dim` to `size` (collectives of equal shapes carry uneven shards)."""
    if x.shape[dim] >= size:
        return x
    pad_shape = list(x.shape)
    pad_shape[dim] = size - x.shape[dim]
    return torch.cat([x, x.new_zeros(pad_shape)], dim=dim)


class Comm:
    """One rank's view of its sequence-parallel group (world_size 1 is a valid, silent group)."""

    def __init__(self, rank: int = 0, world_size: int = 1, group=None, device: torch.device | str = "cpu",
                 control_group=None):
        self.rank = rank
        self.world_size = world_size
        self.group = group
        self.control_group = control_group if control_group is not None else group
        self.device = torch.device(device)
        self.counts: Counter = Counter()
        self.bytes_sent: Counter = Counter()
        self.by_module: dict[str, Counter] = defaultdict(Counter)
        self._module_stack: list[str] = []
        self.start_group = None                # a gloo group with the start timeout (Comm.init makes it)
        self.start_timeout_s = 60.0            # wait_for_group's limit (Comm.init sets the group's)

    # ---- set-up -------------------------------------------------------------------------------
    @classmethod
    def init(cls, rank: int, world_size: int, init_method: str, device: torch.device | str = "cpu",
             timeout_s: float = 60.0, start_timeout_s: Optional[float] = None) -> Comm:
        """Join the default process group (every rank calls this concurrently). Two timeouts: `timeout_s` for
        the collectives of chunks, `start_timeout_s` (default the same) for the group's start: the
        rendezvous here and `wait_for_group` (ranks that start or load at different speeds)."""
        backend = backend_for_device(device)
        start_timeout_s = timeout_s if start_timeout_s is None else start_timeout_s
        start = timedelta(seconds=start_timeout_s)
        log.info("rank %d/%d joining %s group at %s", rank, world_size, backend, init_method)
        if backend == "nccl":
            nccl_failures_end_the_process()
        # A process group's timeout is fixed when it is made, and applies to every collective on it. So the
        # rendezvous gets its own store with the start timeout (actors of a group may come up minutes apart),
        # the groups of chunk collectives the short timeout, and the waits of the start a gloo group of their
        # own made with the start timeout (wait_for_group).
        store, rank, world_size = next(dist.rendezvous(init_method, rank, world_size, timeout=start))
        # with the device given, NCCL forms its communicator here (eagerly) instead of at the first chunk's
        # all-to-all, so transport errors show at join, not in the middle of a session
        device_id = torch.device(device) if backend == "nccl" else None
        dist.init_process_group(backend, store=store, rank=rank, world_size=world_size,
                                timeout=timedelta(seconds=timeout_s), device_id=device_id)
        # host-side decisions (stop between steps) go over a CPU group: no device sync on the step path
        control = dist.group.WORLD if backend == "gloo" else dist.new_group(backend="gloo",
                                                                            timeout=timedelta(seconds=timeout_s))
        comm = cls(rank, world_size, dist.group.WORLD, device, control)
        comm.start_group = dist.new_group(backend="gloo", timeout=start)
        comm.start_timeout_s = start_timeout_s
        return comm

    def wait_for_group(self, after: str) -> None:
        """Return once every rank of the group has called this (`after`: the step, for the error), waiting up
        to the group's start timeout, not the chunk collectives' one: rank 0 also loads the text encoder
        (UMT5-XXL, ~11 GB), and ranks read their weights at the speed of their storage, so the others
        would otherwise wait for it inside their first collective and give up after the collective timeout.

        The wait is a monitored_barrier (rank 0's error names the ranks that did not arrive) on a gloo group
        made with the start timeout (`start_group`). Its `timeout` argument alone is not enough: it bounds
        rank 0's waits only, while the other ranks wait for rank 0 with their group's own timeout (measured
        on gloo: on the short-timeout group, rank 1 gave up after the collective timeout while rank 0 was
        still loading)."""
        if self.world_size == 1:
            return
        with self._op(f"wait for every rank after {after}"):
            dist.monitored_barrier(group=self.start_group, timeout=timedelta(seconds=self.start_timeout_s),
                                   wait_all_ranks=True)

    def close(self) -> None:
        if self.world_size > 1 and dist.is_initialized():
            dist.destroy_process_group()

    @property
    def is_root(self) -> bool:
        return self.rank == 0

    def reset_counts(self) -> None:
        self.counts.clear()
        self.bytes_sent.clear()
        self.by_module.clear()

    @contextmanager
    def track_modules(self, root: nn.Module, prefix: str = ""):
        """Attribute every collective to the innermost running submodule of `root` while active."""
        def enter(name):
            def hook(module, args):
                self._module_stack.append(name)
            return hook

        def leave(module, args, output):
            self._module_stack.pop()

        handles = []
        for name, module in root.named_modules(prefix=prefix):
            handles.append(module.register_forward_pre_hook(enter(name)))
            handles.append(module.register_forward_hook(leave))
        try:
            yield self
        finally:
            for h in handles:
                h.remove()

    def _record(self, kind: str, nbytes: int) -> None:
        self.counts[kind] += 1
        self.bytes_sent[kind] += nbytes
        where = self._module_stack[-1] if self._module_stack else "<outside>"
        self.by_module[where][kind] += 1

    @contextmanager
    def _op(self, kind: str):
        try:
            yield
        except (RuntimeError, dist.DistBackendError) as e:
            raise ParallelError(f"rank {self.rank}/{self.world_size}: {kind} failed: {str(e).splitlines()[0][:200]} "
                                f"(a peer rank that raised, exited or timed out ends here too)") from e

    # ---- collectives --------------------------------------------------------------------------
    def all_to_all(self, x: Tensor, input_splits: Sequence[int], output_splits: Sequence[int],
                   kind: str = "all_to_all") -> Tensor:
        """Rows of x (dim 0) go to ranks by input_splits; the result stacks rows received, by source."""
        x = x.contiguous()
        out = x.new_empty((sum(output_splits), *x.shape[1:]))
        row = x[0].numel() * x.element_size() if x.shape[0] else 0
        self._record(kind, row * (x.shape[0] - input_splits[self.rank]))
        with self._op(kind):
            dist.all_to_all_single(out, x, list(output_splits), list(input_splits), group=self.group)
        return out

    def all_gather(self, x: Tensor, kind: str = "all_gather") -> list[Tensor]:
        """Equal-shape gather to every rank."""
        x = x.contiguous()
        out = [torch.empty_like(x) for _ in range(self.world_size)]
        self._record(kind, x.numel() * x.element_size() * (self.world_size - 1))
        with self._op(kind):
            dist.all_gather(out, x, group=self.group)
        return out

    def all_gather_uneven(self, x: Tensor, dim: int, sizes: Sequence[int], kind: str = "all_gather") -> Tensor:
        """Gather shards whose size along `dim` differs by rank (padded to the largest, then trimmed)."""
        x = _pad_to(x, dim, max(sizes))
        parts = self.all_gather(x, kind)
        return torch.cat([p.narrow(dim, 0, n) for p, n in zip(parts, sizes)], dim=dim)

    def gather_to_root(self, x: Tensor, dim: int, sizes: Sequence[int], kind: str = "gather") -> Optional[Tensor]:
        """Uneven shards along `dim` -> the whole tensor at rank 0 (None elsewhere)."""
        x = _pad_to(x, dim, max(sizes))
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.world_size)] if self.is_root else None
        if not self.is_root:
            self._record(kind, x.numel() * x.element_size())
        with self._op(kind):
            dist.gather(x, parts, dst=0, group=self.group)
        if not self.is_root:
            return None
        return torch.cat([p.narrow(dim, 0, n) for p, n in zip(parts, sizes)], dim=dim)

    def send_to_root(self, x: Tensor, shapes: Sequence[Sequence[int]], kind: str = "p2p") -> Optional[list[Tensor]]:
        """Every non-root rank sends x to rank 0 point to point; rank 0 returns all ranks' tensors. The sends
        and receives go as one batch (batch_isend_irecv), so NCCL uses the group's communicator instead of
        building one per pair of ranks."""
        if not self.is_root:
            self._record(kind, x.numel() * x.element_size())
            with self._op(kind):
                for work in dist.batch_isend_irecv([dist.P2POp(dist.isend, x.contiguous(), 0, self.group)]):
                    work.wait()
            return None
        bufs = [x.new_empty(tuple(shapes[src])) for src in range(1, self.world_size)]
        with self._op(kind):
            ops = [dist.P2POp(dist.irecv, buf, src, self.group) for src, buf in enumerate(bufs, start=1)]
            for work in dist.batch_isend_irecv(ops):
                work.wait()
        self.counts[kind] += 1
        return [x, *bufs]

    def exchange_halo(self, left_edge: Tensor, right_edge: Tensor,
                      kind: str = "halo") -> tuple[Optional[Tensor], Optional[Tensor]]:
        """Send my leftmost columns to rank-1 and rightmost to rank+1; return (from left, from right)."""
        ops, from_left, from_right = [], None, None
        if self.rank > 0:
            from_left = right_edge.new_empty(right_edge.shape)
            ops += [dist.P2POp(dist.isend, left_edge.contiguous(), self.rank - 1, self.group),
                    dist.P2POp(dist.irecv, from_left, self.rank - 1, self.group)]
        if self.rank < self.world_size - 1:
            from_right = left_edge.new_empty(left_edge.shape)
            ops += [dist.P2POp(dist.isend, right_edge.contiguous(), self.rank + 1, self.group),
                    dist.P2POp(dist.irecv, from_right, self.rank + 1, self.group)]
        sent = (left_edge.numel() * (self.rank > 0) + right_edge.numel() * (self.rank < self.world_size - 1))
        self._record(kind, sent * left_edge.element_size())
        if ops:
            with self._op(kind):
                for work in dist.batch_isend_irecv(ops):
                    work.wait()
        return from_left, from_right

    def broadcast(self, x: Tensor, src: int = 0, kind: str = "broadcast") -> Tensor:
        """x from rank `src` to every rank (in place: the others pass a buffer of the same shape and dtype)."""
        if self.world_size == 1:
            return x
        x = x.contiguous()
        self._record(kind, x.numel() * x.element_size() * (self.world_size - 1) if self.rank == src else 0)
        with self._op(kind):
            dist.broadcast(x, src=src, group=self.group)
        return x

    def any_true(self, flag: bool, kind: str = "control") -> bool:
        """Whether any rank's flag is set; every rank gets the same answer (so all stop at the same step)."""
        if self.world_size == 1:
            return flag
        t = torch.tensor([1 if flag else 0], dtype=torch.int32)
        self._record(kind, t.element_size())
        with self._op(kind):
            dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.control_group)
        return bool(t.numpy()[0])

    def barrier(self) -> None:
        if self.world_size > 1:
            with self._op("barrier"):
                dist.barrier(group=self.group)
