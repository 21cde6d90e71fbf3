"""The Job controller and the kubelet for the operator's download Jobs, in the live tests: for
each Job of the fake API server it creates a pod from the template, runs the pod's container
as a real process (`dsv4 fetch`, the container's command and args, with the claim mounted as a
directory of this machine and the progress port on a loopback address), reports it Running
with that address, and when the process exits reports its termination (exit code, the
termination message it wrote) and the Job's condition: Complete, or Failed when the
podFailurePolicy's exit codes match or the backoff limit is spent, else a new pod.

A second Job of the same claim sees the same directory, as two pods mounting one RWX claim do.
`poll()` advances everything once; a test calls it from its wait loops (no thread).
"""

from __future__ import annotations

import base64
import subprocess
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from support.fake_apiserver import FakeApiServer

from dsv4_common.api.model_source import HF_CACHE_MOUNT_PATH


@dataclass
class _Run:
    pod: str
    proc: subprocess.Popen[bytes]
    log: Path


@dataclass
class JobRunner:
    server: FakeApiServer
    namespace: str
    claims: Path  # a directory per claim name
    ip: str  # the pods' address (their progress port listens there)
    progress_port: int
    runs: dict[str, _Run] = field(default_factory=dict)  # by Job name
    pods: dict[str, int] = field(default_factory=dict)  # pods made per Job
    started: list[str] = field(default_factory=list)  # pod names, in order

    def poll(self) -> None:
        for job in self.server.list("batch/v1", "Job", self.namespace):
            name = job["metadata"]["name"]
            if _finished(job):
                continue
            run = self.runs.get(name)
            if run is None:
                self._start(job)
            elif run.proc.poll() is not None:
                self._ended(job, run)

    def stop(self) -> None:
        for run in self.runs.values():
            if run.proc.poll() is None:
                run.proc.kill()
                run.proc.wait(30)

    def kill(self, job: str) -> None:
        """The node goes away: the pod's process is killed (SIGKILL)."""
        run = self.runs[job]
        run.proc.kill()
        run.proc.wait(30)

    # --- the controller and the kubelet -----------------------------------------------------

    def _start(self, job: Mapping[str, Any]) -> None:
        name = job["metadata"]["name"]
        n = self.pods.get(name, 0)
        self.pods[name] = n + 1
        pod_name = f"{name}-{n}"
        template = job["spec"]["template"]
        spec = template["spec"]
        (container,) = spec["containers"]
        claim = next(
            v["persistentVolumeClaim"]["claimName"] for v in spec["volumes"] if v["name"] == "cache"
        )
        mount = self.claims / claim
        mount.mkdir(parents=True, exist_ok=True)
        log = self.claims.parent / f"{pod_name}.termination-log"
        args = [
            str(mount)
            if a == HF_CACHE_MOUNT_PATH
            else log.as_posix()
            if a == "/dev/termination-log"
            else a
            for a in container["args"]
        ]
        args += ["--progress-host", self.ip]
        args[args.index("--progress-port") + 1] = str(self.progress_port)
        env = {"PYTHONUNBUFFERED": "1", "HF_HOME": str(self.claims.parent / "hf-home")}
        for var in container.get("env") or []:
            if "value" in var:
                env[var["name"]] = var["value"]
            elif "secretKeyRef" in (var.get("valueFrom") or {}):
                ref = var["valueFrom"]["secretKeyRef"]
                secret = self.server.get("v1", "Secret", self.namespace, ref["name"]) or {}
                env[var["name"]] = base64.b64decode(secret["data"][ref["key"]]).decode()
        env["HF_HOME"] = str(self.claims.parent / "hf-home")  # the pod's /tmp
        owner = {
            "apiVersion": "batch/v1",
            "kind": "Job",
            "name": name,
            "uid": job["metadata"]["uid"],
            "controller": True,
            "blockOwnerDeletion": True,
        }
        self.server.create(
            {
                "apiVersion": "v1",
                "kind": "Pod",
                "metadata": {
                    "name": pod_name,
                    "namespace": self.namespace,
                    "labels": dict(template["metadata"]["labels"]),
                    "ownerReferences": [owner],
                },
                "spec": spec,
            },
            keep_status=False,
        )
        argv = [sys.executable, "-m", "dsv4_cli", *container["command"][1:], *args]
        proc = subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        self.runs[name] = _Run(pod_name, proc, log)
        self.started.append(pod_name)
        self.server.set_status(
            "v1",
            "Pod",
            self.namespace,
            pod_name,
            {
                "phase": "Running",
                "podIP": self.ip,
                "containerStatuses": [
                    {"name": "fetch", "ready": True, "restartCount": 0, "state": {"running": {}}}
                ],
            },
        )
        self.server.set_status("batch/v1", "Job", self.namespace, name, {"active": 1})

    def _ended(self, job: Mapping[str, Any], run: _Run) -> None:
        name = job["metadata"]["name"]
        code = run.proc.returncode
        message = run.log.read_text() if run.log.exists() else ""
        finished = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        terminated = {"exitCode": code, "finishedAt": finished, "message": message}
        self.server.set_status(
            "v1",
            "Pod",
            self.namespace,
            run.pod,
            {
                "phase": "Succeeded" if code == 0 else "Failed",
                "containerStatuses": [
                    {"name": "fetch", "restartCount": 0, "state": {"terminated": terminated}}
                ],
            },
        )
        del self.runs[name]
        spec = job["spec"]
        fail_now = any(
            rule["action"] == "FailJob" and code in rule["onExitCodes"]["values"]
            for rule in spec.get("podFailurePolicy", {}).get("rules", [])
            if "onExitCodes" in rule
        )
        failures = sum(1 for _ in range(self.pods[name])) - (1 if code == 0 else 0)
        if code == 0:
            status = {"succeeded": 1, "conditions": [_cond("Complete")]}
        elif fail_now:
            status = {"failed": failures, "conditions": [_cond("Failed", "PodFailurePolicy")]}
        elif failures > spec.get("backoffLimit", 6):
            status = {"failed": failures, "conditions": [_cond("Failed", "BackoffLimitExceeded")]}
        else:
            self.server.set_status("batch/v1", "Job", self.namespace, name, {"failed": failures})
            return  # a new pod on the next poll
        self.server.set_status("batch/v1", "Job", self.namespace, name, status)


def _cond(kind: str, reason: str = "") -> dict[str, str]:
    cond = {"type": kind, "status": "True"}
    if reason:
        cond["reason"] = reason
    return cond


def _finished(job: Mapping[str, Any]) -> bool:
    return any(
        c.get("status") == "True" and c.get("type") in ("Complete", "Failed")
        for c in (job.get("status") or {}).get("conditions") or []
    )
