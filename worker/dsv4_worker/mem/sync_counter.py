"""SyncCounter: counts the calls that make the host wait for the device on CUDA, whatever the
device (tests and benches; never installed on a serving path).

Run under DSV4_EMULATE_DEVICE=1 the CPU takes the code CUDA takes (`device.py`), so what this
counts there is what would sync on CUDA. Its model: a tensor is a DEVICE tensor unless it is a
HOST tensor, made inside the counter by a factory without a device (or with `device="cpu"`
spelled as a string: the host, named) or by `torch.from_numpy`, read back (`.cpu()`,
`.to("cpu")`), pinned, or computed from host tensors only. Tensors made before the counter
started count as device tensors. Counted, one per call:

    reads of a device tensor      item, tolist, __bool__ / __int__ / __float__ / __index__,
                                  numpy, __array__, __format__, cpu / to("cpu") (blocking),
                                  copy_ between host and device (blocking)
    data-dependent shapes         nonzero, argwhere, where(cond), masked_select, unique,
                                  unique_consecutive, bincount, repeat_interleave without
                                  output_size, indexing (get or set) with a boolean mask
    whole-tensor answers          equal, allclose, is_nonzero
    blocking host->device copies  tensor / as_tensor / asarray(data, device=...), new_tensor,
                                  to(device) / cuda() of a host tensor without non_blocking=True
    sizes taken from a tensor     a device tensor as a size or bound (arange, zeros, narrow,
                                  view, a slice bound, ...)

NOTE: a device tensor's `.to(device)` is taken for a no-op (under emulation the device is the
CPU too): code that means the host spells it "cpu". `torch.from_numpy` is no torch function:
the counter wraps it while counting (one counter at a time, tests and benches only). Not seen:
torch.cuda.synchronize and stream or event waits (the emulated code never calls them).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable
from typing import Any, Final

import torch
from torch import Tensor
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_leaves

_HOST: Final = "_dsv4_host_tensor"  # attribute set on the host tensors seen being made

_READS: Final = frozenset(
    {
        "item",
        "tolist",
        "__bool__",
        "__int__",
        "__float__",
        "__index__",
        "__complex__",
        "numpy",
        "__array__",
        "__format__",
        "__repr__",
        "__contains__",
    }
)
_SHAPES: Final = frozenset(
    {"nonzero", "argwhere", "masked_select", "unique", "unique_consecutive", "bincount"}
)
_WHOLE: Final = frozenset({"equal", "allclose", "is_nonzero"})
_FACTORIES: Final = frozenset(
    {"arange", "range", "zeros", "ones", "empty", "full", "rand", "randn", "randint", "linspace"}
)
_SIZED: Final = frozenset(
    {"narrow", "view", "reshape", "expand", "repeat", "new_zeros", "new_ones", "new_empty"}
)
_MADE_FROM_DATA: Final = frozenset({"tensor", "as_tensor", "asarray"})


def is_host(t: Tensor) -> bool:
    """Whether the counter has seen `t` made on the host (see the module docstring)."""
    return bool(getattr(t, _HOST, False))


def _mark(tensors: Iterable[Tensor], host: bool) -> None:
    for t in tensors:
        if host:
            setattr(t, _HOST, True)
        elif is_host(t):
            delattr(t, _HOST)


def _tensors(tree: object) -> list[Tensor]:
    return [x for x in tree_leaves(tree) if isinstance(x, Tensor)]


def _names_host(device: object) -> bool:
    """A device argument that means the host: the string "cpu" (or "cpu:N")."""
    return isinstance(device, str) and device.split(":")[0] == "cpu"


def _device_of(args: tuple[Any, ...], kwargs: dict[str, Any]) -> object:
    """The target device of a `to(...)` call, or None (a dtype-only conversion)."""
    if "device" in kwargs:
        return kwargs["device"]
    for a in args[1:]:
        if isinstance(a, Tensor):
            return "cpu" if is_host(a) else a.device  # to(other): other's side
        if isinstance(a, (str, torch.device, int)) and not isinstance(a, bool):
            return a
    return None


def _mask_index(index: object) -> bool:
    """An index (or an index tuple) holding a boolean mask or a slice bounded by a tensor."""
    parts = index if isinstance(index, (tuple, list)) else (index,)
    for part in parts:
        if isinstance(part, Tensor) and part.dtype in (torch.bool, torch.uint8):
            return True
        if isinstance(part, slice) and any(
            isinstance(b, Tensor) for b in (part.start, part.stop, part.step)
        ):
            return True
    return False


class SyncCounter(TorchFunctionMode):
    """`with SyncCounter() as c: ...` then `c.total` / `c.counts` (call name -> syncs)."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: Counter[str] = Counter()
        self._from_numpy: Callable[[Any], Tensor] | None = None

    def __enter__(self) -> SyncCounter:
        made = torch.from_numpy
        self._from_numpy = made

        def host_view(array: Any) -> Tensor:
            t = made(array)
            _mark([t], True)
            return t

        torch.from_numpy = host_view  # type: ignore[assignment]  # restored by __exit__
        super().__enter__()  # type: ignore[no-untyped-call]
        return self

    def __exit__(self, *exc: object) -> None:
        super().__exit__(*exc)  # type: ignore[no-untyped-call]
        if self._from_numpy is not None:
            torch.from_numpy = self._from_numpy  # type: ignore[assignment]

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    def __torch_function__(
        self,
        func: Callable[..., Any],
        types: object,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        name = getattr(func, "__name__", str(func))
        inputs = _tensors((args, kwargs))
        on_device = [t for t in inputs if not is_host(t)]
        why = self._sync(name, args, kwargs, inputs, on_device)
        out = func(*args, **kwargs)
        if why:
            self.counts[why] += 1
        host = self._output_side(name, args, kwargs, inputs, on_device)
        first = args[0] if args else None
        if host is not None and out is first and isinstance(out, Tensor) and host != is_host(out):
            out = out.clone()  # moved to the other side: a new tensor, as on CUDA
        if host is not None:
            _mark(_tensors(out), host)
        return out

    # -- what syncs ----------------------------------------------------------------------------

    def _sync(
        self,
        name: str,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        inputs: list[Tensor],
        on_device: list[Tensor],
    ) -> str | None:
        first = args[0] if args else None
        first_on_device = isinstance(first, Tensor) and not is_host(first)
        if name in _READS or name in _SHAPES or name in _WHOLE:
            return name if on_device else None
        if name == "where" and len(args) + len(kwargs) == 1:
            return "where(cond)" if on_device else None
        if name == "repeat_interleave":
            repeats = kwargs.get("repeats", args[1] if len(args) > 1 else first)
            sized = kwargs.get("output_size") is not None
            if isinstance(repeats, Tensor) and not sized and on_device:
                return "repeat_interleave without output_size"
            return None
        if name in ("__getitem__", "__setitem__", "index_put_", "index_put"):
            index = args[1] if len(args) > 1 else kwargs.get("indices")
            if on_device and _mask_index(index):
                return f"{name} with a mask"
            return None
        if name == "cpu":
            return "cpu" if first_on_device else None
        if name in ("to", "cuda"):
            device = _device_of(args, kwargs) if name == "to" else "cuda"
            blocking = not (kwargs.get("non_blocking") or any(a is True for a in args[2:4]))
            if device is None or not blocking:
                return None
            if _names_host(device):
                return "to(cpu)" if first_on_device else None
            return f"{name}(device) of a host tensor" if not first_on_device else None
        if name == "copy_" and len(args) > 1 and isinstance(args[1], Tensor):
            crosses = is_host(args[0]) != is_host(args[1])
            if crosses and not kwargs.get("non_blocking"):
                return "copy_ across host and device"
            return None
        if name in _MADE_FROM_DATA:
            positional = args[2] if name == "as_tensor" and len(args) > 2 else None
            device = kwargs.get("device", positional)
            already_there = isinstance(first, Tensor) and not is_host(first)
            if device is None or _names_host(device) or already_there:
                return None
            return f"{name}(data, device=...)"
        if name == "new_tensor":
            return "new_tensor" if first_on_device else None
        if name in _FACTORIES or name in _SIZED:
            sizes = args if name in _FACTORIES else args[1:]
            if any(isinstance(a, Tensor) and not is_host(a) for a in tree_leaves(list(sizes))):
                return f"{name} sized by a tensor"
            return None
        return None

    # -- where outputs live --------------------------------------------------------------------

    def _output_side(
        self,
        name: str,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        inputs: list[Tensor],
        on_device: list[Tensor],
    ) -> bool | None:
        """Whether the call's tensor outputs are host tensors (None: leave them as they are)."""
        first = args[0] if args else None
        if name in ("cpu", "pin_memory"):
            return True
        if name in ("to", "cuda"):
            device = _device_of(args, kwargs) if name == "to" else "cuda"
            if not isinstance(first, Tensor):
                return None
            return is_host(first) if device is None else _names_host(device)
        if name in _MADE_FROM_DATA or name in _FACTORIES:
            device = kwargs.get("device")
            if isinstance(first, Tensor) and name in _MADE_FROM_DATA and device is None:
                return is_host(first)
            return device is None or _names_host(device)
        if name.endswith("_like") and "device" in kwargs:
            return _names_host(kwargs["device"])
        if inputs and name != "copy_":
            return not on_device
        return None
