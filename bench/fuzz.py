"""Hostile request bodies against every surface a client reaches (issue #37 item 1): `dsv4 serve
--model tiny` (colocated) and the router of `dsv4 up tiny-pd.yaml` (prefill + decode), each
started fresh on loopback. The bodies (`hostile_bodies`, seeded) set sampling and processor
fields to their bounds, 0, denormals, values just past a bound, huge and wrong-typed values;
bring response_format schemas with `$ref` cycles, deep nesting and huge enums; malformed
JSON; prompts and messages that are empty, too long or not text. A control request ("Hello",
2 tokens) goes between them. Per surface it prints:

    bodies       hostile bodies sent (controls apart)
    2xx 4xx 5xx  their answers (an error event in a 2xx stream counts as 5xx)
    deaths       engine threads that died: `dsv4_engine_thread_deaths_total`, a `/live` that
                 failed, a `/ready` saying the engine is not running, or a process the
                 supervisor restarted
    hangs        bodies with no complete answer within --timeout-s
    leaked       KV pages still in use once idle (every worker, every pool)
    controls     control requests that did not get a 2xx

Targets (exit 1 when missed): 0 deaths, 0 hangs, 0 leaked pages, every control 2xx, and no 5xx
(every hostile body is a 4xx or is served). `--json` adds an `@bench-json` line.

    .venv/bin/python bench/fuzz.py [--surface serve --surface up-pd] [--bodies 600] [--json]
"""

from __future__ import annotations

import argparse
import contextlib
import http.client
import json
import random
import re
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

import faultkit
from benchjson import Figure, emit

TINY: Final = 5e-324
# Numbers at and around every accepted range's bounds, then out of every range.
NUMBERS: Final[tuple[Any, ...]] = (
    0, 0.0, -0.0, TINY, -TINY, 1e-310, 2.2250738585072014e-308, 1e-300, 1e-200, 1e-201,
    9.99e-6, 1e-5, 0.5, 1, 1.0000000000000002, 2, 2.0000000000000004, 20, 21, 100, 100.00001,
    -1, -2, -2.0000000000000004, -100, -100.00001, 1e308, 1.7976931348623157e308, -1e308,
    2**31, 2**53 + 1, 2**63 - 1, 2**63, 2**64, -(2**63), 10**30,
)  # fmt: skip
WRONG: Final[tuple[Any, ...]] = (None, True, False, "1", "", [], {}, [1], {"a": 1}, "NaN")
SAMPLING: Final = (
    "temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty",
    "repetition_penalty", "seed", "min_tokens", "max_tokens", "n", "logprobs", "top_logprobs",
    "best_of",
)  # fmt: skip
RAW: Final[tuple[bytes, ...]] = (
    b"", b"{", b"[]", b"null", b'{"prompt": "x", "temperature": NaN}',
    b'{"prompt": "x", "temperature": 1e999}', b'{"prompt": "x", "max_tokens": Infinity}',
    b'{"prompt": "x"' + b', "a": [' * 200 + b"]" * 200 + b"}",
    b'{"prompt": "\xff\xfe"}', b'{"prompt": "x", "prompt": "y", "max_tokens": 2}',
    b'{"prompt": "x", "max_tokens": 1' + b"0" * 5000 + b"}",
)  # fmt: skip
# Values inside each field's accepted range (generation.py's), bounds and denormals first:
# half of the bodies use only these, so the engine samples with them (not a 400 at parse).
ACCEPTED: Final[dict[str, tuple[Any, ...]]] = {
    "temperature": (0, TINY, 1e-310, 9.99e-6, 1e-5, 0.5, 1, 2),
    "top_p": (TINY, 1e-300, 0.5, 1),
    "top_k": (-1, 0, 1, 2, 511, 512, 2**63 - 1, 10**30),
    "min_p": (0, TINY, 0.5, 1),
    "presence_penalty": (-2, -TINY, 0, TINY, 2),
    "frequency_penalty": (-2, -TINY, 0, TINY, 2),
    "repetition_penalty": (TINY, 1e-300, 1e-200, 1e-201, 1, 2),
    "seed": (0, 1, 2**63 - 1),
    "min_tokens": (0, 1, 2),
    "n": (1, 2, 3),
    "logprobs": (0, 1, 5),
    "top_logprobs": (0, 20),
}
SATISFIABLE: Final[tuple[Any, ...]] = (
    {"type": "json_object"},
    {"type": "json_schema", "json_schema": {"name": "x", "schema": {"enum": ["a", "bc"]}}},
    {
        "type": "json_schema",
        "json_schema": {
            "name": "tree",
            "schema": {
                "type": "object",
                "properties": {"k": {"type": "array", "items": {"$ref": "#"}}},
            },
        },
    },
)
CONTROL: Final = {"prompt": "Hello", "max_tokens": 2, "temperature": 0}
SURFACES: Final = ("serve", "up-pd")


