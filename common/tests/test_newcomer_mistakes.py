"""The newcomer's first hour (issue #39), as one table: each mistake a new user made, typed as
they typed it, must exit with a message naming the flag or field and the fix, fast. Every row
is a real process (`python -m dsv4_cli ...`, or `scripts/run.sh`), timed from start to exit.

The time bound is coarse on purpose (the machine is shared and loaded): these mistakes used to
be answered after torch was imported and the model loaded (17-35 s measured in the issue), and
`dsv4 serve`'s are now answered before torch is imported at all (asserted: torch is not in
`sys.modules` when such a row's process exits). Rows of the other commands need no torch
either. What is not a message (the `api:` labels, the second Ctrl-C, the work directory, the
docs' recipes, transformers loading the tiny weights) has its own tests: local/tests/test_up.py,
local/tests/test_supervisor.py, e2e/test_doc_recipes.py, worker/tests/model/test_packaged_tiny.py.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import pytest
from repo_paths import MODEL_DATA, ROOT, SAMPLES

from dsv4_common.api.pd_secret import PD_SECRET_ENV

TINY_DIR = ROOT / "worker" / "dsv4_worker" / "models" / "tiny"
BOUND_S = 5.0  # coarse: the same mistakes took 17-35 s after torch and the model loaded
TORCH_MARK = "newcomer-test: torch was imported"
# `dsv4 ARGS` in this interpreter; says whether torch got imported by the time it exits.
CLI = f"""
import sys
from dsv4_cli.main import main
try:
    code = main(sys.argv[1:])
except SystemExit as exc:
    code = exc.code
finally:
    if "torch" in sys.modules:
        print({TORCH_MARK!r}, file=sys.stderr)
