"""`Params`: one stage's parameters held as they are stored (`stored.py`: FP8 blocks, packed FP4
experts, BF16/F32 floats, integer tables) and the compute dtype the model uses them in. The model
code reads parameters only through it:

    linear(x, name)      x @ W.T in x's dtype (W dequantized or cast at use, or a scaled FP8
                         matmul on a device that has one; a few rows on a CPU split over
                         torch's threads: cpu_linear.py)
    dense(name)          W in the compute dtype (grouped projections)
    vector(name)         a float parameter (norm gain, bias, sink, ...) in the compute dtype
    rows(name, index)    W[index] in the compute dtype (embeddings, per-slot biases)
    table(name)          an integer table as held (hash routing)
    experts(names, i)    the same-shaped weights `names` [E] at `i` (an index tensor or a slice),
                         [M, out, in] in the compute dtype, from one stack (`stacked.py`)

NOTE (scratch): a quantized or differently-typed weight is materialized into one of two flat
buffers per dtype, reused by every layer (`linear`'s is consumed before it returns; `dense`'s
result stays valid until the next `dense` call). So besides the stored weights the stage holds
at most two of its largest matrices in the compute dtype, never a widened copy of the model.
`experts` has a third buffer for the experts it selects (the MoE selects in chunks that bound it).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, KeysView, Mapping, Sequence

import torch
from torch import Tensor

from dsv4_worker.model import cpu_linear
from dsv4_worker.model.fp8_matmul import scaled_linear
from dsv4_worker.model.stacked import Stack
from dsv4_worker.model.stored import FP4Packed, FP8Block, Stored


class Params:
    __slots__ = ("_blocks", "_held", "_laid_out", "_scratch", "_stacks", "dtype")

    def __init__(self, held: Mapping[str, Stored], dtype: torch.dtype) -> None:
        if not dtype.is_floating_point:
            raise ValueError(f"compute dtype {dtype} is not a float dtype")
        self._held = dict(held)
        self.dtype = dtype  # the compute dtype (embeddings and dense/vector/rows come in it)
        # (dtype, slot) -> flat buffer; slot 0: linear's, 1: dense's, 2: experts'
        self._scratch: dict[tuple[torch.dtype, int], Tensor] = {}
        self._laid_out: set[str] = set()  # names `linear` has chosen a memory layout for
        # names -> their stack (None: they cannot share one); the names' held entries are
        # views into it
        self._stacks: dict[tuple[str, ...], Stack | None] = {}
        # name -> its held weight cut into blocks for cpu_linear (views of the held tensor)
        self._blocks: dict[str, Tensor] = {}

    @classmethod
    def of(
        cls,
        p: Params | Mapping[str, Tensor] | Mapping[str, Stored],
        dtype: torch.dtype | None = None,
    ) -> Params:
        """`p` as Params computing in `dtype`, else in its plain floats' dtype when they all
        share one (float32 when they do not)."""
        if isinstance(p, Params):
            return p if dtype is None or dtype == p.dtype else Params(p._held, dtype)
        return cls(p, dtype or _common_float_dtype(p.values()))

    # -- what is held -----------------------------------------------------------------------------

    def __contains__(self, name: object) -> bool:
        return name in self._held

    def __len__(self) -> int:
        return len(self._held)

    def names(self) -> KeysView[str]:
        return self._held.keys()

    def held(self, name: str) -> Stored:
        return self._held[name]

    def items(self) -> Iterable[tuple[str, Stored]]:
        return self._held.items()

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._held[name].shape)

    @property
    def device(self) -> torch.device:
        """Where the parameters are (all on one device)."""
        return _device(next(iter(self._held.values())))

    @property
    def nbytes(self) -> int:
        """Bytes of the parameters as held (weights and their scales; no scratch)."""
        return sum(s.nbytes for s in self._held.values())

    def subset(self, names: Iterable[str]) -> Params:
        """The named parameters (sharing their tensors), in the same compute dtype."""
        return Params({n: self._held[n] for n in names}, self.dtype)

    # -- reads in the compute dtype ---------------------------------------------------------------

    def linear(self, x: Tensor, name: str) -> Tensor:
        """x [..., in] @ W.T [in, out], in x's dtype."""
        s = self._held[name]
        if isinstance(s, Tensor):
            if s.dtype != x.dtype:
                return cpu_linear.linear(x, self._materialize(s, x.dtype, 0))
            if name not in self._laid_out:
                s = self._lay_out(name, s)
            return cpu_linear.linear(x, s, self._blocks, name)
        if isinstance(s, FP8Block):
            out = scaled_linear(x, s)
            if out is not None:
                return out
        return cpu_linear.linear(x, self._materialize(s, x.dtype, 0))

    def dense(self, name: str, dtype: torch.dtype | None = None) -> Tensor:
        """W in `dtype` (default: the compute dtype); valid until the next `dense` call."""
        s = self._held[name]
        dtype = dtype or self.dtype
        if isinstance(s, Tensor) and s.dtype == dtype:
            return s
        return self._materialize(s, dtype, 1)

    def vector(self, name: str, dtype: torch.dtype | None = None) -> Tensor:
        """A float parameter in `dtype` (default: the compute dtype), a fresh tensor when it
        is stored in another dtype."""
        s = self._held[name]
        assert isinstance(s, Tensor), f"{name} is quantized; read it with linear or dense"
        return s.to(dtype or self.dtype)

    def rows(self, name: str, index: Tensor, dtype: torch.dtype | None = None) -> Tensor:
        """W[index] in `dtype` (default: the compute dtype)."""
        s = self._held[name]
        if isinstance(s, Tensor):
            return s[index].to(dtype or self.dtype)
        return self.dense(name, dtype)[index].clone()

    def stack(self, names: Sequence[str]) -> Stack | None:
        """The weights `names` held as one stack from now on (their entries become views into
        it: the same bytes), or None when they cannot share one (different kinds or shapes)."""
        key = tuple(names)
        if key not in self._stacks:
            with torch.inference_mode(False):  # held from now on, outside any forward too
                stack = Stack.of([self._held[n] for n in key])
                views = stack.views() if stack is not None else []
            if stack is not None:
                self._held.update(zip(key, views, strict=True))
                for name in key:  # blocks of the replaced tensors would keep them alive
                    self._blocks.pop(name, None)
                self._laid_out.update(key)  # views stay as they are: no second copy
            self._stacks[key] = stack
        return self._stacks[key]

    def experts(
        self, names: Sequence[str], index: Tensor | slice, dtype: torch.dtype | None = None
    ) -> Tensor:
        """The stackable weights `names` [E] at `index` (a long tensor [M] on their device,
        never read back, or a slice of them) as [M, out, in] in `dtype` (default: the compute
        dtype); valid until the next `experts` call."""
        stack = self.stack(names)
        if stack is None:
            raise ValueError(f"{names[0]} and the rest cannot be stacked (kinds or shapes differ)")
        count = (
            index.shape[0] if isinstance(index, Tensor) else len(range(*index.indices(stack.num)))
        )
        out = self._buffer((count, stack.rows, stack.cols), dtype or self.dtype, stack.device, 2)
        return stack.select_into(index, out)

    def table(self, name: str) -> Tensor:
        s = self._held[name]
        assert isinstance(s, Tensor) and not s.is_floating_point(), f"{name} is not a table"
        return s

    def _lay_out(self, name: str, w: Tensor) -> Tensor:
        """`w` [out, in] in the memory layout `linear` reads fastest, held from now on in
        place of the original (the same bytes): column-major (W.T contiguous) on a CPU when
        out > in. A decode step multiplies one row per request, and MKL's one-row product
        reads a wide matrix 1.2-2.0x faster that way on the 2-core EPYC, 16 rows 1.0-1.2x;
        a matrix with out <= in reads faster row-major (bench/layout.py). The layout holds
        with `cpu_linear`'s split too: each thread's block reads faster in it."""
        self._laid_out.add(name)
        out_features, in_features = w.shape if w.dim() == 2 else (0, 0)
        if w.device.type != "cpu" or out_features <= in_features or w.requires_grad:
            return w
        with torch.inference_mode(False):  # held from now on, outside any forward too
            w = self._held[name] = w.t().contiguous().t()
        return w

    # -- scratch ----------------------------------------------------------------------------------

    def _buffer(
        self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device, slot: int
    ) -> Tensor:
        """Scratch slot `slot`'s buffer for `dtype`, grown to `shape` when smaller."""
        numel = math.prod(shape)
        buf = self._scratch.get((dtype, slot))
        if buf is None or buf.numel() < numel or buf.device != device:
            with torch.inference_mode(False):  # reused outside any forward too
                buf = torch.empty(numel, dtype=dtype, device=device)
            self._scratch[(dtype, slot)] = buf
        return buf[:numel].view(shape)

    def _materialize(self, s: Stored, dtype: torch.dtype, slot: int) -> Tensor:
        out = self._buffer(tuple(s.shape), dtype, _device(s), slot)
        if isinstance(s, Tensor):
            return out.copy_(s)
        return s.dequantize_into(out)


def _device(s: Stored) -> torch.device:
    if isinstance(s, FP4Packed):
        return s.packed.device
    if isinstance(s, FP8Block):
        return s.values.device
    return s.device


def _common_float_dtype(tensors: Iterable[Stored]) -> torch.dtype:
    dtypes = {t.dtype for t in tensors if isinstance(t, Tensor) and t.is_floating_point()}
    return dtypes.pop() if len(dtypes) == 1 else torch.float32
