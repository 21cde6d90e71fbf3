"""router.json read again when it changes (`reload.RolesFile`): a router started from
`--config-dir` learns of a decode added or removed; a rewrite that does not parse keeps the
roles known; Discovery syncs its table to the new roles at its next round."""

from __future__ import annotations

import copy
import json
import os
from pathlib import Path
from typing import Any

import aiohttp
from router_support import run_async

from dsv4_common.api.rank_config import ROUTER_CONFIG_KEY, Instance
from dsv4_router.choice import InstanceTable
from dsv4_router.config import read_roles
from dsv4_router.discovery import Discovery
from dsv4_router.liveness import LivenessRule
from dsv4_router.reload import RolesFile

ONE = {"host": "127.0.0.1", "http_port": 9001, "status_port": 9002, "kv_port": 9003}
TWO = {"host": "127.0.0.1", "http_port": 9011, "status_port": 9012, "kv_port": 9013}
DOC: dict[str, Any] = {
    "version": 1,
    "deployment": "demo",
    "port": 8000,
    "status_port": 8081,
    "max_context_tokens": 4096,
    "transfer": "nixl",
    "roles": {
        "prefill": {
            "service": "127.0.0.1",
            "port": 9101,
            "bootstrap_port": 9103,
            "instances": [
                {"host": "127.0.0.1", "http_port": 9101, "status_port": 9102, "kv_port": 9103}
            ],
        },
        "decode": {
            "service": "127.0.0.1",
            "port": 9001,
            "bootstrap_port": 9003,
            "instances": [ONE],
        },
    },
}


def write(path: Path, doc: object) -> None:
    """As `dsv4 up` writes it: a new file renamed over the old one."""
    tmp = path.with_suffix(".tmp")
    tmp.write_text(doc if isinstance(doc, str) else json.dumps(doc))
    os.replace(tmp, path)


def with_decodes(*instances: dict[str, Any]) -> dict[str, Any]:
    doc = copy.deepcopy(DOC)
    doc["roles"]["decode"]["instances"] = list(instances)
    return doc


def test_a_changed_file_gives_its_roles_once(tmp_path: Path) -> None:
    path = tmp_path / ROUTER_CONFIG_KEY
    write(path, DOC)
    watch = RolesFile(path)
    assert watch.changed() is None  # as read at start
    write(path, with_decodes(ONE, TWO))
    roles = watch.changed()
    assert roles is not None
    assert [i.http_port for i in roles["decode"].instances] == [9001, 9011]
    assert watch.changed() is None  # nothing new since
    write(path, "{not json")
    assert watch.changed() is None  # unusable: the roles known so far stay
    write(path, with_decodes(TWO))
    roles = watch.changed()
    assert roles is not None and [i.http_port for i in roles["decode"].instances] == [9011]


def test_discovery_syncs_the_table_to_a_rewritten_file(tmp_path: Path) -> None:
    run_async(lambda: _syncs(tmp_path / ROUTER_CONFIG_KEY))()


async def _syncs(path: Path) -> None:
    write(path, DOC)
    watch = RolesFile(path)
    table = InstanceTable()
    async with aiohttp.ClientSession() as session:
        found = Discovery(
            table,
            read_roles(path),
            session,
            poll_interval_s=0.05,
            status_timeout_s=0.5,
            liveness=LivenessRule(misses=3, grace_s=30.0),
            reload=watch.changed,
        )
        await found.refresh()
        decodes = [r.instance.http_port for r in table.records() if r.role == "decode"]
        assert decodes == [9001]
        write(path, with_decodes(ONE, TWO))
        await found.refresh()
        decodes = [r.instance.http_port for r in table.records() if r.role == "decode"]
        assert decodes == [9001, 9011]
        write(path, with_decodes(TWO))
        await found.refresh()
        records = [r.instance for r in table.records() if r.role == "decode"]
        assert records == [Instance("127.0.0.1", 9011, 9012, 9013)]
