"""`dsv4 up` before anything starts: every bad input is one line naming the field or flag,
exit 2, no process started and no work directory made; good input reaches `launch` with the
documents written and the flags applied."""

from __future__ import annotations

import socket
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

import dsv4_local.supervisor
import dsv4_local.up
from dsv4_cli.main import main
from dsv4_local.plan import LaunchPlan
from dsv4_local.up import CompletionRequest

SAMPLES = Path(__file__).resolve().parents[2] / "crds" / "samples"


def cr(**spec: Any) -> dict[str, Any]:
    return {
        "apiVersion": "serving.dsv4.io/v1alpha1",
        "kind": "DSV4Deployment",
        "metadata": {"name": "tiny"},
        "spec": {"model": {"preset": "tiny"}, "maxContextTokens": 2048, **spec},
    }


@pytest.fixture(autouse=True)
def no_process_starts(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("a process was started")

    monkeypatch.setattr(dsv4_local.supervisor.subprocess, "Popen", refuse)


@pytest.fixture
def listening() -> Iterator[int]:
    """A port something listens on."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        yield int(sock.getsockname()[1])


def up_error(tmp_path: Path, capsys: pytest.CaptureFixture[str], text: str, *flags: str) -> str:
    """Run `dsv4 up` on `text`; assert exit 2 with nothing made; return the one error line."""
    file = tmp_path / "cr.yaml"
    file.write_text(text)
    workdir = tmp_path / "work"
    assert main(["up", str(file), "--workdir", str(workdir), *flags]) == 2
    assert not workdir.exists()
    captured = capsys.readouterr()
    assert captured.out == ""
    lines = captured.err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("dsv4 up: error: ")
    return lines[0].removeprefix("dsv4 up: error: ")


def test_a_bad_spec_field_is_named(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    message = up_error(tmp_path, capsys, yaml.safe_dump(cr(kv={"pageSize": 0})))
    assert message.startswith("spec.kv.pageSize: ")


def test_a_model_that_cannot_be_planned_is_named(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    body = cr(
        model={"configPath": "/nonexistent/config.json"}, gpu={"type": "h100-80gb", "perPod": 1}
    )
    assert up_error(tmp_path, capsys, yaml.safe_dump(body)).startswith("spec.model.configPath: ")


def test_a_config_map_model_is_refused_pointing_at_config_path(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """No cluster to read `spec.model.configMapRef` from: a local run names configPath."""
    body = cr(model={"configMapRef": {"name": "m"}}, gpu={"type": "h100-80gb", "perPod": 1})
    message = up_error(tmp_path, capsys, yaml.safe_dump(body))
    assert message.startswith("spec.model.configMapRef: ") and "model.configPath" in message


def test_an_sglang_cr_is_refused_naming_the_engine(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`dsv4 up` runs our worker only: the committed SGLang sample names spec.engine.name."""
    text = (SAMPLES / "sglang-flash-pd.yaml").read_text()
    message = up_error(tmp_path, capsys, text)
    assert message.startswith("spec.engine.name: ") and "dsv4 render" in message


def test_a_context_that_does_not_fit_is_named(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    message = up_error(tmp_path, capsys, yaml.safe_dump(cr(maxContextTokens=16_000_000)))
    assert message.startswith("spec.maxContextTokens: maxContextTokens 16000000 does not fit")


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("spec: [", "cr.yaml: not valid YAML: line 1, column 8: expected the node content"),
        ("kind: ConfigMap\n", "cr.yaml: no DSV4Deployment documents; dsv4 up runs exactly one"),
        (
            yaml.safe_dump_all([cr(), cr()]),
            "cr.yaml: 2 DSV4Deployment documents; dsv4 up runs exactly one",
        ),
    ],
)
def test_file_errors(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], text: str, message: str
) -> None:
    assert message in up_error(tmp_path, capsys, text)


def test_a_missing_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["up", str(tmp_path / "nope.yaml")]) == 2
    assert capsys.readouterr().err == (
        f"dsv4 up: error: {tmp_path / 'nope.yaml'}: No such file or directory\n"
    )


def test_a_router_port_in_use_is_named(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], listening: int
) -> None:
    text = yaml.safe_dump(cr(router={"port": listening}))
    assert up_error(tmp_path, capsys, text).startswith(
        f"spec.router.port: {listening} is in use on 127.0.0.1; pass --port P"
    )
    message = up_error(tmp_path, capsys, yaml.safe_dump(cr()), "--port", str(listening))
    assert message.startswith(f"--port: {listening} is in use")


