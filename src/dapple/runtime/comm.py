"""The runtime's tensor communication, direct or staged through host memory.

NCCL refuses two ranks on one GPU, so when a node runs more ranks than it has GPUs the runtime
joins a gloo process group and every message and collective of a device tensor is *host
staged*: copied to a CPU tensor, moved by gloo, and copied back into the device tensor when the
work is waited for (:func:`transport_for` chooses; :func:`set_host_staged` switches it on). The
functions here take the arguments of their ``torch.distributed`` namesakes and return works
with ``wait()`` and ``is_completed()``; with staging off, or for CPU tensors, they are the
``torch.distributed`` calls themselves. A stage's messages go through :class:`PointToPoint`,
which reads the group, the rank and the staging switch once for the run and posts each message
on the group itself.

``DAPPLE_HOST_STAGED=1`` stages every tensor, CPU ones included (tests run the staged path on
gloo/CPU that way).

A message a rank sends itself never reaches ``torch.distributed``, which refuses it:
:func:`isend` and :func:`irecv` match it by tag in this process (:class:`_Loopback`), the send
copying into the receive's buffer. (A stage's messages between two chunks of one rank, the turn
of a V, do not come here: :class:`dapple.runtime.stage_links.StageLinks` hands the tensors
themselves over.)
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from typing import Any, ClassVar

import torch
import torch.distributed as dist
from torch.overrides import has_torch_function

__all__ = [
    "HOST_STAGED_ENV",
    "PointToPoint",
    "all_gather",
    "all_gather_single",
    "all_reduce",
    "all_to_all_single",
    "broadcast",
    "host_staged",
    "irecv",
    "isend",
    "reduce",
    "reduce_scatter_single",
    "set_host_staged",
    "transport_for",
]

HOST_STAGED_ENV = "DAPPLE_HOST_STAGED"
_host_staged = False


def transport_for(device_type: str, ranks_on_node: int, devices_on_node: int) -> tuple[str, bool]:
    """The process-group backend and whether device tensors are host staged.

    CPU: gloo. CUDA with at least one GPU per rank of the node: NCCL. CUDA with more ranks than
    GPUs on the node (ranks share a GPU, which NCCL refuses): gloo, host staged.
    """
    if device_type != "cuda":
        return "gloo", False
    if ranks_on_node > max(devices_on_node, 0):
        return "gloo", True
    return "nccl", False


def set_host_staged(on: bool) -> None:
    """Stage device tensors through host memory (this process, from now on)."""
    global _host_staged
    _host_staged = on


def host_staged() -> bool:
    """Whether device tensors are host staged in this process."""
    return _host_staged or os.environ.get(HOST_STAGED_ENV) == "1"


def _stages(t: torch.Tensor) -> bool:
    forced = os.environ.get(HOST_STAGED_ENV) == "1"  # every tensor, CPU ones included
    return forced or (_host_staged and t.device.type != "cpu")


class _Staged:
    """A work on host copies; ``wait()`` then copies the results back to the device."""

    def __init__(self, work: Any, back: Callable[[], object] | None, keep: Sequence[Any]) -> None:
        self.work, self.back, self.keep = work, back, keep

    def wait(self) -> bool:
        if self.work is not None:
            self.work.wait()
            self.work = None
        if self.back is not None:
            self.back()
            self.back = None
        return True

    def is_completed(self) -> bool:
        return self.work is None or bool(self.work.is_completed())


def _host(t: torch.Tensor) -> torch.Tensor:
    return t.detach().to("cpu", copy=True)


def _staged(
    fn: Callable[..., Any], tensors: Sequence[torch.Tensor], back: Sequence[int], async_op: bool,
    **kw: Any,
) -> Any:  # fmt: skip
    """``fn`` on host copies of ``tensors``; the copies at ``back`` are copied back into their
    tensors when the work is waited for (at once without ``async_op``)."""
    hosts = [_host(t) for t in tensors]

    def copy_back() -> None:
        for i in back:
            tensors[i].copy_(hosts[i])

    staged = _Staged(fn(*hosts, async_op=True, **kw), copy_back, hosts)
    if async_op:
        return staged
    staged.wait()
    return None


class _Loopback:
    """Messages a rank sends itself, matched by tag: a send before its receive is kept as a
    copy, a receive before its send waits in ``_recvs`` until the send fills its buffer."""

    _sends: ClassVar[dict[int, list[torch.Tensor]]] = {}
    _recvs: ClassVar[dict[int, list[_Loopback]]] = {}

    def __init__(self, buf: torch.Tensor | None, tag: int) -> None:
        self.buf, self.tag, self.done = buf, tag, buf is None

    @staticmethod
    def mine(peer: int, group: Any) -> bool:
        return group is None and dist.is_initialized() and peer == dist.get_rank()

    @classmethod
    def send(cls, t: torch.Tensor, tag: int) -> _Loopback:
        waiting = cls._recvs.get(tag)
        if waiting:
            r = waiting.pop(0)
            assert r.buf is not None
            r.buf.copy_(t)
            r.done = True
        else:
            cls._sends.setdefault(tag, []).append(t.detach().clone())
        return cls(None, tag)

    @classmethod
    def recv(cls, t: torch.Tensor, tag: int) -> _Loopback:
        r = cls(t, tag)
        kept = cls._sends.get(tag)
        if kept:
            t.copy_(kept.pop(0))
            r.done = True
        else:
            cls._recvs.setdefault(tag, []).append(r)
        return r

    def wait(self) -> bool:
        if not self.done:
            raise RuntimeError(
                f"rank {dist.get_rank()} waits for a message to itself (tag {self.tag}) that "
                "its program sends later: the schedule must send before it receives"
            )
        return True

    def is_completed(self) -> bool:
        return self.done


class PointToPoint:
    """``isend``/``irecv`` on the default process group of one run, as :func:`isend` and
    :func:`irecv` post them, with what they look up per message read once: the group, this
    rank, whether tensors are host staged (:func:`host_staged`, ``DAPPLE_HOST_STAGED``).

    A plain tensor's message goes to ``ProcessGroup.send``/``recv`` directly, which is what
    ``torch.distributed.isend``/``irecv`` call after their per-call checks (a complex tensor as
    its real view, as they send it); a tensor subclass with ``__torch_function__`` takes the
    ``torch.distributed`` call.
    """

    def __init__(self) -> None:
        on = dist.is_initialized()  # off: a stage built outside a run, which sends nothing
        self.group: Any = dist.group.WORLD if on else None
        self.rank = dist.get_rank() if on else -1
        self._every = os.environ.get(HOST_STAGED_ENV) == "1"
        """Every tensor is host staged, CPU ones too (``DAPPLE_HOST_STAGED=1``)."""
        self._device = _host_staged
        """Device tensors are host staged (:func:`set_host_staged`)."""

    def isend(self, t: torch.Tensor, dst: int, tag: int) -> Any:
        """Post the send of ``t`` to global rank ``dst``; returns its work."""
        if dst == self.rank:
            return _Loopback.send(t, tag)
        if self._every or (self._device and t.device.type != "cpu"):
            host = _host(t)
            return _Staged(dist.isend(host, dst=dst, tag=tag), None, [host])
        if has_torch_function((t,)):
            return dist.isend(t, dst=dst, tag=tag)
        return self.group.send([torch.view_as_real(t) if t.is_complex() else t], dst, tag)

    def irecv(self, t: torch.Tensor, src: int, tag: int) -> Any:
        """Post the receive of ``t`` from global rank ``src``; returns its work."""
        if src == self.rank:
            return _Loopback.recv(t, tag)
        if self._every or (self._device and t.device.type != "cpu"):
            host = torch.empty_like(t, device="cpu")
            work = dist.irecv(host, src=src, tag=tag)
            return _Staged(work, lambda: t.copy_(host), [host])
        if has_torch_function((t,)):
            return dist.irecv(t, src=src, tag=tag)
        return self.group.recv([torch.view_as_real(t) if t.is_complex() else t], src, tag)


def isend(t: torch.Tensor, dst: int, tag: int = 0, group: Any = None) -> Any:
    if _Loopback.mine(dst, group):
        return _Loopback.send(t, tag)
    if not _stages(t):
        return dist.isend(t, dst=dst, tag=tag, group=group)
    host = _host(t)
    return _Staged(dist.isend(host, dst=dst, tag=tag, group=group), None, [host])


def irecv(t: torch.Tensor, src: int, tag: int = 0, group: Any = None) -> Any:
    if _Loopback.mine(src, group):
        return _Loopback.recv(t, tag)
    if not _stages(t):
        return dist.irecv(t, src=src, tag=tag, group=group)
    host = torch.empty_like(t, device="cpu")
    return _Staged(dist.irecv(host, src=src, tag=tag, group=group), lambda: t.copy_(host), [host])


def all_reduce(
    t: torch.Tensor, op: Any = dist.ReduceOp.SUM, group: Any = None, async_op: bool = False
) -> Any:
    if not _stages(t):
        return dist.all_reduce(t, op=op, group=group, async_op=async_op)
    return _staged(dist.all_reduce, [t], [0], async_op, op=op, group=group)


def reduce(
    t: torch.Tensor, dst: int, op: Any = dist.ReduceOp.SUM, group: Any = None,
    async_op: bool = False,
) -> Any:  # fmt: skip
    if not _stages(t):
        return dist.reduce(t, dst=dst, op=op, group=group, async_op=async_op)
    return _staged(dist.reduce, [t], [0], async_op, dst=dst, op=op, group=group)


def broadcast(t: torch.Tensor, src: int, group: Any = None, async_op: bool = False) -> Any:
    if not _stages(t):
        return dist.broadcast(t, src=src, group=group, async_op=async_op)
    return _staged(dist.broadcast, [t], [0], async_op, src=src, group=group)


def all_gather(outs: list[torch.Tensor], t: torch.Tensor, group: Any = None) -> None:
    if not _stages(t):
        dist.all_gather(outs, t, group=group)
        return
    hosts = [torch.empty_like(o, device="cpu") for o in outs]
    dist.all_gather(hosts, _host(t), group=group)
    for o, h in zip(outs, hosts, strict=True):
        o.copy_(h)


def all_gather_single(
    out: torch.Tensor, t: torch.Tensor, group: Any = None, async_op: bool = False
) -> Any:
    if not _stages(t):
        return dist.all_gather_single(out, t, group=group, async_op=async_op)
    return _staged(dist.all_gather_single, [out, t], [0], async_op, group=group)


def reduce_scatter_single(
    out: torch.Tensor, t: torch.Tensor, op: Any = dist.ReduceOp.SUM, group: Any = None,
    async_op: bool = False,
) -> Any:  # fmt: skip
    if not _stages(t):
        return dist.reduce_scatter_single(out, t, op=op, group=group, async_op=async_op)
    return _staged(dist.reduce_scatter_single, [out, t], [0], async_op, op=op, group=group)


def all_to_all_single(
    out: torch.Tensor, t: torch.Tensor, out_splits: list[int], in_splits: list[int],
    group: Any = None,
) -> None:  # fmt: skip
    """Rows ``t`` in runs of ``in_splits[q]`` to each rank ``q`` of ``group``, runs of
    ``out_splits[p]`` rows from each ``p`` into ``out`` (synchronous; gloo and NCCL)."""
    if not _stages(t):
        dist.all_to_all_single(out, t, out_splits, in_splits, group=group)
        return
    host = torch.empty_like(out, device="cpu")
    dist.all_to_all_single(host, _host(t), out_splits, in_splits, group=group)
    out.copy_(host)
