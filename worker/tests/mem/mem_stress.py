"""Randomized stress of the KV memory API, inside and outside its contract (a helper module;
`test_contract.py` runs a short stretch of it, the command line a long one).

Each step runs one operation with random arguments: mostly valid, sometimes outside the contract
(closed, reserved, negative, out-of-range or repeated slots; negative or int64-overflowing
counts; narrow integer, float or bool dtypes; another device; 0-d or 2-D shapes; non-tensors).
A step violates the contract unless it succeeds with the reference model's effect, or raises a
KVMemoryError and changes nothing. `can_extend` / `can_decode` must predict their command
exactly, and `check_integrity()` must hold after every step.

    python worker/tests/mem/mem_stress.py --ops 1000000 --seed 0
"""

from __future__ import annotations

import argparse
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from mem_helpers import memory_state, same_state, small_memory

from dsv4_worker.mem.errors import InvalidArgument, KVMemoryError, Verdict
from dsv4_worker.mem.offload import offload_request, reload_request

I64_MAX, I64_MIN = 2**63 - 1, -(2**63)
_NARROW = (torch.int32, torch.int16, torch.int8, torch.uint8)
_REFUSED = (torch.float32, torch.float64, torch.bool)
# (preset, page size, draft tokens): both families, a non-power-of-two page, speculation.
GEOMETRIES = [("tiny", 16, 0), ("tiny", 16, 2), ("hybrid-tiny", 16, 0), ("hybrid-tiny", 12, 0)]


