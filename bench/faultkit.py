"""Fault injection on a real `dsv4 up` deployment (loopback, CPU), shared by bench/faults.py,
bench/soak.py and local/tests/test_fault_matrix.py (issue #25).

    with Deployment.start("tiny-pd.yaml", workdir) as dep:
        with Load(dep.api_url, clients=4) as load:
            load.wait_in_flight(10.0)
            window = inject(dep, FAULTS["decode-kill"], stop_s=3.0)
        report = judge(load.records, window)

A client request is judged by what it heard: `ok` (2xx, streams ending with [DONE] and no error
event), `error` (an error status, or an error event), `reset` (the connection broke after it was
accepted, with no error event), `refused` (no connection was made: nothing listened, or the
handshake was reset as the listener closed), `timeout` (nothing heard for the
client's timeout). Its longest silence (start, or the fault's end if later, to a byte or the
end) is what "answered within 5 s" is judged on: a stream that keeps sending tokens is being
answered. A client that disconnects on purpose mid-request ends `left`. Side effects:
processes, signals, loopback HTTP; the judging is pure.
"""

from __future__ import annotations

import contextlib
import errno
import http.client
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final, Literal

SAMPLES: Final = Path(__file__).resolve().parents[1] / "crds" / "samples"
START_S: Final = 300.0  # a cold start of every process on a loaded 2-core machine
PARENT: Final = "up"  # the fault target that is `dsv4 up` itself

Action = Literal["kill", "stop"]
Kind = Literal["ok", "error", "reset", "refused", "timeout", "left"]


@dataclass(frozen=True, slots=True)
class Fault:
    sample: str  # under crds/samples
    target: str  # a process name of the deployment (status.json), or PARENT
    action: Action  # kill: SIGKILL; stop: SIGSTOP, stop_s, SIGCONT

    @property
    def name(self) -> str:
        return f"{self.target}-{self.action}"

    @property
    def restarts(self) -> bool:
        """Whether the supervisor restarts the target (a killed child)."""
        return self.action == "kill" and self.target != PARENT


def _matrix() -> dict[str, Fault]:
    targets = [
        ("tiny-pd.yaml", "router"),
        ("tiny-pd.yaml", "prefill-0"),
        ("tiny-pd.yaml", "decode-0"),
        ("tiny-pp.yaml", "prefill-0-rank-1"),  # a PP stage that is not its group's leader
        ("tiny-pp.yaml", "decode-0-rank-1"),
        ("tiny-pd.yaml", PARENT),
    ]
    faults = [Fault(s, t, a) for s, t in targets for a in ("kill", "stop")]
    return {f.name: f for f in faults}


FAULTS: Final = _matrix()


@dataclass(frozen=True, slots=True)
class Window:
    """When a fault began and ended (equal for a kill), on time.monotonic()."""

    fault_s: float
    end_s: float


# ---- the deployment ------------------------------------------------------------------------


def wait_until(condition: Callable[[], bool], what: str, timeout_s: float) -> float:
    """Poll `condition` until it holds; its monotonic time then. AssertionError past the
    deadline."""
    deadline_s = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline_s:
            raise AssertionError(f"timed out after {timeout_s:g} s waiting for {what}")
        time.sleep(0.05)
    return time.monotonic()


