"""Train the `tiny` preset's DeepSeek-V4 architecture on English text found on every Debian 12
machine, then write it as a model directory that `dsv4 serve --model DIR` serves with its
built-in byte tokenizer (token id = byte value, vocab 256, no EOS). Downloads nothing.

    .venv/bin/python scripts/train_tiny.py [--minutes M | --steps N] [--seed S] [--out DIR]

Text: the licenses in /usr/share/common-licenses (Debian's base-files package, present and
identical on every Debian 12 install), each file once (the GPL/LGPL/GFDL aliases are links),
every paragraph reflowed to one line. The last 5% of the bytes are held out for a validation
loss.

Training: autograd through `oracle_logits` in the parameters' dtype (float64, the oracle's; a
float32 run, a measurement found, gains ~15%), AdamW, windows of bytes that begin
at a word, data-parallel over --workers processes of one CPU thread each (gloo on a file
rendezvous; one thread per process beats two threads in one: the tensors are small). The hash
routing table (`tid2eid`) keeps init_weights' values. The language-model loss gives no
gradient to two parameter sets, which are trained as DeepSeek trains them: each router's
correction bias (`gate.bias`) steps against its experts' load excess after every step
(auxiliary-loss-free balancing), and each lightning indexer learns by a KL loss towards the
main attention's distribution over the compressed blocks (its inputs detached, so that loss
trains the indexer only).
NOTE: deterministic given --seed, --steps and --workers; --minutes picks --steps from the
speed of the first steps, and the README written beside the weights records all three.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import hashlib
import math
import sys
import tempfile
import textwrap
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.multiprocessing.spawn import spawn

from dsv4_common.core.model import DSV4Config
from dsv4_common.core.presets import tiny
from dsv4_worker.model import attention as A
from dsv4_worker.model import indexer as I
from dsv4_worker.model import moe, oracle
from dsv4_worker.model.export import write_model_dir
from dsv4_worker.model.params import Params as ModelParams
from dsv4_worker.model.rope import compress_freq, layer_freq
from dsv4_worker.model.weights import INTEGER_SUFFIXES, NORM_SUFFIXES, init_weights

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_OUT = ROOT / "worker" / "dsv4_worker" / "models" / "tiny"
TEXT_DIR = Path("/usr/share/common-licenses")
TEXT_SOURCE = "the license texts of Debian 12's /usr/share/common-licenses (base-files)"
HELD_OUT = 0.05
PROMPTS = ("The ", "import ", "In the ")
# --minutes: the steps timed (from the end of the first to the end of the second) to pick the
# total; both inside the warm-up, whose learning rates do not depend on the total.
CALIBRATION_STEPS = (3, 13)
TIME_SHARE_TRAINING = 0.9  # of --minutes; the rest: validation, samples, writing
Params = dict[str, torch.Tensor]


@dataclass(frozen=True, slots=True)
class TrainConfig:
    seed: int = 0
    steps: int | None = None  # None: from `minutes`
    minutes: float = 9.0
    window_tokens: int = 128
    windows_per_step: int = 8
    lr: float = 8e-3
    min_lr_ratio: float = 0.1  # cosine decay to lr x this
    warmup_steps: int = 30
    weight_decay: float = 0.1  # matrices only
    grad_clip: float = 1.0
    bias_step: float = 1e-3  # router correction bias change per step (DeepSeek-V3's gamma)
    indexer_loss_weight: float = 1.0
    log_every: int = 25
    sample_every: int = 200
    val_windows: int = 16


@dataclass(slots=True)
class TrainResult:
    params: Params
    steps: int
    seconds: float
    train_loss: float  # nats per byte, mean of the last log interval
    val_loss: float
    curve: list[tuple[int, float, float]] = field(default_factory=list)  # step, train, val


# --- text --------------------------------------------------------------------------------------


def read_text(directory: Path = TEXT_DIR) -> bytes:
    """Every license file once (links skipped), sorted by name, paragraphs on one line each."""
    files = sorted(p for p in directory.iterdir() if p.is_file() and not p.is_symlink())
    if not files:
        raise SystemExit(f"no text found in {directory} (Debian's base-files package)")
    documents = [reflow(p.read_text(encoding="utf-8")) for p in files]
    return ("\n\n".join(documents) + "\n").encode("utf-8")


def reflow(text: str) -> str:
    """Paragraphs (split at blank lines) with their whitespace runs made single spaces."""
    paragraphs = (" ".join(block.split()) for block in text.replace("\f", "\n\n").split("\n\n"))
    return "\n".join(p for p in paragraphs if p)


def word_starts(text: torch.Tensor, window_tokens: int) -> torch.Tensor:
    """Offsets where a word begins (after a space or newline) and a whole window fits."""
    after_space = (text[:-1] == ord(" ")) | (text[:-1] == ord("\n"))
    starts = torch.nonzero(after_space).flatten() + 1
    return starts[starts + window_tokens + 1 <= len(text)]


def sample_windows(
    text: torch.Tensor, starts: torch.Tensor, count: int, length: int, gen: torch.Generator
) -> list[list[int]]:
    picks = torch.randint(len(starts), (count,), generator=gen)
    return [text[s : s + length + 1].tolist() for s in starts[picks].tolist()]


# --- parameters --------------------------------------------------------------------------------


def initial_params(model: DSV4Config, seed: int) -> Params:
    """init_weights, made friendlier to train: unit norm gains, a head of unit logit spread,
    zero router biases and sinks. Every float tensor but the router biases (balanced, not
    learned) requires grad; hash tables stay."""
    params = init_weights(model, seed)
    for name, t in params.items():
        if name.endswith(NORM_SUFFIXES):
            t.fill_(1.0)
        elif name.endswith(("gate.bias", "attn_sink")):
            t.zero_()
        elif name == "head.weight":
            t.mul_(0.25)  # init_weights spreads the head 4x for untrained greedy tests
    for name, t in params.items():
        if not name.endswith((*INTEGER_SUFFIXES, "gate.bias")):
            t.requires_grad_(True)
    return params


def make_optimizer(params: Params, cfg: TrainConfig) -> torch.optim.AdamW:
    trained = _trained(params)
    decayed = [t for t in trained if t.ndim >= 2]
    plain = [t for t in trained if t.ndim < 2]
    groups = [
        {"params": decayed, "weight_decay": cfg.weight_decay},
        {"params": plain, "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(0.9, 0.95), eps=1e-10)


def lr_at(step: int, total_steps: int, cfg: TrainConfig) -> float:
    """Linear warm-up, then cosine decay to lr x min_lr_ratio at the last step."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    span = max(total_steps - cfg.warmup_steps, 1)
    progress = min((step - cfg.warmup_steps) / span, 1.0)
    floor = cfg.lr * cfg.min_lr_ratio
    return floor + (cfg.lr - floor) * 0.5 * (1 + math.cos(math.pi * progress))


