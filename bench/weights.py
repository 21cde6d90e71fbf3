"""Download throughput of the operator's download Job (`dsv4 fetch`, as its container runs it)
against plain `hf download` (huggingface_hub's CLI, the successor of `huggingface-cli download`)
of the same ~2 GB model directory from the fake hub on 127.0.0.1, side by side in one run; and
the operator's status write rate for a CR while its download progresses.

    python bench/weights.py [--gib 2] [--runs 3] [--link-mb-per-s N] [--json]

Each run downloads into a fresh cache (same disk), alternating the two clients; figures are
medians, with each client's CPU seconds (user + system, its process alone). `dsv4 fetch` also
hashes every byte (sha256) and reads the checkpoint's headers for the tensor check; `hf
download` does neither. The ratio (ours / hf) is the number to watch (>= 0.9). Over loopback
the download is CPU-bound (the hub sends with sendfile; the clients receive in Python), so the
hash's CPU shows in the ratio; `--link-mb-per-s` paces the hub's CDN to a network link's rate
(all connections together), where the CPU has room and the link is the limit.

Status writes: the reconcile runs 20 times a second for 20 s (far more often than kopf's
timers and events would) against the in-memory API while the Job's progress document moves
every call; it prints the writes per second of that CR (the bound is one per 2 s, 0.5/s).
"""

from __future__ import annotations

import argparse
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "fetch" / "tests"), str(ROOT / "operator" / "tests")]

from benchjson import Figure, emit  # noqa: E402
from fake_hub import FakeHub  # noqa: E402
from hub_models import synthetic_checkpoint, tiny_config  # noqa: E402

REPO = "bench/two-gib"
HF = Path(sys.executable).with_name("hf")


def build_model(out: Path, gib: float) -> dict[str, Path]:
    """A DeepSeek-V4-shaped checkpoint of about `gib` GiB: tiny's layers, a vocabulary sized so
    the embedding and the head hold the bytes (random, so nothing compresses)."""
    vocab = int(gib * (1 << 30) / (2 * 64 * 4))
    return synthetic_checkpoint(out, tiny_config(vocab_size=vocab), shards=4)