def is_gone(pid: int) -> bool:
    """No such process, or only its zombie."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return True
    return stat.rsplit(")", 1)[1].split()[0] == "Z"


def processes_naming(text: str) -> list[int]:
    """Live processes (not zombies) whose command line contains `text` (a workdir: every
    process `dsv4 up` starts names its config directory under it)."""
    needle = text.encode()
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        with contextlib.suppress(OSError):
            if needle in (entry / "cmdline").read_bytes() and not is_gone(int(entry.name)):
                found.append(int(entry.name))
    return found


@dataclass
class Deployment:
    """`dsv4 up SAMPLE --port 0 --workdir DIR` in its own process; stdout/stderr in DIR."""

    popen: subprocess.Popen[bytes]
    workdir: Path
    seen_pids: set[int] = field(default_factory=set)

    @classmethod
    @contextlib.contextmanager
    def start(
        cls, sample: str | Path, workdir: Path, timeout_s: float = START_S
    ) -> Iterator[Deployment]:
        """`sample`: a file name under crds/samples, or a CR's path."""
        workdir.mkdir(parents=True, exist_ok=True)
        argv = [sys.executable, "-m", "dsv4_cli", "up", str(SAMPLES / sample)]
        argv += ["--port", "0", "--workdir", str(workdir)]
        with (workdir / "up.out").open("wb") as out, (workdir / "up.err").open("wb") as err:
            popen = subprocess.Popen(argv, stdout=out, stderr=err)
        dep = cls(popen, workdir)
        try:
            wait_until(
                lambda: "Ctrl-C stops every process" in dep.err() or popen.poll() is not None,
                "dsv4 up to be ready",
                timeout_s,
            )
            if popen.poll() is not None:
                raise AssertionError(f"dsv4 up exited with {popen.returncode}:\n{dep.err()}")
            dep.pids()
            yield dep
        finally:
            dep.stop()

    def stop(self) -> None:
        """SIGTERM `dsv4 up` (SIGCONT first, in case a fault left it stopped); SIGKILL what
        is left after its grace, `dsv4 up`'s children included."""
        if self.popen.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.popen.pid, signal.SIGCONT)
                self.popen.send_signal(signal.SIGTERM)
            try:
                self.popen.wait(timeout=120)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait()
        for pid in processes_naming(str(self.workdir)):  # a safety net, not a check
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)
                os.kill(pid, signal.SIGKILL)

    def out(self) -> str:
        return (self.workdir / "up.out").read_text()

    def err(self) -> str:
        return (self.workdir / "up.err").read_text()

    def url(self, kind: Literal["api", "status"], name: str) -> str:
        match = re.search(rf"^{kind}: +{re.escape(name)} +(\S+)", self.out(), re.M)
        if match is None:
            raise AssertionError(f"no {kind} URL for {name} in:\n{self.out()}")
        return match.group(1)

    @property
    def api_url(self) -> str:
        return self.url("api", "router")

    def worker_metrics_urls(self) -> dict[str, str]:
        """Every worker process's /metrics (on its status port), by process name."""
        found = re.findall(r"^status: +(\S+) +(\S+)/status$", self.out(), re.M)
        return {name: f"{url}/metrics" for name, url in found if name != "router"}

    def units(self) -> dict[str, dict[str, Any]]:
        doc = json.loads((self.workdir / "status.json").read_text())
        units = {u["name"]: u for u in doc["units"]}
        for unit in units.values():
            self.seen_pids.update(unit["pids"].values())
        return units

    def pids(self) -> dict[str, int]:
        """The process of every name, from the supervisor's status file."""
        return {n: p for u in self.units().values() for n, p in u["pids"].items()}

    def unit_of(self, name: str) -> str:
        return next(u for u, d in self.units().items() if name in d["members"])

    def restarts(self, name: str) -> int:
        return int(self.units()[self.unit_of(name)]["restarts"])

    def ready_again(self, name: str, restarts: int) -> bool:
        """The unit of process `name` was restarted `restarts` times and is ready."""
        unit = self.units()[self.unit_of(name)]
        return bool(unit["restarts"] >= restarts and unit["state"] == "ready")


def inject(dep: Deployment, fault: Fault, stop_s: float) -> Window:
    pid = dep.popen.pid if fault.target == PARENT else dep.pids()[fault.target]
    if fault.action == "kill":
        os.kill(pid, signal.SIGKILL)
        now_s = time.monotonic()
        return Window(now_s, now_s)
    os.kill(pid, signal.SIGSTOP)
    fault_s = time.monotonic()
    try:
        time.sleep(stop_s)
    finally:
        os.kill(pid, signal.SIGCONT)
    return Window(fault_s, time.monotonic())


# ---- clients ------------------------------------------------------------------------------


