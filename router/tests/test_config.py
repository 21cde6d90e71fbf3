"""Settings from `dsv4 serve --role router` arguments: both forms, and every bad input exits 2
with `dsv4 serve: error:` naming the flag or field (no traceback)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import pytest

from dsv4_common.api.rank_config import ROUTER_CONFIG_KEY, Instance
from dsv4_router.config import (
    DEFAULT_BUSY_POLL_S,
    MAX_BUSY_POLL_US,
    ConfigError,
    RoleTargets,
    settings_from_args,
)
from dsv4_router.serve import run


def args(
    *instances: str, config_dir: Path | None = None, host: str | None = None, port: int = 8000
) -> argparse.Namespace:
    return argparse.Namespace(
        role="router",
        config_dir=None if config_dir is None else str(config_dir),
        host=host,
        port=port,
        instance=list(instances),
    )


def router_doc(**changes: Any) -> dict[str, Any]:
    doc: dict[str, Any] = {
        "version": 1,
        "deployment": "demo",
        "port": 8000,
        "status_port": 8081,
        "max_context_tokens": 4096,
        "transfer": "nixl",
        "roles": {
            "prefill": {"service": "demo-prefill.ns.svc", "port": 8080, "bootstrap_port": 8083},
            "decode": {
                "service": "demo-decode.ns.svc",
                "port": 8080,
                "bootstrap_port": 8083,
                "instances": [
                    {"host": "10.0.0.5", "http_port": 9001, "status_port": 9002, "kv_port": 9003}
                ],
            },
        },
    }
    doc.update(changes)
    return doc


def write_config(tmp_path: Path, doc: object) -> Path:
    text = doc if isinstance(doc, str) else json.dumps(doc)
    (tmp_path / ROUTER_CONFIG_KEY).write_text(text)
    return tmp_path


def exit_message(namespace: argparse.Namespace, capsys: pytest.CaptureFixture[str]) -> str:
    assert run(namespace) == 2
    err = capsys.readouterr().err
    assert err.startswith("dsv4 serve: error: "), err
    assert "Traceback" not in err
    return err


def test_quick_form() -> None:
    settings = settings_from_args(
        args("prefill=127.0.0.1:9001:9002:9003", "decode=[::1]:9011:9012:9013", port=8100)
    )
    assert (settings.host, settings.port, settings.status_port) == ("127.0.0.1", 8100, None)
    assert settings.roles["prefill"] == RoleTargets(
        instances=(Instance("127.0.0.1", 9001, 9002, 9003),)
    )
    assert settings.roles["decode"].instances == (Instance("::1", 9011, 9012, 9013),)


def test_deployed_form(tmp_path: Path) -> None:
    settings = settings_from_args(args(config_dir=write_config(tmp_path, router_doc())))
    assert (settings.host, settings.port, settings.status_port) == ("0.0.0.0", 8000, 8081)
    prefill = settings.roles["prefill"]
    assert prefill.instances == ()
    assert prefill.service == "demo-prefill.ns.svc"
    assert prefill.from_address("10.1.2.3") == Instance("10.1.2.3", 8080, 8081, 8083)
    assert settings.roles["decode"].instances == (Instance("10.0.0.5", 9001, 9002, 9003),)
    assert "router_config.port" in settings.port_name


@pytest.mark.parametrize(
    ("flags", "words"),
    [
        ((), "needs at least one prefill"),
        (("prefill=127.0.0.1:1:2:3",), "needs at least one decode"),
        (("router=127.0.0.1:1:2:3", "decode=127.0.0.1:4:5:6"), "ROLE prefill or decode"),
        (("prefill127.0.0.1:1:2:3",), "ROLE prefill or decode"),
        (("prefill=127.0.0.1:1:2", "decode=127.0.0.1:4:5:6"), "HOST:HTTP:STATUS:KV"),
        (("prefill=:1:2:3", "decode=127.0.0.1:4:5:6"), "HOST:HTTP:STATUS:KV"),
        (("prefill=h:x:2:3", "decode=127.0.0.1:4:5:6"), "HTTP port"),
        (("prefill=h:1:0:3", "decode=127.0.0.1:4:5:6"), "STATUS port"),
        (("prefill=h:1:2:70000", "decode=127.0.0.1:4:5:6"), "KV port"),
        (("prefill=h:1:2:3", "prefill=h:1:2:3", "decode=h:4:5:6"), "given twice"),
    ],
)
def test_bad_instance_flags(
    flags: tuple[str, ...], words: str, capsys: pytest.CaptureFixture[str]
) -> None:
    err = exit_message(args(*flags), capsys)
    assert "--instance" in err and words in err


def test_bad_port(capsys: pytest.CaptureFixture[str]) -> None:
    err = exit_message(args("prefill=h:1:2:3", "decode=h:4:5:6", port=70000), capsys)
    assert "--port" in err


def test_config_dir_and_instance_together(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    namespace = args("prefill=h:1:2:3", config_dir=write_config(tmp_path, router_doc()))
    assert "--instance: not with --config-dir" in exit_message(namespace, capsys)


def test_missing_router_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    err = exit_message(args(config_dir=tmp_path), capsys)
    assert "--config-dir" in err and ROUTER_CONFIG_KEY in err


def test_router_json_not_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    err = exit_message(args(config_dir=write_config(tmp_path, "{oops")), capsys)
    assert ROUTER_CONFIG_KEY in err and "not valid JSON" in err


def _without(doc: dict[str, Any], *path: str) -> dict[str, Any]:
    node = doc
    for key in path[:-1]:
        node = node[key]
    del node[path[-1]]
    return doc


@pytest.mark.parametrize(
    ("doc", "field"),
    [
        (router_doc(version=2), "router_config.version"),
        (_without(router_doc(), "status_port"), "router_config.status_port: required"),
        (router_doc(port="8000"), "router_config.port"),
        (router_doc(port=0), "router_config.port: must be in 1..65535"),
        (router_doc(status_port=65536), "router_config.status_port: must be in"),
        (_without(router_doc(), "roles", "decode"), "router_config.roles: missing decode"),
        (
            _without(router_doc(), "roles", "prefill", "bootstrap_port"),
            "router_config.roles.prefill.bootstrap_port: required",
        ),
        (
            router_doc(
                roles={
                    **router_doc()["roles"],
                    "prefill": {"service": "", "port": 8080, "bootstrap_port": 8083},
                }
            ),
            "router_config.roles.prefill.service: empty",
        ),
        (
            router_doc(
                roles={
                    **router_doc()["roles"],
                    "decode": {
                        "service": "d",
                        "port": 8080,
                        "bootstrap_port": 8083,
                        "instances": [
                            {"host": "h", "http_port": 1, "status_port": 99999, "kv_port": 3}
                        ],
                    },
                }
            ),
            "router_config.roles.decode.instances[0].status_port: must be in",
        ),
    ],
)
def test_bad_router_json_names_the_field(
    doc: dict[str, Any], field: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    err = exit_message(args(config_dir=write_config(tmp_path, doc)), capsys)
    assert field in err, err
    assert ROUTER_CONFIG_KEY in err


def test_a_port_in_use_exits_2(capsys: pytest.CaptureFixture[str]) -> None:
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        err = exit_message(args("prefill=h:1:2:3", "decode=h:4:5:6", port=port), capsys)
    assert f"--port: cannot listen on 127.0.0.1:{port}" in err


def test_busy_poll_window_from_its_flag(tmp_path: Path) -> None:
    flags = ("prefill=127.0.0.1:9001:9002:9003", "decode=127.0.0.1:9011:9012:9013")
    assert settings_from_args(args(*flags)).busy_poll_s == DEFAULT_BUSY_POLL_S
    for given, window_s in ((0, 0.0), (120, 120e-6)):
        quick = args(*flags)
        quick.router_busy_poll_us = given
        assert settings_from_args(quick).busy_poll_s == window_s
        deployed = args(config_dir=write_config(tmp_path, router_doc()))
        deployed.router_busy_poll_us = given
        assert settings_from_args(deployed).busy_poll_s == window_s


def test_a_busy_poll_window_out_of_range_names_the_flag(
    capsys: pytest.CaptureFixture[str],
) -> None:
    namespace = args("prefill=h:1:2:3", "decode=h:4:5:6")
    namespace.router_busy_poll_us = MAX_BUSY_POLL_US + 1
    err = exit_message(namespace, capsys)
    assert f"--router-busy-poll-us: must be in 0..{MAX_BUSY_POLL_US}" in err


def test_no_pd_secret_is_refused_naming_how_to_give_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A router signs every request's choice of prefill: without the deployment's secret it
    does not start; the secret comes from --pd-secret-file, the config's field or the env."""
    monkeypatch.delenv("DSV4_PD_SECRET")
    quick = args("prefill=127.0.0.1:9001:9002:9003", "decode=127.0.0.1:9011:9012:9013")
    with pytest.raises(ConfigError, match="--role router: no PD secret: set --pd-secret-file"):
        settings_from_args(quick)
    secret = tmp_path / "secret"
    secret.write_text("x" * 40 + "\n")
    quick.pd_secret_file = str(secret)
    assert settings_from_args(quick).route_key == b"x" * 40
    short = tmp_path / "short"
    short.write_text("too short")
    quick.pd_secret_file = str(short)
    with pytest.raises(
        ConfigError, match=f"--pd-secret-file {short}: PD secret: 9 bytes, at least 32"
    ):
        settings_from_args(quick)
    (tmp_path / "d").mkdir()
    (tmp_path / "e").mkdir()
    doc = {**router_doc(), "pd_secret_file": str(secret)}
    deployed = settings_from_args(args(config_dir=write_config(tmp_path / "d", doc)))
    assert deployed.route_key == b"x" * 40
    missing = {**router_doc(), "pd_secret_file": str(tmp_path / "nope")}
    with pytest.raises(ConfigError, match=r"router_config.pd_secret_file .*nope: cannot read"):
        settings_from_args(args(config_dir=write_config(tmp_path / "e", missing)))
