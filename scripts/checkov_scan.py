#!/usr/bin/env python3
"""The inputs and the verdict of scripts/checkov.sh (checkov's Kubernetes policies on everything
we render). Run it with the project's Python (.venv/bin/python):

    checkov_scan.py render DIR    every valid sample's objects, as `dsv4 render` prints them, and
                                  the chart's (`helm template`, per value set), one file each
    checkov_scan.py check REPORT  read checkov's JSON report of DIR; print passed and failed
                                  counts per input; exit 1 on any finding the allowlist does
                                  not explain, or an input checkov could not parse
    checkov_scan.py table         the allowlist as the chart README's table

The allowlist (scripts/checkov-allowlist.yaml) names each check id that may fail, why, and
which resources it may fail on (fnmatch patterns of checkov's `Kind.namespace.name`).

Samples render into SAMPLE_NAMESPACE, as the operator creates children in their CR's namespace
(a render without one would put them in `default`). A sample whose model config.json no file
here holds gets a published one (common/tests/data): a `configMapRef` the DeepSeek-V4-Flash file
(render's --model-config), a `configPath` the file of the same model directory, lower-cased
(`/models/DeepSeek-V4-Pro/config.json` -> deepseek-v4-pro/config.json).
"""

from __future__ import annotations

import argparse
import fnmatch
import json
import subprocess
import sys
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

import yaml

ROOT: Final = Path(__file__).resolve().parents[1]
SAMPLES: Final = ROOT / "crds" / "samples"
CHART: Final = ROOT / "charts" / "dsv4-operator"
HELM: Final = ROOT / ".tools" / "bin" / "helm"
MODEL_DATA: Final = ROOT / "common" / "tests" / "data"
ALLOWLIST: Final = ROOT / "scripts" / "checkov-allowlist.yaml"
SAMPLE_NAMESPACE: Final = "dsv4-samples"
CHART_NAMESPACE: Final = "dsv4-system"
CONFIG_MAP_MODEL: Final = "deepseek-v4-flash"
SAMPLE_COMMIT: Final = "0123456789abcdef0123456789abcdef01234567"  # an hf:// sample's, rendered
# helm value sets scanned: the defaults, and the webhook's objects and readiness probe.
CHART_VALUE_SETS: Final[dict[str, tuple[str, ...]]] = {
    "chart": (),
    "chart-webhook": ("--set", "webhook.enabled=true"),
}


# --- inputs ----------------------------------------------------------------------------------


def sample_input(path: Path) -> tuple[dict[str, Any], str | None]:
    """A sample's CR body and the config.json text `dsv4 render --model-config` would get: the
    published file of its model for a `configMapRef` or a `configPath` (a cluster path)."""
    body: dict[str, Any] = yaml.safe_load(path.read_text())
    model = body["spec"]["model"]
    if "configMapRef" in model:
        return body, (MODEL_DATA / CONFIG_MAP_MODEL / "config.json").read_text()
    if str(model.get("source", "")).startswith("hf://"):
        # The operator resolves the revision and reads config.json from the hub: stand in a
        # commit and the published config of the repo's model.
        repo = model["source"].removeprefix("hf://").split("@")[0]
        model["source"] = f"hf://{repo}@{SAMPLE_COMMIT}"
        published = MODEL_DATA / repo.split("/")[-1].lower() / "config.json"
        return body, published.read_text() if "preset" not in model else None
    if "configPath" in model:
        published = MODEL_DATA / Path(model["configPath"]).parent.name.lower() / "config.json"
        if not published.is_file():
            raise FileNotFoundError(f"{path}: no published config.json for {model['configPath']}")
        return body, published.read_text()
    return body, None


def sample_paths() -> list[Path]:
    return sorted(SAMPLES.glob("*.yaml"))  # samples/invalid/ holds the refused ones


def render_inputs(out: Path) -> list[Path]:
    """Write every input file into `out`; return their paths."""
    from dsv4_operator.render import render  # the project's Python only

    out.mkdir(parents=True, exist_ok=True)
    written = []
    for path in sample_paths():
        body, model_config = sample_input(path)
        target = out / f"sample-{path.stem}.yaml"
        target.write_text(render(body, namespace=SAMPLE_NAMESPACE, model_config=model_config))
        written.append(target)
    for name, values in CHART_VALUE_SETS.items():
        args = [str(HELM), "template", "dsv4", str(CHART), "--namespace", CHART_NAMESPACE]
        result = subprocess.run(
            [*args, *values], capture_output=True, text=True, check=False, timeout=120
        )
        if result.returncode != 0:
            raise SystemExit(f"helm template ({name}) failed:\n{result.stderr}")
        target = out / f"{name}.yaml"
        target.write_text(result.stdout)
        written.append(target)
    return written


