"""A `dsv4 up` PD deployment (crds/samples/tiny-pd.yaml, decode sized down to 8 running
requests) at 4x its saturation concurrency through the router (issue #25): every request gets
a whole 2xx or a 503 with Retry-After, none waits longer than the decode's queue deadline plus
its own generation, the router and the decode count what they shed by reason, and every
worker holds 0 pages once idle."""

from __future__ import annotations

import http.client
import re
import time
from pathlib import Path
from urllib.parse import urlsplit

import pytest
import yaml
from faultkit import Deployment
from overload_support import check_outcomes, run_load, summary

from dsv4_worker.server.admission import DEFAULT_QUEUE_TIMEOUT_S

pytestmark = pytest.mark.slow
SAMPLE = Path(__file__).resolve().parents[2] / "crds" / "samples" / "tiny-pd.yaml"
MAX_RUNNING = 8  # the decode's request slots: its saturation concurrency
CLIENTS = 4 * MAX_RUNNING
# Saturation is reached at once (32 clients against 8 slots and 16 queue places) and the closed
# loop then sends ~200 requests/s through the router, most shed: 5 s give hundreds of each.
DURATION_S = 5.0
GENERATION_S = 15.0  # prefill, transfer and 16 tokens once scheduled, on a loaded machine
BODY = {"prompt": "This License applies to", "max_tokens": 16, "temperature": 0}


def get(url: str) -> str:
    parts = urlsplit(url)
    conn = http.client.HTTPConnection(parts.hostname or "", parts.port, timeout=30)
    try:
        conn.request("GET", parts.path)
        return conn.getresponse().read().decode()
    finally:
        conn.close()


def metric(text: str, name: str) -> float:
    """The sum of a metric's samples (every label)."""
    found = re.findall(rf"^{name}(?:\{{[^}}]*\}})? (\S+)$", text, re.M)
    assert found, f"no {name}"
    return sum(float(v) for v in found)


def test_a_pd_deployment_at_4x_saturation_answers_2xx_or_503_in_time(tmp_path: Path) -> None:
    cr = yaml.safe_load(SAMPLE.read_text())
    cr["spec"]["decode"]["maxRunningRequests"] = MAX_RUNNING
    (tmp_path / "cr.yaml").write_text(yaml.safe_dump(cr))
    with Deployment.start(tmp_path / "cr.yaml", tmp_path / "work") as dep:
        status_urls = dict(re.findall(r"^status: +(\S+) +(\S+)", dep.out(), re.M))
        assert {"router", "prefill-0", "decode-0"} <= set(status_urls), dep.out()

        outcomes = run_load(
            dep.api_url,
            CLIENTS,
            DURATION_S,
            BODY,
            timeout_s=DEFAULT_QUEUE_TIMEOUT_S + GENERATION_S + 10,
        )
        check_outcomes(outcomes, max_latency_s=DEFAULT_QUEUE_TIMEOUT_S + GENERATION_S)

        metrics = {name: url.rsplit("/", 1)[0] + "/metrics" for name, url in status_urls.items()}
        for name in ("prefill-0", "decode-0"):
            deadline_s = time.monotonic() + 60

            def used(name: str = name) -> float:
                return metric(get(metrics[name]), "dsv4_kv_used_pages")

            while used() != 0:
                assert time.monotonic() < deadline_s, f"{name} still holds pages"
                time.sleep(0.1)
        router = get(metrics["router"])
        decode = get(metrics["decode-0"])
        sheds = metric(router, "dsv4_router_shed_requests_total")
        print(summary(outcomes))  # with -s: what the load met
        print(
            *re.findall(r"^dsv4_(?:router_)?(?:requests_)?shed.*_total.*$", router + decode, re.M)
        )
        assert sheds == sum(o.status == 503 for o in outcomes), (router, summary(outcomes))
        assert metric(decode, "dsv4_queue_limit_requests") == 2 * MAX_RUNNING