def _ceil(n: int, p: int) -> int:
    return -(-n // p)


@dataclass
class StressReport:
    ops: int = 0
    raised: int = 0  # steps that raised a KVMemoryError (and, checked, changed nothing)
    violations: list[str] = field(default_factory=list)


@dataclass
class _Arg:
    """A generated tensor argument: `value` as passed, `ints` its int64 entries when it is a
    well-formed 1-D integer tensor on the right device (None when the API must refuse it)."""

    value: object
    ints: list[int] | None


class _Stress:
    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)
        preset, page, draft = GEOMETRIES[seed % len(GEOMETRIES)]
        self.mem = small_memory(
            preset,
            page_size=page,
            full_pages=20,
            swa_pages=9,
            slots=5,
            max_pages=6,
            draft_tokens=draft,
        )
        self.page = page
        self.lens: dict[int, int] = {}  # reference model: open request slot -> tokens
        self.report = StressReport()

    # -- argument generation ---------------------------------------------------------------------

    def _odd_int(self) -> int:
        num_slots = self.mem.config.num_request_slots
        return self.rng.choice([0, -1, -7, num_slots + 1, 2**40, I64_MAX, I64_MIN])

    def _tensor(self, values: list[int]) -> _Arg:
        """`values` as a tensor, sometimes in a narrow dtype (converted entries are what the API
        sees), sometimes malformed (must be refused)."""
        r = self.rng.random()
        base = torch.tensor(values, dtype=torch.int64)
        if r < 0.80:
            return _Arg(base, values)
        if r < 0.90:
            narrow = base.to(self.rng.choice(_NARROW))
            return _Arg(narrow, narrow.to(torch.int64).tolist())
        if r < 0.94:
            return _Arg(base.to(self.rng.choice(_REFUSED)), None)
        if r < 0.97:
            bad_shape = base.reshape(()) if len(values) == 1 else base.reshape(1, -1)
            return _Arg(bad_shape, None)
        if r < 0.99:
            return _Arg(base.to("meta"), None)
        return _Arg(values, None)

    def _slots(self, *, fresh: bool = False) -> _Arg:
        open_ = sorted(s for s, n in self.lens.items() if n == 0 or not fresh)
        r = self.rng.random()
        if open_ and r < 0.85:
            values = self.rng.sample(open_, self.rng.randint(1, len(open_)))
        elif r < 0.90:
            values = []
        else:
            values = [self._odd_int()]
            if open_ and self.rng.random() < 0.5:
                values = [*self.rng.sample(open_, 1), *values]
        if values and self.rng.random() < 0.05:
            values.append(values[0])  # repeated within the batch
        return self._tensor(values)

    def _counts(self, n: int, hi: int) -> _Arg:
        values = [self.rng.randint(0, hi) for _ in range(n)]
        r = self.rng.random()
        if values and r < 0.05:
            values[self.rng.randrange(n)] = self.rng.choice([-1, I64_MAX, I64_MIN, 2**62, 2**40])
        elif r < 0.07:
            values.append(1)  # one entry too many
        return self._tensor(values)

    # -- steps -----------------------------------------------------------------------------------

    def step(self) -> None:
        ops: list[tuple[float, Callable[[], None]]] = [
            (0.12, self._open),
            (0.10, self._free),
            (0.22, self._extend),
            (0.22, self._decode),
            (0.08, self._alloc_tail),
            (0.06, self._alloc_sparse),
            (0.08, self._evict),
            (0.05, self._request_pages),
            (0.05, self._open_pages_must_fail),
            (0.02, self._offload_reload),
        ]
        weights = [w for w, _ in ops]
        op = self.rng.choices([f for _, f in ops], weights)[0]
        op()
        self.report.ops += 1
        self._check_consistent(op.__name__)

    def _run(self, name: str, action: Callable[[], object], must_refuse: bool = False) -> bool:
        """Run `action`; True if it succeeded. A raise must be a KVMemoryError that changed
        nothing (an InvalidArgument when `must_refuse`); a success must not be `must_refuse`."""
        before = memory_state(self.mem)
        try:
            action()
        except KVMemoryError as err:
            self.report.raised += 1
            if not same_state(before, memory_state(self.mem)):
                self._violation(f"{name}: raised {err!r} but changed the state")
            if must_refuse and not isinstance(err, InvalidArgument):
                self._violation(f"{name}: malformed argument raised {err!r}, not InvalidArgument")
            return False
        except Exception as err:  # any other type is the violation looked for
            self._violation(f"{name}: raised a foreign {type(err).__name__}: {err}")
            return False
        if must_refuse:
            self._violation(f"{name}: accepted a malformed argument")
        return True

    def _agrees(self, name: str, verdict: Verdict, action: Callable[[], object]) -> bool:
        """Run the command after its query: success iff the verdict said yes, else the same
        error type and message."""
        before = memory_state(self.mem)
        try:
            action()
        except KVMemoryError as err:
            self.report.raised += 1
            if not same_state(before, memory_state(self.mem)):
                self._violation(f"{name}: raised {err!r} but changed the state")
            refusal = verdict.refusal
            if refusal is None:
                self._violation(f"{name}: can_{name} said yes, {name} raised {err!r}")
            elif type(refusal) is not type(err) or str(refusal) != str(err):
                self._violation(f"{name}: can_{name} said {refusal!r}, {name} raised {err!r}")
            return False
        except Exception as err:
            self._violation(f"{name}: raised a foreign {type(err).__name__}: {err}")
            return False
        if not verdict:
            self._violation(f"{name}: can_{name} said {verdict.refusal!r}, {name} succeeded")
        return True

    def _open(self) -> None:
        k: object = self.rng.choice([0, 1, 1, 2, 3, -1, 2**40, 1.0, True])
        got: list[int] = []
        ok = self._run(
            "open",
            lambda: got.extend(self.mem.open(k).tolist()),
            must_refuse=not isinstance(k, int) or isinstance(k, bool) or k < 0,
        )
        if ok:
            for s in got:
                if s in self.lens:
                    self._violation(f"open: slot {s} handed out twice")
                self.lens[s] = 0

    def _free(self) -> None:
        arg = self._slots()
        if self._run("free", lambda: self.mem.free(arg.value), arg.ints is None):
            for s in arg.ints or []:
                del self.lens[s]

    def _extend(self) -> None:
        slots = self._slots()
        n = len(slots.ints) if slots.ints is not None else 1
        counts = self._counts(n, self.rng.choice([3, 20, 60]))
        a = self.mem.pages
        malformed = slots.ints is None or counts.ints is None
        verdict = a.can_extend(slots.value, counts.value)
        if malformed and not isinstance(verdict.refusal, InvalidArgument):
            self._violation(f"can_extend: malformed argument gave {verdict!r}")
        expected = self._extend_fits(slots.ints, counts.ints)
        out: list[torch.Tensor] = []
        ok = self._agrees(
            "extend",
            verdict,
            lambda: out.append(a.extend(slots.value, counts.value)),
        )
        if ok != expected:
            self._violation(f"extend: {'succeeded' if ok else 'failed'}, reference {expected}")
        if ok and slots.ints is not None and counts.ints is not None:
            if out[0].numel() != sum(counts.ints):
                self._violation("extend: returned the wrong number of token slots")
            for s, k in zip(slots.ints, counts.ints, strict=True):
                self.lens[s] += k

    def _extend_fits(self, slots: list[int] | None, counts: list[int] | None) -> bool:
        """The reference model's answer for `extend` (False for malformed arguments)."""
        if slots is None or counts is None or len(slots) != len(counts):
            return False
        if len(set(slots)) != len(slots) or any(s not in self.lens for s in slots):
            return False
        limit, p = self.mem.config.max_tokens_per_request, self.page
        pairs = [(self.lens[s], k) for s, k in zip(slots, counts, strict=True)]
        if any(k < 0 or n + k > limit for n, k in pairs):
            return False
        pages = sum(_ceil(n + k, p) - _ceil(n, p) for n, k in pairs)
        a = self.mem.pages
        return pages <= min(a.full.num_free, a.swa.num_free)

    def _decode(self) -> None:
        slots = self._slots()
        a = self.mem.pages
        verdict = a.can_decode(slots.value)
        if slots.ints is None and not isinstance(verdict.refusal, InvalidArgument):
            self._violation(f"can_decode: malformed argument gave {verdict!r}")
        expected = self._decode_fits(slots.ints)
        ok = self._agrees("decode", verdict, lambda: a.decode(slots.value))
        if ok != expected:
            self._violation(f"decode: {'succeeded' if ok else 'failed'}, reference {expected}")
        if ok:
            for s in slots.ints or []:
                self.lens[s] += 1

    def _decode_fits(self, slots: list[int] | None) -> bool:
        if slots is None or len(set(slots)) != len(slots) or any(s not in self.lens for s in slots):
            return False
        if any(self.lens[s] >= self.mem.config.max_tokens_per_request for s in slots):
            return False
        rollovers = sum(self.lens[s] % self.page == 0 for s in slots)
        a = self.mem.pages
        return rollovers <= min(a.full.num_free, a.swa.num_free)

    def _alloc_tail(self) -> None:
        slots = self._slots(fresh=True)
        n = len(slots.ints) if slots.ints is not None else 1
        tokens = self._counts(n, self.mem.config.max_tokens_per_request)
        malformed = slots.ints is None or tokens.ints is None
        a = self.mem.pages
        if self._run("alloc_tail", lambda: a.alloc_tail(slots.value, tokens.value), malformed):
            for s, k in zip(slots.ints or [], tokens.ints or [], strict=True):
                self.lens[s] = k

    def _alloc_sparse(self) -> None:
        slots = self._slots(fresh=True)
        n = len(slots.ints) if slots.ints is not None else 1
        tokens = [self.rng.randint(0, self.mem.config.max_tokens_per_request) for _ in range(n)]
        keep = self.mem.config.retained_tokens
        starts = [max(0, k - keep) // self.page * self.page for k in tokens]
        if starts and self.rng.random() < 0.3:
            starts[0] = self.rng.choice([0, 1, -self.page, starts[0] + self.page, I64_MAX])
        start_arg, token_arg = self._tensor(starts), self._tensor(tokens)
        malformed = slots.ints is None or start_arg.ints is None or token_arg.ints is None
        a = self.mem.pages
        if self._run(
            "alloc_sparse",
            lambda: a.alloc_sparse(slots.value, token_arg.value, start_arg.value),
            malformed,
        ):
            for s, k in zip(slots.ints or [], token_arg.ints or [], strict=True):
                self.lens[s] = k

    def _evict(self) -> None:
        if self.rng.random() < 0.3:
            self._run("evict_window", lambda: self.mem.pages.evict_window())
            return
        slots = self._slots()
        self._run(
            "evict_window", lambda: self.mem.pages.evict_window(slots.value), slots.ints is None
        )

    def _request_pages(self) -> None:
        slot: object = self.rng.choice([*self.lens, self._odd_int(), 1.0, torch.tensor([1, 2])])
        got: list[tuple[torch.Tensor, torch.Tensor]] = []
        ok = self._run("request_pages", lambda: got.append(self.mem.pages.request_pages(slot)))
        if ok != (type(slot) is int and slot in self.lens):
            self._violation(f"request_pages({slot!r}): succeeded={ok}")
        if ok and len(got[0][0]) != _ceil(self.lens[slot], self.page):
            self._violation("request_pages: wrong number of pages")

    def _open_pages_must_fail(self) -> None:
        """`KVAllocator.open` of already-open, reserved or invalid slots (a success would
        desynchronize the request-slot allocator, so only refused calls are generated)."""
        values = [self.rng.choice([*self.lens, 0])] if self.lens and self.rng.random() < 0.5 else []
        values.append(self._odd_int())
        arg = self._tensor(values)
        if self._run("open(pages)", lambda: self.mem.pages.open(arg.value)):
            self._violation(f"KVAllocator.open({values}) succeeded")

    def _offload_reload(self) -> None:
        if not self.lens:
            return
        slot = self.rng.choice(sorted(self.lens))
        n = self.lens.pop(slot)
        snapshot = offload_request(self.mem, slot)
        self._check_consistent("offload")
        got: list[int] = []
        if self._run("reload", lambda: got.append(reload_request(self.mem, snapshot))):
            self.lens[got[0]] = n

    # -- checks ----------------------------------------------------------------------------------

    def _check_consistent(self, after: str) -> None:
        try:
            self.mem.check_integrity()
        except KVMemoryError as err:
            self._violation(f"after {after}: check_integrity: {err}")
            raise
        want = torch.full_like(self.mem.pages.num_tokens, -1)
        for s, n in self.lens.items():
            want[s] = n
        if not torch.equal(want, self.mem.pages.num_tokens):
            self._violation(f"after {after}: num_tokens differ from the reference model")
            raise AssertionError(self.report.violations[-1])

    def _violation(self, message: str) -> None:
        self.report.violations.append(f"op {self.report.ops}: {message}")


def run_stress(num_ops: int, seed: int = 0) -> StressReport:
    """`num_ops` random steps on one small memory (its geometry picked by `seed`)."""
    stress = _Stress(seed)
    for _ in range(num_ops):
        stress.step()
    return stress.report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--ops", type=int, default=100_000)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    start = time.monotonic()
    report = run_stress(args.ops, args.seed)
    elapsed = time.monotonic() - start
    print(
        f"seed {args.seed}: {report.ops} ops ({report.raised} raised) in {elapsed:.0f} s, "
        f"{len(report.violations)} violations"
    )
    for v in report.violations[:20]:
        print("  ", v)


if __name__ == "__main__":
    main()