# ---- the bodies (pure, seeded) -------------------------------------------------------------


def _schemas(rng: random.Random) -> Any:
    deep: dict[str, Any] = {"type": "string"}
    for _ in range(rng.randint(1, 30)):
        deep = {"type": "array", "items": deep}
    choices: list[Any] = [
        {"$ref": "#"},
        {"type": "object", "properties": {"a": {"$ref": "#"}}, "required": ["a"]},
        {"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"},
        {"type": "object", "properties": {"kids": {"type": "array", "items": {"$ref": "#"}}}},
        {"$ref": "#/$defs/missing"},
        {"enum": []},
        {"enum": [f"v{i}" for i in range(rng.choice([10, 1000, 30_000]))]},
        {"allOf": [{"type": "string"}, {"type": "number"}]},
        {"type": "string", "pattern": "(a|b)*c{300}"},
        {"type": "string", "minLength": 10_000},
        {"type": "array", "items": {"type": "integer"}, "minItems": 1000},
        {"type": "nonsense"},
        deep,
        {"anyOf": [{"type": "object", "required": [f"k{i}"]} for i in range(200)]},
        [],
        "not a schema",
    ]
    schema = rng.choice(choices)
    return {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}


def _prompt(rng: random.Random) -> Any:
    return rng.choice(
        [
            "Hello",
            "",
            [],
            [[]],
            [-1],
            [10**9],
            [0] * rng.choice([1, 5000, 100_000]),
            "x" * rng.choice([10, 100_000]),
            "\ud800",
            ["a", [1, 2]],
            [[1, 2], [3]],
            {"text": "x"},
            7,
        ]
    )


def _value(rng: random.Random, key: str) -> Any:
    if key == "logit_bias":
        return rng.choice(
            [
                {str(rng.randrange(512)): rng.choice(NUMBERS) for _ in range(rng.randint(1, 4))},
                {"-1": 1},
                {"99999": 1},
                {"x": 1},
                {"1": "a"},
                [1],
                {str(i): -100 for i in range(512)},
            ]
        )
    if key == "stop":
        return rng.choice(["", "x", ["a"] * 5, [""], [7, "b"], [-1], [10**9], list("abcdefgh")])
    if key == "stop_token_ids":
        return rng.choice([[0], list(range(512)), [-1], [512], ["a"], 5])
    if key == "response_format":
        return _schemas(rng) if rng.random() < 0.8 else rng.choice([{"type": "json_object"}, 5])
    if key == "stream_options":
        return rng.choice([{"include_usage": True}, {"continuous_usage_stats": True}, {"x": 1}])
    return rng.choice(NUMBERS if rng.random() < 0.85 else WRONG)


def accepted_body(rng: random.Random, chat: bool) -> dict[str, Any]:
    """A body every field of which the API accepts, at its extremes: the engine runs it."""
    body: dict[str, Any] = {"max_tokens": rng.choice([1, 2, 4])}
    if chat:
        body["messages"] = [{"role": "user", "content": "Hello"}]
    else:
        body["prompt"] = rng.choice(["Hello", [1], [0, 255, 511]])
    for key in rng.sample(sorted(ACCEPTED), rng.randint(2, 8)):
        if key == "logprobs" and chat:
            body["logprobs"] = True  # chat: a boolean, its count is top_logprobs
        elif key == "top_logprobs":
            if chat:
                body["logprobs"], body[key] = True, rng.choice(ACCEPTED[key])
        else:
            body[key] = rng.choice(ACCEPTED[key])
    body["min_tokens"] = min(body.get("min_tokens", 0), body["max_tokens"])
    if rng.random() < 0.4:
        bias = [TINY, -TINY, 100, -100, 0.5]
        body["logit_bias"] = {str(rng.randrange(512)): rng.choice(bias) for _ in range(3)}
    if rng.random() < 0.2:
        body["response_format"] = rng.choice(SATISFIABLE)
    if rng.random() < 0.3:
        body["stream"] = True
    if rng.random() < 0.2:
        body["ignore_eos"] = True
    return body