sys.exit(code)
"""


@dataclass(frozen=True)
class Mistake:
    argv: tuple[str, ...]  # `dsv4` arguments, or a script's path and its arguments
    says: tuple[str, ...]  # in the message, in this order
    code: int = 2
    env: dict[str, str] = field(default_factory=dict)
    no_torch: bool = True  # checked before torch is imported
    timed: bool = True  # within BOUND_S


NO_GPU = {"CUDA_VISIBLE_DEVICES": ""}  # the same answer on a GPU machine
PD_SECRET = {PD_SECRET_ENV: "7" * 64}  # a PD role's secret, so the mistake is the one named
PRO_CONFIG = str(MODEL_DATA / "deepseek-v4-pro" / "config.json")

MISTAKES: dict[str, Mistake] = {
    # pro-pd-pp.yaml asked our engine for mooncake: refused at validation, not 25 s into start
    "render: mooncake with engine dsv4": Mistake(
        ("render", str(SAMPLES / "invalid" / "dsv4-mooncake-transfer.yaml")),
        ("spec.kv.transfer: must be one of ['nixl', 'zmq'] with engine.name dsv4",
         "mooncake needs engine.name sglang"),
    ),
    "up: mooncake with engine dsv4": Mistake(
        ("up", str(SAMPLES / "invalid" / "dsv4-mooncake-transfer.yaml"), "--port", "0"),
        ("dsv4 up: error: spec.kv.transfer: must be one of ['nixl', 'zmq']",),
    ),
    # its configPath is the cluster's: render says to give the file, and then renders
    "render: a configPath of the cluster": Mistake(
        ("render", str(SAMPLES / "pro-pd-pp.yaml")),
        ("spec.model.configPath: ", "dsv4 render --model-config FILE"),
    ),
    "render: --model-config for a configPath": Mistake(
        ("render", str(SAMPLES / "pro-pd-pp.yaml"), "--model-config", PRO_CONFIG), (), code=0
    ),
    "render: a configMapRef without the file": Mistake(
        ("render", str(SAMPLES / "flash-configmap.yaml")),
        ("spec.model.configMapRef: ", "--model-config FILE"),
    ),
    # `dsv4 serve` mistakes: named before torch is imported
    "serve: --model a typo": Mistake(
        ("serve", "--model", "deepseek-v4-flsh"),
        ("--model: model 'deepseek-v4-flsh' is neither a preset (deepseek-v4-flash, ",),
    ),
    "serve: --model a directory without config.json": Mistake(
        ("serve", "--model", "{empty}"), ("--model: model directory '{empty}' has no config.json",)
    ),
    "serve: --model a directory without weights": Mistake(
        ("serve", "--model", "{config_only}"),
        ("--model {config_only}: the directory holds config.json but no weights", "--seed N"),
    ),
    "serve: an index naming shards that are not there": Mistake(
        ("serve", "--model", "{no_shards}"),
        ("names shards that are not there: model-00001-of-00002.safetensors",),
    ),
    "serve: --weights that do not exist": Mistake(
        ("serve", "--weights", "{empty}/w.safetensors"),
        ("--weights {empty}/w.safetensors: no such file or directory",),
    ),
    "serve: --tokenizer that does not exist": Mistake(
        ("serve", "--tokenizer", "{empty}/tokenizer.json"), ("--tokenizer {empty}/tokenizer.json",)
    ),
    "serve: --port in use": Mistake(
        ("serve", "--port", "{busy}"),
        ("--port: cannot listen on 127.0.0.1:{busy}", "--port 0 takes any free port"),
    ),
    "serve: --host no address": Mistake(
        ("serve", "--host", "256.1.1.1"), ("--host: cannot listen on '256.1.1.1'",)
    ),
    "serve: --context-len past the model's": Mistake(
        ("serve", "--context-len", "1000000"),
        ("--context-len: context_len=1000000 exceeds the model's context of 4096 tokens",),
    ),
    "serve: too little memory for the weights": Mistake(
        ("serve", "--gpu-memory-gib", "0.001"), ("(--gpu-memory-gib", "weights need")
    ),
    "serve: --device cuda without a GPU": Mistake(
        ("serve", "--device", "cuda"), ("--device cuda: ", "; --device cpu serves on the CPU")
    ),
    "serve: --device cuda with every GPU hidden": Mistake(
        ("serve", "--device", "cuda"),
        ("--device cuda: CUDA_VISIBLE_DEVICES='' hides every GPU",),
        env=NO_GPU,
    ),
    "serve: a PD role without a PD secret": Mistake(
        ("serve", "--role", "prefill"),
        ("--role prefill: no PD secret", "--pd-secret-file FILE or DSV4_PD_SECRET"),
        env={PD_SECRET_ENV: ""},
    ),
    "serve: a decode without --prefill": Mistake(
        ("serve", "--role", "decode"),
        ("--role decode needs --prefill HOST:PORT",),
        env=PD_SECRET,
    ),
    "serve: --prefill without a port": Mistake(
        ("serve", "--role", "decode", "--prefill", "prefill-host"),
        ("--prefill prefill-host: expected HOST:PORT",),
        env=PD_SECRET,
    ),
    "serve: a prefill's --kv-port in use": Mistake(
        ("serve", "--role", "prefill", "--port", "0", "--kv-port", "{busy}"),
        ("--kv-port: cannot listen on 127.0.0.1:{busy}",),
        env=PD_SECRET,
    ),
    "serve: rank 0's --pp-addr port in use": Mistake(
        ("serve", "--port", "0", "--pp-size", "2", "--pp-addr", "127.0.0.1:{busy}"),
        ("--pp-addr: cannot listen on 127.0.0.1:{busy}",),
    ),
    "serve: --pp-size without --pp-addr": Mistake(
        ("serve", "--pp-size", "2"), ("--pp-addr HOST:PORT is required with --pp-size > 1",)
    ),
    "serve: --config-dir without the rank config": Mistake(
        ("serve", "--role", "decode", "--config-dir", "{empty}"),
        ("--config-dir: cannot read {empty}/decode-rank-0.json",),
    ),
    # a GPU sample on a CPU machine: refused at plan time, before any process starts
    "up: a GPU sample without a GPU": Mistake(
        ("up", str(SAMPLES / "flash-gpu.yaml")),
        ("spec.gpu: this sample needs a GPU (gpu.type h200, 4 per pod)",
         "use a CPU-mode sample, crds/samples/tiny-*.yaml"),
        env=NO_GPU,
    ),
    "up: the router port in use": Mistake(
        ("up", str(SAMPLES / "tiny-pd.yaml"), "--port", "{busy}"),
        ("--port: {busy} is in use on 127.0.0.1",),
    ),
    # scripts/run.sh passes flags to dsv4 up (it said "invalid choice: '9000'")
    "run.sh: --port reaches dsv4 up": Mistake(
        ("scripts/run.sh", "--port", "{busy}"),
        ("dsv4 up: error: --port: {busy} is in use",),
        timed=False,  # its set-up first installs whatever pyproject.toml gained since the last
    ),
    "plan: --model a directory without config.json": Mistake(
        ("plan", "--model", "{empty}", "--gpu", "h200"),
        ("--model: model directory '{empty}' has no config.json",),
    ),
}  # fmt: skip


@pytest.fixture(scope="module")
def paths(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    """The directories the rows name, and a port something listens on."""
    root = tmp_path_factory.mktemp("newcomer")
    empty = root / "empty"
    empty.mkdir()
    config_only = root / "config-only"
    config_only.mkdir()
    shutil.copy(TINY_DIR / "config.json", config_only / "config.json")
    no_shards = root / "no-shards"
    no_shards.mkdir()
    for name in ("config.json", "model.safetensors.index.json"):
        shutil.copy(TINY_DIR / name, no_shards / name)
    index = json.loads((no_shards / "model.safetensors.index.json").read_text())
    assert "model-00001-of-00002.safetensors" in index["weight_map"].values()
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        yield {
            "empty": str(empty),
            "config_only": str(config_only),
            "no_shards": str(no_shards),
            "busy": str(busy.getsockname()[1]),
        }


@pytest.mark.parametrize("name", MISTAKES)
def test_a_newcomer_mistake_is_named_fast(name: str, paths: dict[str, str]) -> None:
    mistake = MISTAKES[name]
    argv = [a.format(**paths) for a in mistake.argv]
    if argv[0].endswith(".sh"):
        command = [str(ROOT / argv[0]), *argv[1:]]
    else:
        command = [sys.executable, "-c", CLI, *argv]
    env = {**os.environ, **mistake.env}
    started_s = time.monotonic()
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    took_s = time.monotonic() - started_s
    print(f"{name}: exit {done.returncode} in {took_s:.2f} s")  # the figures, with -s
    assert done.returncode == mistake.code, done.stderr
    if mistake.code:
        assert "Traceback" not in done.stderr, done.stderr
        errors = [line for line in done.stderr.splitlines() if "error" in line.lower()]
        assert len(errors) == 1, done.stderr  # one line says it
        message, at = errors[0], 0
        for needle in mistake.says:
            at = message.index(needle.format(**paths), at)  # ValueError: not said (in order)
    if mistake.no_torch and not argv[0].endswith(".sh"):
        assert TORCH_MARK not in done.stderr
    assert took_s < BOUND_S or not mistake.timed, f"{name}: {took_s:.1f} s"
