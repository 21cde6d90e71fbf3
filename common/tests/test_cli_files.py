"""`dsv4 render` and `dsv4 up` on files they cannot read as text, and a namespace Kubernetes
would refuse: each exits 2 with one line naming the file or flag, never a traceback."""

from __future__ import annotations

from pathlib import Path

import pytest
from repo_paths import SAMPLES

from dsv4_cli.main import main


def run_cli(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    try:
        code = main(argv)
    except SystemExit as exc:
        code = int(exc.code or 0)
    return code, capsys.readouterr().err


@pytest.mark.parametrize("command", ["render", "up"])
def test_a_file_that_is_not_utf8_exits_2_naming_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], command: str
) -> None:
    path = tmp_path / "deployment.yaml"
    path.write_bytes(b"apiVersion: serving.dsv4.io/v1alpha1\nkind: \xff\xfeDSV4Deployment\n")
    code, err = run_cli([command, str(path)], capsys)
    assert code == 2
    assert err == f"dsv4 {command}: error: {path}: not UTF-8 text (byte 43)\n"


@pytest.mark.parametrize("namespace", ["Bad_Namespace!", "UPPER", "dash-", "a.b", "a" * 64, ""])
def test_render_refuses_a_namespace_kubernetes_would(
    capsys: pytest.CaptureFixture[str], namespace: str
) -> None:
    code, err = run_cli(["render", str(SAMPLES / "tiny-pd.yaml"), "-n", namespace], capsys)
    assert code == 2
    assert err.startswith("dsv4 render: error: --namespace: ") and err.count("\n") == 1


def test_render_takes_a_valid_namespace(capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["render", str(SAMPLES / "tiny-pd.yaml"), "-n", "team-a1"])
    out = capsys.readouterr().out
    assert code == 0 and "namespace: team-a1" in out
