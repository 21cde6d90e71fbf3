"""PipeLink: the torch.distributed side of a PP group (gloo; NCCL for activations on GPU).

Rank 0 hosts the rendezvous on the group's PP port. Two process groups: a gloo one for control
objects (orders, sampled tokens, start-up exchanges) and the activation one (the same gloo
group on CPU, NCCL on CUDA). Every operation has a timeout; any failure (a peer died, a
timeout) raises `StageLost` and the link is unusable afterwards: a PP group fails as a unit.
"""

from __future__ import annotations

import ipaddress
import os
import re
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist


def _short(exc: BaseException) -> str:
    """gloo's message without its source location and advice."""
    text = re.sub(r"\[[^\]]*\.(cc|cpp|h):\d+\]\s*", "", str(exc))
    return text.split(" This is typically", 1)[0].strip()


class StageLost(RuntimeError):
    """A peer stage stopped answering (died, hung or timed out)."""


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


class PipeLink:
    def __init__(
        self,
        rank: int,
        size: int,
        host: str,
        port: int,
        *,
        device: torch.device,
        start_timeout_s: float,
        timeout_s: float,
    ) -> None:
        if not 0 <= rank < size:
            raise ValueError(f"PP rank {rank} outside [0, {size})")
        self.rank, self.size = rank, size
        if _is_loopback(host):
            # gloo picks its interface from the environment only; keep a local group local.
            os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
        try:
            dist.init_process_group(
                "gloo",
                init_method=f"tcp://{host}:{port}",
                rank=rank,
                world_size=size,
                timeout=timedelta(seconds=start_timeout_s),
            )
            self._control = dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s))
            if device.type == "cuda":
                self._data = dist.new_group(backend="nccl", timeout=timedelta(seconds=timeout_s))
            else:
                self._data = self._control
        except (RuntimeError, ValueError) as exc:
            raise StageLost(f"PP group rendezvous at {host}:{port} failed: {exc}") from exc
        self.device = device
        self.broken: str | None = None

    @property
    def first(self) -> bool:
        return self.rank == 0

    @property
    def last(self) -> bool:
        return self.rank == self.size - 1

    def _guard(self, what: str, exc: BaseException) -> StageLost:
        self.broken = f"PP stage {self.rank}: {what} failed: {_short(exc)}"
        return StageLost(self.broken)

    def all_gather(self, obj: Any) -> list[Any]:
        out: list[Any] = [None] * self.size
        try:
            dist.all_gather_object(out, obj, group=self._control)
        except RuntimeError as exc:
            raise self._guard("all_gather", exc) from exc
        return out

    def broadcast(self, obj: Any, src: int) -> Any:
        box = [obj if self.rank == src else None]
        try:
            dist.broadcast_object_list(box, src=src, group=self._control)
        except RuntimeError as exc:
            raise self._guard(f"broadcast from rank {src}", exc) from exc
        return box[0]

    def send_hidden(self, hidden: torch.Tensor) -> None:
        try:
            dist.send(hidden.contiguous(), dst=self.rank + 1, group=self._data)
        except RuntimeError as exc:
            raise self._guard(f"send to rank {self.rank + 1}", exc) from exc

    def recv_hidden(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        out = torch.empty(shape, dtype=dtype, device=self.device)
        try:
            dist.recv(out, src=self.rank - 1, group=self._data)
        except RuntimeError as exc:
            raise self._guard(f"receive from rank {self.rank - 1}", exc) from exc
        return out

    def close(self) -> None:
        """Leave the group (only after a clean stop: a broken group may hang on teardown)."""
        if self.broken is None and dist.is_initialized():
            dist.destroy_process_group()