@dataclass(slots=True)
class Record:
    """One client request, times on time.monotonic()."""

    started_s: float
    stream: bool
    ended_s: float | None = None
    kind: Kind | None = None  # None while in flight
    status: int = 0
    retry_after: str | None = None
    first_byte_s: float | None = None
    byte_times_s: list[float] = field(default_factory=list)  # when each chunk arrived
    detail: str = ""

    def heard_at(self) -> list[float]:
        """When the client heard anything: each chunk and the end."""
        return [*self.byte_times_s, *([self.ended_s] if self.ended_s is not None else [])]

    def longest_silence_s(self, since_s: float, now_s: float) -> float:
        """The longest gap with nothing heard, counted from max(start, since_s) up to the end
        (or `now_s` while in flight)."""
        last_s = max(self.started_s, since_s)
        worst_s = 0.0
        for t in [*self.heard_at(), *([] if self.ended_s is not None else [now_s])]:
            if t > last_s:
                worst_s = max(worst_s, t - last_s)
                last_s = t
        return worst_s


def completion(
    api_url: str,
    body: dict[str, Any],
    timeout_s: float,
    record: Record,
    leave_after_s: float | None = None,
) -> None:
    """POST /v1/completions and fill `record` as the answer comes. `timeout_s`: the longest
    wait for any byte. `leave_after_s`: close the connection that long after the start (a
    client that leaves mid-request; `left` unless the answer was complete by then)."""
    host, port = api_url.removeprefix("http://").rsplit(":", 1)
    wait_s = timeout_s if leave_after_s is None else min(timeout_s, leave_after_s)
    conn = http.client.HTTPConnection(host, int(port), timeout=wait_s)
    leave_at_s = record.started_s + (float("inf") if leave_after_s is None else leave_after_s)
    kind: Kind = "ok"
    connected = False
    try:
        conn.connect()
        connected = True
        conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "text/json"})
        resp = conn.getresponse()
        record.status = resp.status
        record.retry_after = resp.getheader("Retry-After")
        record.first_byte_s = time.monotonic()
        record.byte_times_s.append(record.first_byte_s)
        if resp.status >= 300:
            record.detail = resp.read().decode("utf-8", "replace")[:300]
            kind = "error"
        elif body.get("stream"):
            kind = _read_stream(resp, record, leave_at_s)
        else:
            doc = json.loads(resp.read())
            kind = "error" if "error" in doc else "ok"
    except TimeoutError:
        kind = "left" if time.monotonic() >= leave_at_s else "timeout"
    except (OSError, http.client.HTTPException, ValueError) as exc:
        refused = (
            not connected
            or isinstance(exc, ConnectionRefusedError)
            or getattr(exc, "errno", None) == errno.ECONNREFUSED
        )
        kind = "refused" if refused else "reset"
        record.detail = repr(exc)[:300]
    finally:
        conn.close()
    record.ended_s = time.monotonic()
    record.kind = kind


def _read_stream(resp: http.client.HTTPResponse, record: Record, leave_at_s: float) -> Kind:
    """Read SSE lines to [DONE]: `error` after an error event, `reset` if the stream ends
    before [DONE], `left` once the client leaves."""
    kind: Kind = "ok"
    while True:
        if time.monotonic() >= leave_at_s:
            return "left"
        line = resp.readline()
        if not line:
            record.detail = record.detail or "the stream ended without [DONE]"
            return "reset" if kind == "ok" else kind
        record.byte_times_s.append(time.monotonic())
        data = line.strip().removeprefix(b"data:").strip()
        if data == b"[DONE]":
            return kind
        if data.startswith(b"{") and b'"error"' in data:
            kind = "error"
            record.detail = data.decode("utf-8", "replace")[:300]


def short_request_ok(api_url: str, timeout_s: float = 10.0) -> bool:
    record = Record(time.monotonic(), stream=False)
    completion(api_url, body(4, stream=False), timeout_s, record)
    return record.kind == "ok"


def body(
    max_tokens: int, *, stream: bool, prompt: str = "This License applies to"
) -> dict[str, Any]:
    return {
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": stream,
    }