def hostile_body(rng: random.Random) -> tuple[str, bytes]:
    """One (path, body): raw bytes now and then; half the rest accepted extremes
    (`accepted_body`), half completions or chats whose fields are bounds, denormals, values
    past a bound or of the wrong type."""
    chat = rng.random() < 0.35
    path = "/v1/chat/completions" if chat else "/v1/completions"
    if rng.random() < 0.05:
        return path, rng.choice(RAW)
    if rng.random() < 0.5:
        return path, json.dumps(accepted_body(rng, chat)).encode()
    body: dict[str, Any] = {"max_tokens": rng.choice([1, 2, 4])}
    if chat:
        messages: Any = [{"role": "user", "content": "Hello"}]
        if rng.random() < 0.2:
            messages = rng.choice(
                [[], [{"role": "nobody", "content": "x"}], [{"role": "user"}], "x", [{}]]
            )
        body["messages"] = messages
    else:
        body["prompt"] = _prompt(rng) if rng.random() < 0.2 else "Hello"
    keys = [*SAMPLING, "logit_bias", "stop", "stop_token_ids", "response_format"]
    keys += ["stream", "stream_options", "echo", "ignore_eos", "unknown_field"]
    for key in rng.sample(keys, rng.randint(1, 6)):
        if key in ("stream", "echo", "ignore_eos"):
            body[key] = rng.choice([True, False, 1, "yes"])
        else:
            body[key] = _value(rng, key)
    if body.get("stream") is True and rng.random() < 0.5:
        body["stream_options"] = {"include_usage": True}
    return path, json.dumps(body).encode()


def hostile_bodies(seed: int, count: int) -> list[tuple[str, bytes]]:
    rng = random.Random(seed)
    return [hostile_body(rng) for _ in range(count)]


# ---- one answer ------------------------------------------------------------------------------


@dataclass(slots=True)
class Answer:
    status: int = 0  # 0: no answer (a hang or a broken connection)
    error_event: bool = False  # a 2xx stream that carried an error
    hung: bool = False
    detail: str = ""


def send(url: str, path: str, body: bytes, timeout_s: float) -> Answer:
    host, port = url.removeprefix("http://").rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=timeout_s)
    try:
        conn.request("POST", path, body, {"Content-Type": "application/json"})
        resp = conn.getresponse()
        text = resp.read().decode("utf-8", "replace")
        event = resp.status < 300 and "data: {" in text and '"error"' in text
        return Answer(resp.status, event, detail=text[:300] if resp.status >= 500 else "")
    except TimeoutError:
        return Answer(hung=True, detail="no complete answer in time")
    except (OSError, http.client.HTTPException) as exc:
        return Answer(detail=repr(exc)[:300])
    finally:
        conn.close()


def get(url: str, timeout_s: float = 5.0) -> tuple[int, str]:
    host, rest = url.removeprefix("http://").split(":", 1)
    port, _, path = rest.partition("/")
    conn = http.client.HTTPConnection(host, int(port), timeout=timeout_s)
    try:
        conn.request("GET", "/" + path)
        resp = conn.getresponse()
        return resp.status, resp.read().decode("utf-8", "replace")
    except (OSError, http.client.HTTPException) as exc:
        return 0, repr(exc)
    finally:
        conn.close()


_DEATHS = re.compile(r"^dsv4_engine_thread_deaths_total\{[^}]*\} (\S+)$", re.M)


# ---- the surfaces ----------------------------------------------------------------------------


