"""An engine step makes one device sync, the sampled tokens' read-back (issue #38 item 5):
under DSV4_EMULATE_DEVICE=1 the CPU runs the code CUDA runs and `SyncCounter` counts the calls
that would sync there, over whole steps of 64 running requests (the scheduler, the
allocator's decode with page crossings, sampling, finishing and freeing, window eviction),
prefill steps, and the paged forward itself."""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Sequence

import pytest
import torch
from engine_helpers import engine as make_engine
from mem_helpers import emulating_device, small_memory

from dsv4_common.core.model import DSV4Config, ModelConfig
from dsv4_common.core.presets import hybrid_tiny, tiny
from dsv4_worker.engine.loop import Engine
from dsv4_worker.engine.paged import Segment
from dsv4_worker.engine.role import EngineConfig
from dsv4_worker.engine.sampler import SamplingParams
from dsv4_worker.mem.memory import KVMemory
from dsv4_worker.mem.sync_counter import SyncCounter
from dsv4_worker.model import dsv4
from dsv4_worker.model.ops import swiglu
from dsv4_worker.model.params import Params
from dsv4_worker.model.weights import init_weights
from dsv4_worker.sched.scheduler import SchedulerConfig

RUNNING = 64
VOCAB = 256


class LogitsOnDevice:
    """Stands in for PagedModel: fresh logits on the memory's device each forward (as a model
    makes them), greedy token 7; no KV touched."""

    def __init__(self, memory: KVMemory) -> None:
        self.memory = memory

    def forward(self, segments: Sequence[Segment]) -> torch.Tensor:
        logits = torch.zeros(len(segments), VOCAB, device=self.memory.device)
        logits[:, 7] = 1.0
        return logits


def _engine() -> Engine:
    memory = small_memory(
        full_pages=RUNNING * 8, swa_pages=RUNNING * 3, slots=RUNNING, max_pages=8, emulate=True
    )
    assert not memory.pages.tables.shared
    config = SchedulerConfig(
        page_size=16,
        chunk_tokens=RUNNING * 40,
        max_tokens_per_request=memory.config.max_tokens_per_request,
        retained_tokens=memory.config.retained_tokens,
    )
    return Engine(LogitsOnDevice(memory), EngineConfig(config))  # type: ignore[arg-type]


def _counted_steps(eng: Engine, steps: int) -> Iterator[dict[str, int]]:
    with emulating_device():  # the sampler reads the switch at each call
        for _ in range(steps):
            with SyncCounter() as counter:
                eng.step()
            yield dict(counter.counts)


def test_a_step_of_64_running_requests_reads_back_the_sampled_tokens_only() -> None:
    eng = _engine()
    for i in range(RUNNING):  # prompts of 9-40 tokens; some finish (and free) mid-run
        eng.submit([3 + i % 5] * (9 + i % 32), SamplingParams(max_new_tokens=20 + i % 40))
    for counts in _counted_steps(eng, 40):
        assert sum(counts.values()) <= 1, counts
        assert set(counts) <= {"tolist"}, counts  # greedy_tokens' argmax read-back
    assert eng.steps == 40 and len(eng.requests) < RUNNING  # finished ones freed inside steps
    eng.run_until_idle()
    eng.mem.check_integrity()


def test_steps_with_page_crossings_and_evictions_each_read_back_once() -> None:
    eng = _engine()
    for i in range(RUNNING):
        eng.submit([5] * (16 + i % 3), SamplingParams(max_new_tokens=60))
    swa_used, crossings, evictions = [], 0, 0
    for counts in _counted_steps(eng, 36):
        assert sum(counts.values()) == 1, counts
        swa_used.append(eng.mem.pages.swa.num_used)
    for before, after in itertools.pairwise(swa_used):
        crossings += after > before
        evictions += after < before
    assert crossings and evictions  # both happened inside counted steps
    eng.mem.check_integrity()


def _dense_moe(
    m: DSV4Config, p: Params, layer: int, x: torch.Tensor, ids: torch.Tensor
) -> torch.Tensor:
    """`moe.moe` without its data-dependent dispatch: every expert over every token, weighted
    by the routing (0 where not chosen). Stands in for it below, which counts the rest."""
    from dsv4_worker.model.moe import route

    f = f"layers.{layer}.ffn"
    limit = m.arch.swiglu_limit
    chosen, weights = route(m, p, layer, x, ids)
    out = torch.zeros_like(x)
    for e in range(m.weights.num_routed_experts):
        coef = (weights * (chosen == e)).sum(-1, keepdim=True).to(x.dtype)
        w = [f"{f}.experts.{e}.{n}.weight" for n in ("w1", "w3", "w2")]
        out = out + swiglu(x, p, *w, limit) * coef
    if f"{f}.shared_experts.w1.weight" in p:
        w = [f"{f}.shared_experts.{n}.weight" for n in ("w1", "w3", "w2")]
        out = out + swiglu(x, p, *w, limit)
    return out


@pytest.mark.parametrize("model", [hybrid_tiny(), tiny()], ids=lambda m: m.name)
def test_the_paged_forward_adds_no_sync(
    model: ModelConfig, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Prefill chunks and decode steps through the real paged forward: one sync per step (the
    read-back). For DeepSeek-V4 the MoE's per-expert dispatch (`moe.moe`: unique experts, rows
    per expert) is replaced by a dense form: that dispatch is the model's, and still syncs."""
    if isinstance(model, DSV4Config):
        monkeypatch.setattr(dsv4, "moe", _dense_moe)
    with emulating_device():
        eng = make_engine(
            model, init_weights(model, seed=5), full_pages=96, swa_pages=64, slots=6, chunk=48
        )
    for i in range(6):
        eng.submit([(7 * i + j) % 200 + 3 for j in range(6 + 5 * i)], SamplingParams(24))
    steps = list(_counted_steps(eng, 10))
    assert all(sum(c.values()) <= 1 for c in steps), steps
    assert sum(sum(c.values()) for c in steps) >= 8  # the steps sampled
    eng.mem.check_integrity()
