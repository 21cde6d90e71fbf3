"""PipeLink: the torch.distributed side of a PP group (gloo; NCCL for activations on GPU).

Rank 0 hosts the rendezvous on the group's PP port, listening on its configured host only
(`listen_host`, the worker's `--host`), never on every interface. Two process groups: a gloo
one for control objects (orders, sampled tokens, start-up exchanges) and the activation one
(the same gloo group on CPU, NCCL on CUDA). Every operation has a timeout; any failure (a peer
died, a timeout) raises `StageLost` and the link is unusable afterwards: a PP group fails as a
unit.
"""

from __future__ import annotations

import ipaddress
import os
import re
import socket
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import TCPStore  # type: ignore[attr-defined]  # (re-exported, untyped)


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


def listen_socket(host: str, port: int) -> socket.socket:
    """A TCP socket listening on `host:port` only (a name: its first address). Raises OSError."""
    family, kind, proto, _, address = socket.getaddrinfo(
        host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
    )[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # a restarted rank 0 rebinds
        sock.bind(address)
        sock.listen(socket.SOMAXCONN)
    except OSError:
        sock.close()
        raise
    return sock


def _rendezvous_store(
    rank: int, size: int, host: str, port: int, listen_host: str | None, timeout: timedelta
) -> TCPStore:
    """The group's key-value store. torch's own server binds every interface, so rank 0
    hands it a socket bound to `listen_host` (torch's `master_listen_fd`)."""
    if rank != 0:
        return TCPStore(host, port, size, False, timeout)
    sock = listen_socket(listen_host or host, port)
    try:
        store = TCPStore(
            host, port, size, True, timeout, master_listen_fd=sock.fileno(), use_libuv=True
        )
    except BaseException:
        sock.close()
        raise
    sock.detach()  # the store's server owns the descriptor now
    return store


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
        listen_host: str | None = None,
    ) -> None:
        """`host:port`: where the group meets. Rank 0 listens on `listen_host:port` (None:
        `host`); the others connect to `host:port`."""
        if not 0 <= rank < size:
            raise ValueError(f"PP rank {rank} outside [0, {size})")
        self.rank, self.size = rank, size
        if _is_loopback(host):
            # gloo picks its interface from the environment only; keep a local group local.
            os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
        start_timeout = timedelta(seconds=start_timeout_s)
        try:
            store = _rendezvous_store(rank, size, host, port, listen_host, start_timeout)
            dist.init_process_group(
                "gloo", store=store, rank=rank, world_size=size, timeout=start_timeout
            )
            self._control = dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s))
            if device.type == "cuda":
                self._data = dist.new_group(backend="nccl", timeout=timedelta(seconds=timeout_s))
            else:
                self._data = self._control
        except (RuntimeError, ValueError, OSError) as exc:
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