def run_once(argv: list[str], env: dict[str, str]) -> tuple[float, float]:
    """(wall seconds, CPU seconds of the child: user + system)."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    done = subprocess.run(argv, env=env, capture_output=True, text=True, check=False)
    seconds = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if done.returncode != 0:
        raise SystemExit(f"{argv[:3]} failed ({done.returncode}): {done.stderr[-2000:]}")
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return seconds, cpu


def throughput(
    gib: float, runs: int, work: Path, link_mb_per_s: float | None = None
) -> dict[str, Any]:
    files = build_model(work / "model", gib)
    total = sum(p.stat().st_size for p in files.values())
    env = {k: v for k, v in os.environ.items() if not k.startswith("HF_")}
    env.update(HF_HOME=str(work / "hf-home"), HF_HUB_DISABLE_TELEMETRY="1")
    times: dict[str, list[float]] = {"dsv4 fetch": [], "hf download": []}
    cpus: dict[str, list[float]] = {"dsv4 fetch": [], "hf download": []}
    rate = link_mb_per_s * 1e6 if link_mb_per_s else None
    with FakeHub(work / "hub", bytes_per_s=rate) as hub:
        hub.add_repo(REPO, files)
        env["HF_ENDPOINT"] = hub.endpoint
        clients = {
            "dsv4 fetch": lambda cache: [
                sys.executable, "-m", "dsv4_cli", "fetch", f"hf://{REPO}",
                "--cache-dir", str(cache), "--progress", "none",
            ],
            "hf download": lambda cache: [str(HF), "download", REPO, "--cache-dir", str(cache)],
        }  # fmt: skip
        for i in range(runs):
            order = list(clients) if i % 2 == 0 else list(reversed(clients))
            for name in order:
                cache = work / f"cache-{name.split()[0]}-{i}"
                seconds, cpu = run_once(clients[name](cache), env)
                times[name].append(seconds)
                cpus[name].append(cpu)
                shutil.rmtree(cache)
    medians = {name: statistics.median(t) for name, t in times.items()}
    rates = {name: total / s / 1e6 for name, s in medians.items()}
    return {
        "bytes": total,
        "runs": runs,
        "link_MB_per_s": link_mb_per_s,
        "seconds": {k: [round(x, 2) for x in v] for k, v in times.items()},
        "cpu_seconds": {k: round(statistics.median(v), 2) for k, v in cpus.items()},
        "MB_per_s": {k: round(v, 1) for k, v in rates.items()},
        "ratio": round(rates["dsv4 fetch"] / rates["hf download"], 3),
    }


def status_rate(seconds: float = 20.0, per_second: int = 20) -> dict[str, Any]:
    """Status writes of one CR while its download's progress moves on every reconcile."""
    from support.fake_kube import FakeKube, FakeProbe

    from dsv4_common.api.fetch_status import FetchStatus, fetch_status_to_dict
    from dsv4_common.api.model_source import HfSource
    from dsv4_operator.reconcile import reconcile
    from dsv4_operator.weights import Resolved

    config = (ROOT / "worker/dsv4_worker/models/tiny/config.json").read_text()
    commit, total = "c" * 40, 160 << 30

    class Hub:
        def resolve(self, source: HfSource, *, endpoint: str | None, token: str | None) -> Resolved:
            return Resolved(source, commit, total, 50, config)

    body = {
        "apiVersion": "serving.dsv4.io/v1alpha1",
        "kind": "DSV4Deployment",
        "metadata": {"name": "bench", "namespace": "ns", "uid": "u1", "generation": 1},
        "spec": {"model": {"source": "hf://bench/m"}, "maxContextTokens": 1024},
    }
    kube, probe, hub = FakeKube(body), FakeProbe(), Hub()
    t0 = datetime(2026, 1, 1, tzinfo=UTC)
    reconcile(kube.cr, kube, probe, clock=lambda: t0, hub=hub)
    (job,) = kube.of_kind("Job").values()
    kube.objects[("v1", "Pod", "ns", "fetch")] = {
        "metadata": {
            "name": "fetch",
            "namespace": "ns",
            "labels": job["spec"]["template"]["metadata"]["labels"],
        },
        "status": {"phase": "Running", "podIP": "10.0.0.1"},
    }
    mark = sum(1 for w in kube.writes if w[0] == "patch_status")
    calls = int(seconds * per_second)
    for i in range(calls):
        now = t0 + timedelta(seconds=i / per_second)
        doc = FetchStatus(
            version=1, source=f"hf://bench/m@{commit}", phase="downloading", commit=commit,
            bytes_done=i * total // calls, bytes_total=total, files_total=50,
            bytes_per_second=1e9,
        )  # fmt: skip
        probe.progress_docs["10.0.0.1"] = fetch_status_to_dict(doc)
        reconcile(kube.cr, kube, probe, clock=lambda now=now: now, hub=hub)
    writes = sum(1 for w in kube.writes if w[0] == "patch_status") - mark
    return {
        "reconciles": calls,
        "seconds": seconds,
        "status_writes": writes,
        "writes_per_s": round(writes / seconds, 3),
        "bound_per_s": 0.5,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--gib", type=float, default=2.0)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument(
        "--link-mb-per-s",
        type=float,
        default=None,
        help="pace the hub's CDN to this many MB/s over all connections (default: unpaced)",
    )
    p.add_argument("--json", action="store_true", help="add the @bench-json line")
    args = p.parse_args()
    load = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="dsv4-bench-weights-") as tmp:
        result = {
            "download": throughput(args.gib, args.runs, Path(tmp), args.link_mb_per_s),
            "status": status_rate(),
            "load_avg": [round(x, 1) for x in load],
            "cpus": os.cpu_count(),
        }
    d, s = result["download"], result["status"]
    print(f"machine: {result['cpus']} CPUs, load average {result['load_avg']} at the start")
    link = f"paced to {d['link_MB_per_s']:g} MB/s" if d["link_MB_per_s"] else "unpaced"
    print(
        f"download of {d['bytes'] / 1e9:.2f} GB from the fake hub ({link}), median of "
        f"{d['runs']} runs each:"
    )
    for name, rate in d["MB_per_s"].items():
        print(
            f"  {name:12s} {rate:8.1f} MB/s  CPU {d['cpu_seconds'][name]:6.2f} s  "
            f"(runs: {d['seconds'][name]} s)"
        )
    print(f"  ratio dsv4 fetch / hf download: {d['ratio']}")
    print(
        f"status: {s['status_writes']} writes in {s['seconds']:.0f} s of progress "
        f"({s['reconciles']} reconciles): {s['writes_per_s']}/s (bound {s['bound_per_s']}/s)"
    )
    if args.json:
        emit(
            "weights",
            [
                Figure("fetch_MB_per_s", d["MB_per_s"]["dsv4 fetch"], "MB/s", "higher"),
                Figure("hf_download_MB_per_s", d["MB_per_s"]["hf download"], "MB/s", "higher"),
                Figure("fetch_vs_hf_ratio", d["ratio"], "x", "higher"),
                Figure("status_writes_per_s", s["writes_per_s"], "1/s", "lower"),
            ],
        )


if __name__ == "__main__":
    main()
