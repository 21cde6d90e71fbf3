"""DeepSeek-V4's rotary embedding: interleaved pairs (channels 2i, 2i+1 rotate together by
frequency i) on the trailing `qk_rope_head_dim` channels of a head, with two tables:

    main      theta = rope_theta, unscaled: the window-only layers (compress ratio 0)
    compress  theta = compress_rope_theta, YaRN-scaled when the config has rope_scaling: the
              compressed layers (their queries, window keys, compressed rows, indexer)

YaRN here only blends each frequency between its extrapolated and interpolated (/ factor)
value; DeepSeek-V4 does not scale cos/sin by YaRN's attention factor (transformers forces it
to 1.0 for this model, see docs/real-model.md).
"""

from __future__ import annotations

import math
from functools import lru_cache

import torch

from dsv4_common.core.model import DSV4Config, YarnScaling


@lru_cache(maxsize=64)
def _inv_freq_cpu(dims: int, theta: float, yarn: YarnScaling | None) -> torch.Tensor:
    half = dims // 2
    base = 1.0 / theta ** (torch.arange(half, dtype=torch.float64) * 2 / dims)
    if yarn is None:
        return base

    def correction_dim(rotations: float) -> float:
        span = yarn.original_max_position_embeddings / (rotations * 2 * math.pi)
        return dims * math.log(span) / (2 * math.log(theta))

    low = max(math.floor(correction_dim(yarn.beta_fast)), 0)
    high = min(math.ceil(correction_dim(yarn.beta_slow)), dims - 1)
    if low == high:
        high += 0.001  # type: ignore[assignment]  # avoids a zero-width ramp
    ramp = ((torch.arange(half, dtype=torch.float64) - low) / (high - low)).clamp(0, 1)
    keep = 1.0 - ramp  # 1: extrapolate (high frequencies), 0: interpolate
    return base / yarn.factor * (1 - keep) + base * keep


@lru_cache(maxsize=64)
def inv_freq(
    dims: int, theta: float, yarn: YarnScaling | None, device: torch.device
) -> torch.Tensor:
    """Inverse frequencies [dims // 2] (float64) of a rope over `dims` channels (one copy per
    device, made once and without a sync: a copy per call was a blocking copy on CUDA)."""
    return _inv_freq_cpu(dims, theta, yarn).to(device, non_blocking=True)


def compress_freq(m: DSV4Config, device: torch.device) -> torch.Tensor:
    a = m.arch
    return inv_freq(m.qk_rope_head_dim, a.compress_rope_theta, a.rope_scaling, device)


def layer_freq(m: DSV4Config, layer: int, device: torch.device) -> torch.Tensor:
    """The table a layer's queries and window keys use."""
    if m.compress_ratios[layer]:
        return compress_freq(m, device)
    return inv_freq(m.qk_rope_head_dim, m.arch.rope_theta, None, device)


def rotate(
    x: torch.Tensor, positions: torch.Tensor, freq: torch.Tensor, *, inverse: bool = False
) -> torch.Tensor:
    """Rotate the trailing 2 * len(freq) channels of `x` [T, ..., D] by `positions` [T]
    (`inverse`: by -positions, undoing the rotation). A bfloat16/float16 `x` is rotated in
    float32 (as DeepSeek's reference does): a position past 256 is not even an integer in
    bfloat16."""
    dims = 2 * freq.shape[0]
    if dims == 0:
        return x
    if x.dtype not in (torch.float32, torch.float64):
        return rotate(x.float(), positions, freq, inverse=inverse).to(x.dtype)
    head, rot = x[..., : x.shape[-1] - dims], x[..., x.shape[-1] - dims :]
    # A pair (2i, 2i+1) is the complex number 2i + 1j * (2i+1): one complex product.
    turn = _turns(positions, freq, x.dtype, inverse)
    turn = turn.view((len(x),) + (1,) * (x.dim() - 2) + (dims // 2,))
    pairs = torch.view_as_complex(rot.reshape(*rot.shape[:-1], dims // 2, 2).contiguous())
    return torch.cat([head, torch.view_as_real(pairs * turn).flatten(-2)], dim=-1)


_TurnKey = tuple[torch.Tensor, int, torch.Tensor, int, torch.dtype, bool]
_recent_turns: list[tuple[_TurnKey, torch.Tensor]] = []


def _turns(
    positions: torch.Tensor, freq: torch.Tensor, dtype: torch.dtype, inverse: bool
) -> torch.Tensor:
    """exp(+-1j * positions x freq) [T, dims/2], remembered for the last few (positions, freq)
    tensors: one forward rotates the same positions with the same table in every layer (queries,
    window keys, outputs, indexer). A key holds its tensors (so their ids stay theirs) and
    their version counters (an in-place change misses). An inference tensor (the engine's
    forward runs in inference mode) has no version counter: the forward never writes its
    positions or tables in place."""
    for key, turn in _recent_turns:
        if (
            key[0] is positions
            and key[1] == _version(positions)
            and key[2] is freq
            and key[3] == _version(freq)
            and key[4:] == (dtype, inverse)
        ):
            return turn
    angles = positions.to(dtype)[:, None] * freq.to(dtype)[None, :]
    turn = torch.polar(torch.ones_like(angles), -angles if inverse else angles)
    if not turn.requires_grad:
        _recent_turns.insert(
            0, ((positions, _version(positions), freq, _version(freq), dtype, inverse), turn)
        )
        del _recent_turns[8:]
    return turn


def _version(t: torch.Tensor) -> int:
    return -1 if t.is_inference() else t._version
