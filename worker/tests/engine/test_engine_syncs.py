"""An engine step makes one device sync, the sampled tokens' read-back (issue #38 item 5):
under DSV4_EMULATE_DEVICE=1 the CPU runs the code CUDA runs and `SyncCounter` counts the calls
that would sync there, over whole steps of 64 running requests (the scheduler, the
allocator's decode with page crossings, sampling, finishing and freeing, window eviction),
prefill steps, and the paged forward itself."""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Iterator, Mapping, Sequence

import pytest
import torch
from engine_helpers import engine as make_engine
from mem_helpers import emulating_device, small_memory

from dsv4_common.core.model import DSV4Config, ModelConfig, Quantization
from dsv4_common.core.presets import hybrid_tiny, tiny
from dsv4_worker.engine.loop import Engine
from dsv4_worker.engine.paged import Segment
from dsv4_worker.engine.role import EngineConfig
from dsv4_worker.engine.sampler import SamplingParams
from dsv4_worker.mem.memory import KVMemory
from dsv4_worker.mem.sync_counter import SyncCounter
from dsv4_worker.model.checkpoint import load_checkpoint
from dsv4_worker.model.params import Params
from dsv4_worker.model.random_stored import random_weights
from dsv4_worker.model.stored import Stored
from dsv4_worker.model.weights import init_weights, stage_param_names
from dsv4_worker.precheck import PACKAGED_MODELS
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


def _tiny_fp8() -> DSV4Config:
    """tiny with the release's fp8 KV rows and indexer keys (quantized on write, on gather)."""
    return dataclasses.replace(
        tiny(), name="tiny-fp8", kv_dtype="fp8_e4m3", indexer_dtype="fp8", kv_page_align_bytes=576
    )


def _tiny_release() -> DSV4Config:
    """tiny with its weights as the release stores them: FP8 block linears, FP4 experts."""
    return dataclasses.replace(tiny(), name="tiny-release", quantization=Quantization())


def _weights(model: ModelConfig) -> Mapping[str, Stored]:
    if isinstance(model, DSV4Config) and model.quantization is not None:
        layers = range(model.num_hidden_layers)
        return random_weights(model, 5, stage_param_names(model, layers, first=True, last=True))
    return init_weights(model, seed=5)


@pytest.mark.parametrize(
    "model", [hybrid_tiny(), tiny(), _tiny_fp8(), _tiny_release()], ids=lambda m: m.name
)
def test_the_paged_forward_adds_no_sync(model: ModelConfig) -> None:
    """Prefill chunks and decode steps through the real paged forward (DeepSeek-V4's MoE
    takes its device dispatch, on stacked FP4 experts for tiny-release; fp8 rows quantize and
    dequantize on the device): one sync per step, the read-back."""
    with emulating_device():
        eng = make_engine(model, _weights(model), full_pages=96, swa_pages=64, slots=6, chunk=48)
    for i in range(6):
        eng.submit([(7 * i + j) % 200 + 3 for j in range(6 + 5 * i)], SamplingParams(24))
    steps = list(_counted_steps(eng, 10))
    assert all(sum(c.values()) <= 1 for c in steps), steps
    assert sum(sum(c.values()) for c in steps) >= 8  # the steps sampled
    eng.mem.check_integrity()


def test_the_served_tiny_at_64_running_syncs_once_per_step() -> None:
    """The whole engine step of the shipped tiny model as `dsv4 serve` runs it (its trained
    weights as stored, float32 compute), 64 requests prefilled in one chunk then decoding
    together (page crossings, requests finishing): each step reads the sampled tokens back
    and nothing else."""
    model = tiny()
    held = load_checkpoint(PACKAGED_MODELS / "tiny", model).params
    with emulating_device():
        eng = make_engine(
            model,
            Params.of(held, torch.float32),
            full_pages=RUNNING * 6,
            swa_pages=RUNNING * 3,
            slots=RUNNING,
            chunk=RUNNING * 40,
        )
    for i in range(RUNNING):  # prompts of 9-40 tokens, 20-34 new tokens each
        prompt = [(7 * i + j) % 200 + 3 for j in range(9 + i % 32)]
        eng.submit(prompt, SamplingParams(max_new_tokens=20 + i % 15))
    running = []
    for counts in _counted_steps(eng, 24):
        assert counts == {"tolist": 1}, counts
        running.append(len(eng.requests))
    assert running[0] == RUNNING and running[-1] < RUNNING  # all ran together; some finished
    eng.run_until_idle()
    eng.mem.check_integrity()