class Load:
    """`clients` threads, each sending requests back to back until the block ends: streams of
    `max_tokens` tokens, every fourth client plain requests of 8 tokens (`plain`: every client
    plain requests of 4 tokens, a probe). Every request is in `records`."""

    def __init__(
        self,
        api_url: str,
        clients: int,
        *,
        max_tokens: int = 96,
        plain: bool = False,
        timeout_s: float = 30.0,
        pause_s: float = 0.05,
        failed_pause_s: float = 0.2,
    ) -> None:
        self.api_url = api_url
        self.max_tokens = max_tokens
        self.plain = plain
        self.timeout_s = timeout_s
        self.pause_s = pause_s
        self.failed_pause_s = failed_pause_s
        self.records: list[Record] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._threads = [
            threading.Thread(target=self._run, args=(i,), daemon=True) for i in range(clients)
        ]

    def __enter__(self) -> Load:
        for thread in self._threads:
            thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def stop(self) -> None:
        """No new requests; waits for the ones in flight (each ends within its timeout)."""
        self._stop.set()
        for thread in self._threads:
            thread.join(timeout=self.timeout_s + 10)

    def _run(self, index: int) -> None:
        stream = not self.plain and index % 4 != 3
        tokens = self.max_tokens if stream else 4 if self.plain else 8
        while not self._stop.is_set():
            record = Record(time.monotonic(), stream=stream)
            with self._lock:
                self.records.append(record)
            completion(self.api_url, body(tokens, stream=stream), self.timeout_s, record)
            self._stop.wait(self.pause_s if record.kind == "ok" else self.failed_pause_s)

    def snapshot(self) -> list[Record]:
        with self._lock:
            return list(self.records)

    def wait_in_flight(self, timeout_s: float) -> None:
        """Until a stream has sent its first token and is still going."""
        wait_until(
            lambda: any(
                r.stream and r.first_byte_s is not None and r.ended_s is None
                for r in self.snapshot()
            ),
            "a stream in flight",
            timeout_s,
        )

    def first_ok_after(self, since_s: float) -> float | None:
        """When the first request started at or after `since_s` ended ok."""
        ends = [
            r.ended_s
            for r in self.snapshot()
            if r.kind == "ok" and r.started_s >= since_s and r.ended_s is not None
        ]
        return min(ends, default=None)


# ---- judging ------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Verdict:
    """What the clients of one fault heard (times in s from the fault's start)."""

    in_flight: int  # requests started before the fault that had not ended at it
    kinds: dict[str, int]  # every request of the run, by kind
    longest_silence_s: float  # over requests alive at or after the fault's end
    error_after_s: float | None  # the first non-ok answer of a request alive at the fault
    recovery_after_s: float | None  # the first ok of a request started after the fault ended
    bad: tuple[str, ...]  # one line per request that broke a rule

    def ok(self) -> bool:
        return not self.bad


def judge(
    records: list[Record],
    window: Window,
    *,
    allowed: frozenset[Kind],
    silence_limit_s: float,
    now_s: float,
) -> Verdict:
    """Every request alive at or after the fault's start: nothing heard for at most
    `silence_limit_s` (counted from the fault's end), and an outcome among `allowed`; an
    error status needs Retry-After when it is 502 or 503."""
    kinds: dict[str, int] = {}
    bad = []
    in_flight = 0
    worst_s = 0.0
    errors: list[float] = []
    recoveries: list[float] = []
    for r in records:
        kinds[r.kind or "in flight"] = kinds.get(r.kind or "in flight", 0) + 1
        if r.ended_s is not None and r.ended_s < window.fault_s:
            continue
        if r.started_s < window.fault_s:
            in_flight += 1
        silence_s = r.longest_silence_s(window.end_s, now_s)
        worst_s = max(worst_s, silence_s)
        what = f"request started {r.started_s - window.fault_s:+.2f} s"
        if silence_s > silence_limit_s:
            bad.append(f"{what}: nothing heard for {silence_s:.1f} s ({r.kind or 'in flight'})")
        if r.kind is not None and r.kind not in allowed:
            bad.append(f"{what}: {r.kind} (status {r.status}) {r.detail}")
        if r.status in (502, 503) and r.retry_after is None:
            bad.append(f"{what}: {r.status} without Retry-After")
        if r.ended_s is None:
            continue
        if r.kind != "ok" and r.started_s < window.end_s:
            errors.append(r.ended_s - window.fault_s)
        if r.kind == "ok" and r.started_s >= window.end_s:
            recoveries.append(r.ended_s - window.fault_s)
    return Verdict(
        in_flight=in_flight,
        kinds=kinds,
        longest_silence_s=worst_s,
        error_after_s=min(errors, default=None),
        recovery_after_s=min(recoveries, default=None),
        bad=tuple(bad),
    )