# --- what the LM loss does not train: router biases, lightning indexers -----------------------


@dataclass(slots=True)
class Probe:
    """What one forward saw: the inputs of its CSA layers' attention, the experts' loads."""

    sparse_inputs: list[tuple[int, torch.Tensor]] = field(default_factory=list)
    loads: dict[int, torch.Tensor] = field(default_factory=dict)


@contextlib.contextmanager
def probing(model: DSV4Config) -> Iterator[Probe]:
    """Record, during the oracle forwards inside the block, each CSA layer's attention input
    and each top-k layer's expert counts (hash layers route by table: no bias)."""
    probe = Probe()
    attention, route = oracle._dsv4_attention, moe.route

    def recording_attention(
        m: DSV4Config,
        p: Mapping[str, torch.Tensor],
        layer: int,
        x: torch.Tensor,
        positions: torch.Tensor,
        request_state: oracle.RequestState,
    ) -> torch.Tensor:
        if m.compress_ratios[layer] == m.sparse_ratio:
            probe.sparse_inputs.append((layer, x.detach()))
        return attention(m, p, layer, x, positions, request_state)

    def counting_route(
        m: DSV4Config, p: Mapping[str, torch.Tensor], layer: int, x: torch.Tensor, ids: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        chosen, weights = route(m, p, layer, x, ids)
        if layer >= m.arch.num_hash_layers:
            counts = torch.bincount(chosen.flatten(), minlength=m.weights.num_routed_experts)
            probe.loads[layer] = probe.loads.get(layer, torch.zeros_like(counts)) + counts
        return chosen, weights

    oracle._dsv4_attention, moe.route = recording_attention, counting_route
    try:
        yield probe
    finally:
        oracle._dsv4_attention, moe.route = attention, route


def indexer_kl(m: DSV4Config, p: Params, layer: int, x: torch.Tensor) -> torch.Tensor:
    """KL(main attention over the compressed blocks, summed over heads || softmax of the
    indexer's scores), over the positions that see at least one block; trains the indexer
    (its projections and compressor) only."""
    positions = torch.arange(len(x))
    ratio = m.compress_ratios[layer]
    held = ModelParams.of(p)  # the same tensors (autograd flows through them)
    with torch.no_grad():
        q, latent = A.query(m, held, layer, x, positions, layer_freq(m, layer, x.device))
        rows = oracle.compressed_rows(m, p, layer, x, positions)
        blocks = torch.arange(len(rows))
        available = (blocks[None, :] + 1) * ratio - 1 <= positions[:, None]
        seen = available.any(dim=-1)
        logits = torch.einsum("thd,cd->thc", q, rows) * q.shape[-1] ** -0.5
        logits = logits.masked_fill(~available[:, None, :], float("-inf"))
        target = torch.softmax(logits[seen], dim=-1).sum(dim=1)
        target = target / target.sum(dim=-1, keepdim=True)
    keys = oracle.compressed_rows(m, p, layer, x, positions, indexer=True)
    iq, iw = I.query(m, held, layer, x, latent, positions, compress_freq(m, x.device))
    scores = I.scores(iq, iw, keys).masked_fill(~available, float("-inf"))[seen]
    log_pred = torch.log_softmax(scores, dim=-1).masked_fill(~available[seen], 0.0)
    return (target * (target.clamp_min(1e-30).log() - log_pred)).sum(dim=-1).mean()


def balance_biases(model: DSV4Config, p: Params, loads: torch.Tensor, step_size: float) -> None:
    """Each top-k layer's overloaded experts' biases down by `step_size`, underloaded ones'
    up (`loads` [layers, experts]: tokens routed to each expert in the step)."""
    with torch.no_grad():
        for layer in range(model.arch.num_hash_layers, model.num_hidden_layers):
            counts = loads[layer].to(torch.float64)
            p[f"layers.{layer}.ffn.gate.bias"].sub_(step_size * torch.sign(counts - counts.mean()))


# --- the loop ------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Workers:
    """This process's place among the data-parallel workers (one CPU thread each): every
    worker draws the same windows, computes the gradients of its share, and the sums make
    every worker take the same step."""

    rank: int = 0
    world: int = 1

    def sum(self, t: torch.Tensor) -> torch.Tensor:
        if self.world > 1:
            dist.all_reduce(t)
        return t

    def from_first(self, value: int) -> int:
        t = torch.tensor([value])
        if self.world > 1:
            dist.broadcast(t, src=0)
        return int(t)

    def log(self, line: str) -> None:
        if self.rank == 0:
            print(line, flush=True)


def train(model: DSV4Config, text: bytes, cfg: TrainConfig, workers: Workers) -> TrainResult:
    data = torch.tensor(list(text), dtype=torch.long)
    split = int(len(data) * (1 - HELD_OUT))
    train_starts = word_starts(data[:split], cfg.window_tokens)
    val_starts = word_starts(data[split:], cfg.window_tokens)
    val_gen = torch.Generator().manual_seed(cfg.seed + 1)
    val_batch = sample_windows(
        data[split:], val_starts, cfg.val_windows, cfg.window_tokens, val_gen
    )
    gen = torch.Generator().manual_seed(cfg.seed)
    params = initial_params(model, cfg.seed)
    opt = make_optimizer(params, cfg)
    total_steps = cfg.steps or cfg.warmup_steps
    start = time.perf_counter()
    losses: list[float] = []
    curve: list[tuple[int, float, float]] = []
    step = 0
    train_loss = val_loss = timed_from = float("nan")
    while step < total_steps:
        for group in opt.param_groups:
            group["lr"] = lr_at(step, total_steps, cfg)
        batch = sample_windows(data, train_starts, cfg.windows_per_step, cfg.window_tokens, gen)
        share = batch[workers.rank :: workers.world]
        stats, loads = _step_gradients(model, params, share, len(batch), cfg)
        _sum_gradients(params, workers)
        stats, loads = workers.sum(stats), workers.sum(loads)
        torch.nn.utils.clip_grad_norm_(_trained(params), cfg.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        balance_biases(model, params, loads, cfg.bias_step)
        losses.append(float(stats[0]) / len(batch))
        step += 1
        elapsed = time.perf_counter() - start
        if step == CALIBRATION_STEPS[0]:
            timed_from = elapsed
        if cfg.steps is None and step == CALIBRATION_STEPS[1]:
            per_step = (elapsed - timed_from) / (CALIBRATION_STEPS[1] - CALIBRATION_STEPS[0])
            planned = max(step, int(cfg.minutes * 60 * TIME_SHARE_TRAINING / per_step))
            total_steps = workers.from_first(planned)
            workers.log(f"{per_step:.2f} s/step: training {total_steps} steps")
        if workers.rank == 0 and (step % cfg.log_every == 0 or step == total_steps):
            train_loss = sum(losses) / len(losses)
            losses.clear()
            val_loss = validation_loss(model, params, val_batch)
            curve.append((step, train_loss, val_loss))
            tokens = step * len(batch) * cfg.window_tokens
            workers.log(
                f"step {step:5d}/{total_steps}  loss {train_loss:.3f}  val {val_loss:.3f}  "
                f"indexer kl {float(stats[1]) / len(batch):.3f}  "
                f"lr {lr_at(step - 1, total_steps, cfg):.2e}  {tokens / elapsed:.0f} tok/s  "
                f"{elapsed:.0f}s"
            )
        if workers.rank == 0 and step % cfg.sample_every == 0:
            workers.log(f"  sample: {greedy_text(model, params, PROMPTS[0], 60)!r}")
    trained = {n: t.detach() for n, t in params.items()}
    seconds = time.perf_counter() - start
    return TrainResult(trained, step, seconds, train_loss, val_loss, curve)


def _trained(params: Params) -> list[torch.Tensor]:
    return [t for _, t in sorted(params.items()) if t.requires_grad]


def _step_gradients(
    model: DSV4Config,
    params: Params,
    windows: Sequence[Sequence[int]],
    batch_windows: int,
    cfg: TrainConfig,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Accumulate the gradients of this worker's windows, each loss / `batch_windows`:
    ([summed LM loss, summed indexer KL], expert loads [layers, experts])."""
    stats = torch.zeros(2, dtype=torch.float64)
    w = model.weights
    loads = torch.zeros(model.num_hidden_layers, w.num_routed_experts, dtype=torch.long)
    for window in windows:
        with probing(model) as probe:
            logits = oracle.oracle_logits(model, params, window[:-1])
        loss = F.cross_entropy(logits, torch.tensor(window[1:]))
        kl = sum(
            (indexer_kl(model, params, layer, x) for layer, x in probe.sparse_inputs),
            torch.zeros((), dtype=logits.dtype),
        )
        torch.autograd.backward((loss + cfg.indexer_loss_weight * kl) / batch_windows)
        stats += torch.stack([loss.detach(), kl.detach()])
        for layer, counts in probe.loads.items():
            loads[layer] += counts
    return stats, loads


def _sum_gradients(params: Params, workers: Workers) -> None:
    """Every trained tensor's gradient summed over the workers (an expert no window chose
    has a zero gradient, not none, so that every worker steps alike)."""
    tensors = _trained(params)
    grads = [t.grad if t.grad is not None else torch.zeros_like(t) for t in tensors]
    flat = workers.sum(torch.cat([g.flatten() for g in grads]))
    offset = 0
    for t in tensors:
        t.grad = flat[offset : offset + t.numel()].view_as(t).clone()
        offset += t.numel()


def validation_loss(model: DSV4Config, params: Params, batch: Sequence[Sequence[int]]) -> float:
    with torch.no_grad():
        losses = [
            float(F.cross_entropy(oracle.oracle_logits(model, params, w[:-1]), torch.tensor(w[1:])))
            for w in batch
        ]
    return sum(losses) / len(losses)


def greedy_text(model: DSV4Config, params: Params, prompt: str, new_tokens: int) -> str:
    with torch.no_grad():
        ids = oracle.oracle_greedy(model, params, list(prompt.encode()), new_tokens)
    return prompt + bytes(ids).decode("utf-8", errors="replace")


# --- output --------------------------------------------------------------------------------------


def write_readme(
    out: Path,
    result: TrainResult,
    cfg: TrainConfig,
    workers: int,
    text: bytes,
    samples: Sequence[str],
) -> None:
    rows = [r for r in result.curve if r[0] % 100 == 0 or r[0] == result.steps]
    curve = "\n".join(f"| {s} | {t:.3f} | {v:.3f} |" for s, t, v in rows)
    shown = "\n".join(f"    {s!r}" for s in samples)
    digest = hashlib.sha256(text).hexdigest()
    command = (
        f"scripts/train_tiny.py --seed {cfg.seed} --steps {result.steps} --workers {workers} "
        f"--lr {cfg.lr:g} --window-tokens {cfg.window_tokens} "
        f"--windows-per-step {cfg.windows_per_step}"
    )
    facts = [
        f"text: {TEXT_SOURCE}, {len(text)} bytes after reflowing paragraphs (sha256 "
        f"{digest[:16]}...), the last {HELD_OUT:.0%} held out",
        f"trained by `{command}` (which reproduces it): {result.steps} steps of "
        f"{cfg.windows_per_step} windows x {cfg.window_tokens} bytes, AdamW lr {cfg.lr:g} "
        f"(cosine), {result.seconds / 60:.1f} minutes on {workers} single-thread CPU workers",
        f"final loss {result.train_loss:.3f} nats/byte (train), {result.val_loss:.3f} (held out)",
        f"written {datetime.date.today().isoformat()}",
    ]
    bullets = "\n".join(
        textwrap.fill(f, 96, initial_indent="- ", subsequent_indent="  ", break_on_hyphens=False)
        for f in facts
    )
    (out / "README.md").write_text(
        f"""# tiny: a DeepSeek-V4 of the `tiny` preset, trained on English bytes

The architecture is the `tiny` preset (dsv4_common.core.presets.tiny: 6 layers, hidden 64,
ratios 0/4/16, 4 routed experts + 1 shared, 2 residual streams), written in the published
DeepSeek-V4 format (config.json, model.safetensors.index.json, float32 shards). There are no
MTP weights. Tokens are bytes (id = byte value): serve it with the built-in byte tokenizer,
`dsv4 serve --model <this directory>` without a tokenizer.json. config.json also carries
transformers' `layer_types` and `compress_rates` (HCA 16): transformers (5.24) maps a
release's compress_ratios by a fixed table of 0, 4 and 128 only, and with them loads this
directory as it is (`AutoModelForCausalLM.from_pretrained`).

{bullets}

Greedy continuations (60 bytes) of the stored (float32) weights:

{shown}

| step | train loss | held-out loss |
| ---- | ---------- | ------------- |
{curve}
"""
    )


def parse_args(argv: Sequence[str]) -> tuple[TrainConfig, Path, int]:
    d = TrainConfig()
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--minutes", type=float, default=d.minutes)
    parser.add_argument("--steps", type=int, default=None, help="exact steps (overrides minutes)")
    parser.add_argument("--seed", type=int, default=d.seed)
    parser.add_argument("--lr", type=float, default=d.lr)
    parser.add_argument("--window-tokens", type=int, default=d.window_tokens)
    parser.add_argument("--windows-per-step", type=int, default=d.windows_per_step)
    parser.add_argument("--workers", type=int, default=2, help="processes, one thread each")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args(argv)
    cfg = TrainConfig(
        seed=args.seed,
        steps=args.steps,
        minutes=args.minutes,
        lr=args.lr,
        window_tokens=args.window_tokens,
        windows_per_step=args.windows_per_step,
    )
    if args.workers < 1 or cfg.windows_per_step % args.workers:
        parser.error("--workers must divide --windows-per-step")
    return cfg, args.out, args.workers


def run(rank: int, world: int, cfg: TrainConfig, out: Path, rendezvous: str) -> None:
    """One worker: train (rank 0 logs, validates and writes the directory)."""
    torch.set_num_threads(1)  # deterministic, and fastest for these small tensors
    if world > 1:
        dist.init_process_group("gloo", init_method=rendezvous, rank=rank, world_size=world)
    workers = Workers(rank, world)
    model = tiny()
    text = read_text()
    workers.log(f"text: {len(text)} bytes from {TEXT_DIR}; {world} worker(s)")
    result = train(model, text, cfg, workers)
    if world > 1:
        dist.destroy_process_group()
    if rank != 0:
        return
    write_model_dir(out, model, result.params)
    stored = {n: t.to(torch.float32).to(t.dtype) for n, t in result.params.items()}
    samples = [greedy_text(model, stored, prompt, 60) for prompt in PROMPTS]
    for sample in samples:
        print(f"greedy: {sample!r}")
    write_readme(out, result, cfg, world, text, samples)
    size_bytes = sum(p.stat().st_size for p in out.iterdir())
    print(f"wrote {out} ({size_bytes / 1e6:.1f} MB)")


def main(argv: Sequence[str] | None = None) -> int:
    cfg, out, world = parse_args(sys.argv[1:] if argv is None else argv)
    if world == 1:
        run(0, 1, cfg, out, "")
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        rendezvous = f"file://{tmp}/rendezvous"
        spawn(run, args=(world, cfg, out, rendezvous), nprocs=world)  # type: ignore[no-untyped-call]
    return 0


if __name__ == "__main__":
    sys.exit(main())
