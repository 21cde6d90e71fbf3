"""scripts/checkov.sh's allowlist and verdict (scripts/checkov_scan.py), without checkov: the
chart README's table is the allowlist's, every entry says why, and the verdict fails on a
finding the allowlist does not cover (another check id, or a resource outside its patterns),
on an input checkov could not parse, and on an input it did not scan."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from repo_paths import CHART
from support import checkov_scan

SCAN = checkov_scan.load()
ALLOWLIST = SCAN.load_allowlist()
OPERATOR = "StatefulSet.dsv4-system.dsv4-dsv4-operator"


def _check(check_id: str, resource: str, file: str = "/tmp/x/sample-a.yaml") -> dict[str, Any]:
    return {"check_id": check_id, "check_name": "n", "resource": resource, "file_path": file}


def _report(failed: list[dict[str, Any]], passed: int = 1, **extra: Any) -> dict[str, Any]:
    results = {
        "passed_checks": [_check("CKV_K8S_8", "Deployment.ns.r")] * passed,
        "failed_checks": failed,
        **extra,
    }
    return {"check_type": "kubernetes", "results": results}


def test_the_readme_table_is_the_allowlist() -> None:
    readme = (CHART / "README.md").read_text()
    assert "## Security scanners (checkov)" in readme
    assert SCAN.table(ALLOWLIST) in readme, (
        "regenerate: .venv/bin/python scripts/checkov_scan.py table"
    )


def test_every_entry_says_why_and_is_scoped_where_it_must_be() -> None:
    ids = [a.check_id for a in ALLOWLIST]
    assert ids == sorted(ids, key=lambda i: int(i.rsplit("_", 1)[1]))
    for entry in ALLOWLIST:
        assert entry.check_id.startswith(("CKV_K8S_", "CKV2_K8S_")), entry
        assert len(entry.reason) > 80 and entry.title and entry.where, entry
    # Mounting a token is allowed on the operator alone, never on a pod it creates.
    (token,) = [a for a in ALLOWLIST if a.check_id == "CKV_K8S_38"]
    assert token.covers("CKV_K8S_38", OPERATOR)
    assert not token.covers("CKV_K8S_38", "StatefulSet.dsv4-samples.tiny-prefill-0")
    # The rules the operator now satisfies stay out of the allowlist.
    assert not {"CKV_K8S_9", "CKV_K8S_10", "CKV_K8S_12", "CKV_K8S_13", "CKV2_K8S_6"} & set(ids)


def test_allowed_findings_pass_and_are_counted_per_input() -> None:
    report = _report(
        [
            _check("CKV_K8S_11", "StatefulSet.dsv4-samples.tiny-prefill-0"),
            _check("CKV_K8S_38", OPERATOR, "/tmp/x/chart.yaml"),
        ],
        passed=3,
    )
    verdict = SCAN.judge([report, {"check_type": "secrets"}], ALLOWLIST)  # a list: per framework
    assert verdict.ok and not verdict.unexplained
    assert verdict.passed == {"sample-a.yaml": 3}
    assert verdict.failed == {"sample-a.yaml": 1, "chart.yaml": 1}
    assert "CKV_K8S_43" in verdict.unused


@pytest.mark.parametrize(
    "finding",
    [
        _check("CKV_K8S_13", "StatefulSet.dsv4-samples.flash-decode-0"),  # not listed
        _check("CKV_K8S_38", "StatefulSet.dsv4-samples.flash-decode-0"),  # listed elsewhere
    ],
)
def test_a_finding_the_allowlist_does_not_cover_fails(finding: dict[str, Any]) -> None:
    verdict = SCAN.judge(_report([finding]), ALLOWLIST)
    assert not verdict.ok
    assert [(f.check_id, f.resource) for f in verdict.unexplained] == [
        (finding["check_id"], finding["resource"])
    ]


def test_parse_errors_fail() -> None:
    verdict = SCAN.judge(_report([], parsing_errors=["/tmp/x/chart.yaml"]), ALLOWLIST)
    assert not verdict.ok and verdict.parse_errors == ("/tmp/x/chart.yaml",)


def test_check_command_fails_on_an_unexplained_finding_or_an_unscanned_input(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    inputs = tmp_path / "inputs"
    inputs.mkdir()
    (inputs / "sample-a.yaml").write_text("{}\n")
    report = tmp_path / "report.json"
    report.write_text(json.dumps(_report([_check("CKV_K8S_11", "Deployment.ns.r")])))
    assert SCAN.main(["check", str(report), str(inputs)]) == 0
    (inputs / "chart.yaml").write_text("{}\n")  # checkov reported nothing on it
    assert SCAN.main(["check", str(report), str(inputs)]) == 1
    assert "NOT SCANNED: chart.yaml" in capsys.readouterr().out
    (inputs / "chart.yaml").unlink()
    report.write_text(json.dumps(_report([_check("CKV_K8S_13", "Deployment.ns.r")])))
    assert SCAN.main(["check", str(report), str(inputs)]) == 1
    assert "UNEXPLAINED: CKV_K8S_13" in capsys.readouterr().out