# --- the allowlist ---------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Allowed:
    check_id: str
    title: str  # checkov's name of the check
    where: str  # what it fails on, in words
    reason: str  # why it does not apply, or the value that satisfies it
    resources: tuple[str, ...] = ("*",)  # fnmatch patterns of `Kind.namespace.name`

    def covers(self, check_id: str, resource: str) -> bool:
        return check_id == self.check_id and any(
            fnmatch.fnmatchcase(resource, p) for p in self.resources
        )


def load_allowlist(path: Path = ALLOWLIST) -> list[Allowed]:
    entries = yaml.safe_load(path.read_text())
    out = []
    for e in entries:
        unknown = set(e) - {"id", "title", "where", "reason", "resources"}
        if unknown:
            raise ValueError(f"{path}: {e.get('id')}: unknown keys {sorted(unknown)}")
        resources = tuple(e.get("resources", ("*",)))
        out.append(
            Allowed(e["id"], e["title"], e["where"], " ".join(e["reason"].split()), resources)
        )
    ids = [a.check_id for a in out]
    if len(ids) != len(set(ids)):
        raise ValueError(f"{path}: a check id is listed twice")
    return out


def table(allowlist: list[Allowed]) -> str:
    """The README table: one row per allowed check id."""
    rows = [
        "| check | what checkov asks | where it fails | why it does not apply |",
        "| --- " * 4 + "|",
    ]
    for a in allowlist:
        cells = (f"`{a.check_id}`", a.title, a.where, a.reason)
        rows.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
    return "\n".join(rows) + "\n"


# --- the verdict -----------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Finding:
    check_id: str
    title: str
    resource: str
    input_name: str


@dataclass(frozen=True, slots=True)
class Verdict:
    passed: Counter[str]  # per input file
    failed: Counter[str]
    unexplained: tuple[Finding, ...]
    parse_errors: tuple[str, ...]
    unused: tuple[str, ...]  # allowed check ids that failed nowhere

    @property
    def ok(self) -> bool:
        return not self.unexplained and not self.parse_errors


def _reports(data: Any) -> list[dict[str, Any]]:
    """checkov writes one report object, or a list of them (one per framework)."""
    reports = data if isinstance(data, list) else [data]
    return [r for r in reports if r.get("check_type") == "kubernetes"]


def judge(data: Any, allowlist: list[Allowed]) -> Verdict:
    passed: Counter[str] = Counter()
    failed: Counter[str] = Counter()
    unexplained: list[Finding] = []
    parse_errors: list[str] = []
    seen_ids: set[str] = set()
    for report in _reports(data):
        results = report.get("results", {})
        for check in results.get("passed_checks", []):
            passed[Path(check["file_path"]).name] += 1
        for check in results.get("failed_checks", []):
            name = Path(check["file_path"]).name
            failed[name] += 1
            seen_ids.add(check["check_id"])
            finding = Finding(check["check_id"], check["check_name"], check["resource"], name)
            if not any(a.covers(finding.check_id, finding.resource) for a in allowlist):
                unexplained.append(finding)
        parse_errors.extend(str(e) for e in results.get("parsing_errors", []))
    unused = tuple(a.check_id for a in allowlist if a.check_id not in seen_ids)
    return Verdict(passed, failed, tuple(unexplained), tuple(parse_errors), unused)


def summary(verdict: Verdict, inputs: list[str]) -> str:
    lines = [f"{'input':<36} {'passed':>7} {'failed':>7}"]
    for name in inputs:
        lines.append(f"{name:<36} {verdict.passed[name]:>7} {verdict.failed[name]:>7}")
    total_passed, total_failed = sum(verdict.passed.values()), sum(verdict.failed.values())
    lines.append(f"{'total':<36} {total_passed:>7} {total_failed:>7}")
    for error in verdict.parse_errors:
        lines.append(f"NOT PARSED: {error}")
    for f in verdict.unexplained:
        lines.append(f"UNEXPLAINED: {f.check_id} ({f.title}) on {f.resource} in {f.input_name}")
    for check_id in verdict.unused:
        lines.append(f"note: allowlisted {check_id} failed nowhere (stale entry?)")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("render").add_argument("dir", type=Path)
    check = sub.add_parser("check")
    check.add_argument("report", type=Path)
    check.add_argument("dir", type=Path, help="the rendered inputs (every one must be scanned)")
    sub.add_parser("table")
    args = parser.parse_args(argv)
    if args.command == "render":
        for path in render_inputs(args.dir):
            print(path)
        return 0
    allowlist = load_allowlist()
    if args.command == "table":
        print(table(allowlist), end="")
        return 0
    verdict = judge(json.loads(args.report.read_text()), allowlist)
    inputs = sorted(p.name for p in args.dir.glob("*.yaml"))
    print(summary(verdict, inputs))
    missing = [n for n in inputs if not verdict.passed[n] and not verdict.failed[n]]
    for name in missing:
        print(f"NOT SCANNED: {name}")
    if verdict.ok and not missing:
        print("checkov: every finding is explained by scripts/checkov-allowlist.yaml")
        return 0
    return 1


if __name__ == "__main__":
    sys.exit(main())