def allowed_kinds(fault: Fault) -> frozenset[Kind]:
    """What a client may hear: 2xx or an error answer; a dead or stopping router (or `dsv4 up`
    stopping it) may also refuse connections, and a killed router breaks them."""
    kinds: set[Kind] = {"ok", "error"}
    if fault.target in ("router", PARENT):
        kinds.add("refused")
    if fault.target == "router" and fault.action == "kill":
        kinds.add("reset")
    return frozenset(kinds)


# ---- KV pages -----------------------------------------------------------------------------

_USED = re.compile(r'^dsv4_kv_used_pages\{pool="(\w+)"\} (\S+)$', re.M)


def used_pages(metrics_url: str, timeout_s: float = 5.0) -> dict[str, float] | None:
    """dsv4_kv_used_pages by pool; None when the worker does not answer."""
    host, rest = metrics_url.removeprefix("http://").split(":", 1)
    port, path = rest.split("/", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=timeout_s)
    try:
        conn.request("GET", "/" + path)
        text = conn.getresponse().read().decode()
    except (OSError, http.client.HTTPException):
        return None
    finally:
        conn.close()
    return {pool: float(value) for pool, value in _USED.findall(text)}


def pages_in_use(dep: Deployment) -> dict[str, dict[str, float] | None]:
    """Every worker's pages in use, by process name (only the pools with any)."""
    found: dict[str, dict[str, float] | None] = {}
    for name, url in dep.worker_metrics_urls().items():
        pools = used_pages(url)
        found[name] = None if pools is None else {p: v for p, v in pools.items() if v}
    return found


def wait_idle_pages(dep: Deployment, timeout_s: float) -> dict[str, dict[str, float] | None]:
    """Poll until every worker answers with 0 pages in use; what it read last."""
    last: dict[str, dict[str, float] | None] = {}

    def idle() -> bool:
        nonlocal last
        last = pages_in_use(dep)
        return all(v == {} for v in last.values())

    with contextlib.suppress(AssertionError):
        wait_until(idle, "0 KV pages in use", timeout_s)
    return last


# ---- one case of the matrix ---------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class CaseSettings:
    stop_s: float = 3.0  # how long a `stop` fault holds the process stopped
    clients: int = 4
    max_tokens: int = 96
    silence_limit_s: float = 5.0  # the longest a client may hear nothing after the fault
    client_timeout_s: float = 15.0  # a client gives up after this long without a byte
    recover_timeout_s: float = 120.0
    idle_timeout_s: float = 30.0
    gone_timeout_s: float = 60.0  # the parent killed: its children gone by then


@dataclass(frozen=True, slots=True)
class CaseResult:
    fault: Fault
    startup_s: float  # `dsv4 up` started -> every process ready
    backoff_s: float  # the supervisor's first restart delay (restarting faults)
    verdict: Verdict  # the load's clients
    ready_again_after_s: float | None  # the unit ready again, from the fault (restarts)
    recovery_after_s: float | None  # the first new request ok, from the fault's start
    restarts: int  # of the target's unit during the case
    idle_pages: dict[str, dict[str, float] | None]  # survivors' pages in use once idle
    gone_after_s: float | None  # the parent killed: every process gone, from the kill
    orphans: tuple[int, ...]  # the parent killed: processes left after gone_timeout_s
    log: str  # `dsv4 up`'s stderr

    def problems(self) -> list[str]:
        """Every rule of issue #25's matrix this case broke, one line each."""
        found = [f"client: {line}" for line in self.verdict.bad]
        if self.verdict.in_flight == 0:
            found.append("no request was in flight at the fault")
        if self.fault.target != PARENT or self.fault.action == "stop":
            if self.recovery_after_s is None:
                found.append("no new request succeeded after the fault")
            if self.fault.restarts and self.ready_again_after_s is None:
                found.append("the supervisor did not bring the unit back")
            for name, pools in self.idle_pages.items():
                if pools != {}:
                    found.append(f"{name}: KV in use once idle: {pools}")
        if self.fault.target == PARENT and self.fault.action == "stop" and self.restarts:
            found.append(f"stopping dsv4 up restarted processes ({self.restarts})")
        if self.orphans:
            found.append(f"orphans after the parent's kill: {list(self.orphans)}")
        return found