@dataclass
class Surface:
    """A running surface: its API and every worker's status port."""

    name: str
    api_url: str
    workers: dict[str, str]  # process name -> status base URL (/live, /metrics)
    restarts: Any = lambda: 0  # () -> processes restarted so far

    def deaths(self) -> tuple[int, list[str]]:
        """Engine deaths seen now: the deaths counters, failed /live answers, restarts."""
        count, notes = self.restarts(), []
        if count:
            notes.append(f"{count} process restarts")
        for name, base in self.workers.items():
            status, text = get(base + "/live")
            ready, why = get(base + "/ready")
            if status != 200 or "engine not running" in why:  # (/ready: before /live said so)
                count += 1
                notes.append(f"{name} /live {status}, /ready {ready}: {(text + why)[:160]}")
                continue
            _, metrics = get(base + "/metrics")
            died = sum(int(float(v)) for v in _DEATHS.findall(metrics))
            if died:
                count += died
                notes.append(f"{name}: {died} thread deaths")
        return count, notes

    def leaked(self, timeout_s: float) -> dict[str, dict[str, float] | None]:
        urls = {name: base + "/metrics" for name, base in self.workers.items()}
        last: dict[str, dict[str, float] | None] = {}

        def idle() -> bool:
            nonlocal last
            last = {}
            for name, url in urls.items():
                pools = faultkit.used_pages(url)
                last[name] = None if pools is None else {p: v for p, v in pools.items() if v}
            return all(v == {} for v in last.values())

        with contextlib.suppress(AssertionError):
            faultkit.wait_until(idle, "0 KV pages in use", timeout_s)
        return {n: v for n, v in last.items() if v != {}}


@contextlib.contextmanager
def serve_surface(workdir: Path) -> Iterator[Surface]:
    """`dsv4 serve --model tiny --port 0`: the API and the probes on one port."""
    workdir.mkdir(parents=True, exist_ok=True)
    out = workdir / "serve.out"
    argv = [sys.executable, "-m", "dsv4_cli", "serve", "--model", "tiny", "--port", "0"]
    with out.open("wb") as log:
        popen = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT)
    try:
        found: list[str] = []

        def listening() -> bool:
            found[:] = re.findall(r"listening on (http://\S+)", out.read_text())
            return bool(found) or popen.poll() is not None

        faultkit.wait_until(listening, "dsv4 serve to listen", faultkit.START_S)
        if not found:
            raise AssertionError(f"dsv4 serve exited:\n{out.read_text()[-2000:]}")
        url = found[0]
        faultkit.wait_until(lambda: get(url + "/ready")[0] == 200, "ready", faultkit.START_S)
        yield Surface("serve", url, {"serve": url})
    finally:
        popen.terminate()
        try:
            popen.wait(timeout=30)
        except subprocess.TimeoutExpired:
            popen.kill()
            popen.wait()


@contextlib.contextmanager
def up_surface(workdir: Path, sample: str = "tiny-pd.yaml") -> Iterator[Surface]:
    """`dsv4 up SAMPLE --port 0` (faultkit's deployment): the router's API, every worker's
    status port, the supervisor's restarts."""
    with faultkit.Deployment.start(sample, workdir) as dep:
        workers = {
            name: url.removesuffix("/metrics") for name, url in dep.worker_metrics_urls().items()
        }

        def restarts() -> int:
            return sum(int(u["restarts"]) for u in dep.units().values())

        yield Surface("up-pd", dep.api_url, workers, restarts)


# ---- the drive -------------------------------------------------------------------------------


@dataclass
class Tally:
    bodies: int = 0
    ok: int = 0
    client_errors: int = 0
    server_errors: int = 0
    other: int = 0  # no status: a broken connection
    hangs: int = 0
    controls: int = 0
    controls_failed: int = 0
    deaths: int = 0
    leaked: dict[str, dict[str, float] | None] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)

    def count(self, answer: Answer, body: bytes) -> None:
        self.bodies += 1
        if answer.hung:
            self.hangs += 1
        elif answer.status == 0:
            self.other += 1
        elif answer.status >= 500 or answer.error_event:
            self.server_errors += 1
        elif answer.status >= 400:
            self.client_errors += 1
        else:
            self.ok += 1
        if answer.hung or answer.status == 0 or answer.status >= 500 or answer.error_event:
            self.notes.append(f"{answer.status} {answer.detail[:160]} <- {body[:160]!r}")

    def missed(self) -> list[str]:
        found = []
        for label, value in (
            ("engine deaths", self.deaths),
            ("hangs", self.hangs),
            ("5xx answers", self.server_errors),
            ("broken connections", self.other),
            ("failed controls", self.controls_failed),
        ):
            if value:
                found.append(f"{value} {label}")
        if self.leaked:
            found.append(f"KV pages in use once idle: {self.leaked}")
        return found