class Launched:
    def __init__(self) -> None:
        self.calls: list[tuple[LaunchPlan, dict[str, Any]]] = []

    def __call__(self, plan: LaunchPlan, **kwargs: Any) -> int:
        self.calls.append((plan, kwargs))
        return 0


def test_good_input_reaches_launch_with_its_documents_written(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    launched = Launched()
    monkeypatch.setattr(dsv4_local.up, "launch", launched)
    file = tmp_path / "cr.yaml"
    file.write_text(yaml.safe_dump(cr(decode={"replicas": 2})))
    workdir = tmp_path / "work"
    flags = ["--port", "0", "--workdir", str(workdir), "--timeout-s", "7"]
    assert main(["up", str(file), *flags, "--request", "hi", "--max-tokens", "5"]) == 0
    ((plan, kwargs),) = launched.calls
    deployment = kwargs.pop("deployment")  # what the autoscaler runs on (`autoscaler`)
    assert deployment.spec.decode.replicas == 2
    assert kwargs == {"timeout_s": 7.0, "request": CompletionRequest("hi", 5)}
    assert plan.workdir == workdir and plan.log_dir.is_dir()
    assert [p.name for p in plan.processes] == ["prefill-0", "decode-0", "decode-1", "router"]
    assert all(path.is_file() for path in plan.documents)
    assert plan.router_url != "http://127.0.0.1:8000"  # --port 0: any free port


def test_the_default_workdir_is_fresh(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    launched = Launched()
    monkeypatch.setattr(dsv4_local.up, "launch", launched)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    file = tmp_path / "cr.yaml"
    file.write_text(yaml.safe_dump(cr()))
    assert main(["up", str(file), "--port", "0"]) == 0
    ((plan, kwargs),) = launched.calls
    assert plan.workdir.parent == tmp_path and plan.workdir.name.startswith("dsv4-up-")
    assert kwargs["request"] is None


def up_args(*argv: str) -> Any:
    from dsv4_cli.main import build_parser

    return build_parser().parse_args(["up", *argv])


@pytest.mark.parametrize("sample", ["flash-gpu.yaml", "flash-h200-volcano.yaml"])
def test_a_gpu_sample_on_a_machine_without_one_is_refused_naming_the_fix(
    sample: str,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Refused before any process or directory exists (it used to start three processes and
    fail 28 s later on fp8 pages), naming spec.gpu and the CPU samples."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    code = dsv4_local.up.run(
        up_args(str(SAMPLES / sample), "--port", "0"),
        missing_gpu=lambda: "no NVIDIA driver on this machine",
    )
    assert code == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith("dsv4 up: error: spec.gpu: this sample needs a GPU")
    assert "(no NVIDIA driver on this machine)" in err[0]
    assert "use a CPU-mode sample, crds/samples/tiny-*.yaml" in err[0]
    assert not list(tmp_path.iterdir())  # no work directory was made


def test_a_cpu_sample_never_asks_for_a_gpu(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(dsv4_local.up, "launch", Launched())

    def probe() -> str:
        raise AssertionError("a CPU-mode deployment asked whether this machine has a GPU")

    args = up_args(str(SAMPLES / "tiny-pd.yaml"), "--port", "0", "--workdir", str(tmp_path))
    assert dsv4_local.up.run(args, missing_gpu=probe) == 0


@pytest.mark.parametrize(
    ("flags", "launch_code", "kept"),
    [
        ((), 0, False),  # a clean exit removes the temporary directory
        (("--keep-workdir",), 0, True),
        ((), 1, True),  # a failure keeps it: its logs say why
    ],
)
def test_the_temporary_workdir_is_removed_at_a_clean_exit_unless_kept(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    flags: tuple[str, ...],
    launch_code: int,
    kept: bool,
) -> None:
    launched: list[LaunchPlan] = []

    def launch(plan: LaunchPlan, **kwargs: Any) -> int:
        launched.append(plan)
        return launch_code

    monkeypatch.setattr(dsv4_local.up, "launch", launch)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    file = tmp_path / "cr.yaml"
    file.write_text(yaml.safe_dump(cr()))
    assert main(["up", str(file), "--port", "0", *flags]) == launch_code
    (plan,) = launched
    assert plan.workdir.exists() == kept
    err = capsys.readouterr().err
    assert (f"configs and logs kept in {plan.workdir}" in err) == kept


def test_a_named_workdir_is_kept(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(dsv4_local.up, "launch", Launched())
    file = tmp_path / "cr.yaml"
    file.write_text(yaml.safe_dump(cr()))
    workdir = tmp_path / "work"
    assert main(["up", str(file), "--port", "0", "--workdir", str(workdir)]) == 0
    assert (workdir / "logs").is_dir()