def run_case(fault: Fault, workdir: Path, settings: CaseSettings | None = None) -> CaseResult:
    """Start a deployment of the fault's sample and run the fault on it (`run_fault`)."""
    started_s = time.monotonic()
    with Deployment.start(fault.sample, workdir) as dep:
        return run_fault(dep, fault, settings, startup_s=time.monotonic() - started_s)


def run_fault(
    dep: Deployment, fault: Fault, settings: CaseSettings | None = None, *, startup_s: float
) -> CaseResult:
    """On a deployment of the fault's sample that serves (fresh, or one an earlier case left
    recovered): load it, inject the fault, wait for the recovery (or, when `dsv4 up` itself is
    killed, for every process to be gone), let the clients finish and read the KV pages once
    idle. Restarts are counted from this call's start. `startup_s`: how long the deployment
    took to start (the recovery target of a restart)."""
    cfg = settings or CaseSettings()
    workdir = dep.workdir
    wait_until(lambda: short_request_ok(dep.api_url), "a first request to succeed", 60.0)
    unit = None if fault.target == PARENT else dep.unit_of(fault.target)
    restarts_before = 0 if unit is None else dep.restarts(fault.target)
    every_restart_before = _all_restarts(dep)
    match = re.search(r"restarts with its PP group after ([\d.]+) s", dep.err())
    backoff_s = float(match.group(1)) if match else 0.0
    ready_again_s = gone_s = None
    orphans: tuple[int, ...] = ()
    timeout_s = cfg.client_timeout_s
    load = Load(dep.api_url, cfg.clients, max_tokens=cfg.max_tokens, timeout_s=timeout_s)
    probe = Load(dep.api_url, 1, plain=True, timeout_s=timeout_s)
    with load, probe:
        load.wait_in_flight(60.0)
        every_pid = set(dep.pids().values())
        window = inject(dep, fault, cfg.stop_s)
        if fault.target == PARENT and fault.action == "kill":
            dep.popen.wait()
            with contextlib.suppress(AssertionError):
                gone_s = wait_until(
                    lambda: not _leftovers(every_pid, workdir),
                    "every process to be gone",
                    cfg.gone_timeout_s,
                )
            orphans = tuple(sorted(_leftovers(every_pid, workdir)))
        else:
            if fault.restarts:
                with contextlib.suppress(AssertionError):
                    ready_again_s = wait_until(
                        lambda: dep.ready_again(fault.target, restarts_before + 1),
                        f"{unit} ready again",
                        cfg.recover_timeout_s,
                    )
            with contextlib.suppress(AssertionError):
                wait_until(
                    lambda: probe.first_ok_after(window.end_s) is not None,
                    "a new request to succeed",
                    cfg.recover_timeout_s,
                )
    now_s = time.monotonic()
    records = [*load.snapshot(), *probe.snapshot()]
    verdict = judge(
        records,
        window,
        allowed=allowed_kinds(fault),
        silence_limit_s=cfg.silence_limit_s,
        now_s=now_s,
    )
    first_ok_s = probe.first_ok_after(window.end_s)
    alive = fault.target != PARENT or fault.action == "stop"
    idle = wait_idle_pages(dep, cfg.idle_timeout_s) if alive else {}
    restarts = 0 if unit is None else dep.restarts(fault.target) - restarts_before
    if fault.target == PARENT and fault.action == "stop":
        restarts = _all_restarts(dep) - every_restart_before
    return CaseResult(
        fault=fault,
        startup_s=startup_s,
        backoff_s=backoff_s,
        verdict=verdict,
        ready_again_after_s=None if ready_again_s is None else ready_again_s - window.fault_s,
        recovery_after_s=None if first_ok_s is None else first_ok_s - window.fault_s,
        restarts=restarts,
        idle_pages=idle,
        gone_after_s=None if gone_s is None else gone_s - window.fault_s,
        orphans=orphans,
        log=dep.err(),
    )


def _all_restarts(dep: Deployment) -> int:
    return sum(int(u["restarts"]) for u in dep.units().values())


def _leftovers(pids: set[int], workdir: Path) -> set[int]:
    """Which of `pids`, and of the processes naming `workdir`, are still alive."""
    return {p for p in pids if not is_gone(p)} | set(processes_naming(str(workdir)))