def drive(surface: Surface, bodies: list[tuple[str, bytes]], args: argparse.Namespace) -> Tally:
    """Send every body (`--clients` at a time, a control after every `--control-every`),
    check the workers' liveness every `--check-every` bodies, and read the pages once idle."""
    tally = Tally()
    lock = threading.Lock()
    work = iter(enumerate(bodies))
    control = json.dumps(CONTROL).encode()

    def client() -> None:
        while True:
            with lock:
                item = next(work, None)
            if item is None:
                return
            i, (path, body) = item
            answer = send(surface.api_url, path, body, args.timeout_s)
            with lock:
                tally.count(answer, body)
            if i % args.control_every == 0:
                ok = send(surface.api_url, "/v1/completions", control, args.timeout_s)
                with lock:
                    tally.controls += 1
                    if not 200 <= ok.status < 300 or ok.error_event:
                        tally.controls_failed += 1
                        tally.notes.append(f"control: {ok.status} {ok.detail[:160]}")

    threads = [threading.Thread(target=client, daemon=True) for _ in range(args.clients)]
    for t in threads:
        t.start()
    while any(t.is_alive() for t in threads):
        time.sleep(1.0)
    for t in threads:
        t.join()
    tally.deaths, notes = surface.deaths()
    tally.notes += notes
    tally.leaked = surface.leaked(args.idle_timeout_s)
    return tally


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--surface", action="append", choices=SURFACES, help="default: all")
    parser.add_argument("--bodies", type=int, default=600, help="hostile bodies per surface")
    parser.add_argument("--seed", type=int, default=37)
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--control-every", type=int, default=10)
    parser.add_argument("--timeout-s", type=float, default=60.0)
    parser.add_argument("--idle-timeout-s", type=float, default=30.0)
    parser.add_argument("--workdir", type=Path, help="default: a temporary directory")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    root = args.workdir or Path(tempfile.mkdtemp(prefix="dsv4-fuzz-"))
    bodies = hostile_bodies(args.seed, args.bodies)
    print(f"{len(bodies)} hostile bodies (seed {args.seed}) per surface; workdirs under {root}")
    header = (
        f"{'surface':8} {'bodies':>6} {'2xx':>5} {'4xx':>5} {'5xx':>5} {'deaths':>6} "
        f"{'hangs':>5} {'leaked':>6} {'controls':>8} {'failed':>6} {'time_s':>7}"
    )
    print(header, flush=True)
    figures: list[Figure] = []
    failures: dict[str, list[str]] = {}
    for name in args.surface or SURFACES:
        started_s = time.monotonic()
        start = serve_surface if name == "serve" else up_surface
        with start(root / name) as surface:
            tally = drive(surface, bodies, args)
        leaked = int(sum(sum(p.values()) for p in tally.leaked.values() if p))
        print(
            f"{name:8} {tally.bodies:>6} {tally.ok:>5} {tally.client_errors:>5} "
            f"{tally.server_errors:>5} {tally.deaths:>6} {tally.hangs:>5} {leaked:>6} "
            f"{tally.controls:>8} {tally.controls_failed:>6} "
            f"{time.monotonic() - started_s:>7.1f}",
            flush=True,
        )
        if found := tally.missed():
            failures[name] = found + tally.notes[:20]
        for label, value in (
            ("5xx", tally.server_errors),
            ("deaths", tally.deaths),
            ("hangs", tally.hangs),
            ("leaked pages", leaked),
            ("failed controls", tally.controls_failed),
        ):
            figures.append(Figure(f"{name} {label}", value, "count", "lower"))
    for name, found in failures.items():
        print(f"{name}: missed:")
        for line in found:
            print(f"    {line}")
    print(f"{len(args.surface or SURFACES) - len(failures)} surfaces met every target")
    if args.json:
        emit("fuzz", figures)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
