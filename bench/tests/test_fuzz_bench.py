"""bench/fuzz.py: its hostile bodies are the same for a seed and cover every family (raw bytes,
completions and chats, accepted extremes, out-of-range and wrong-typed fields, `$ref` cycles);
a short run against `dsv4 serve` meets every target and prints its figures."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import fuzz
import pytest
from benchjson import parse

BENCH = Path(__file__).resolve().parents[1]


def test_the_bodies_are_seeded_and_cover_every_family() -> None:
    bodies = fuzz.hostile_bodies(7, 400)
    assert bodies == fuzz.hostile_bodies(7, 400) and bodies != fuzz.hostile_bodies(8, 400)
    paths = {path for path, _ in bodies}
    assert paths == {"/v1/completions", "/v1/chat/completions"}
    assert any(body in fuzz.RAW for _, body in bodies)
    docs = []
    for _, body in bodies:
        try:
            docs.append(json.loads(body))
        except ValueError:
            continue
    dicts = [d for d in docs if isinstance(d, dict)]
    assert any(d.get("temperature") == fuzz.TINY for d in dicts)
    assert any(d.get("repetition_penalty") == fuzz.TINY for d in dicts)
    assert any(isinstance(d.get("top_p"), str) or d.get("top_p") is True for d in dicts)
    refs = [d for d in dicts if '"$ref": "#"' in json.dumps(d.get("response_format"))]
    assert refs
    # Half of the JSON bodies keep every field inside its accepted range: the engine runs them.
    inside = [d for d in dicts if all(d.get(k) in v for k, v in fuzz.ACCEPTED.items() if k in d)]
    assert len(inside) > len(dicts) / 3


@pytest.mark.slow
def test_fuzz_runs_against_dsv4_serve(tmp_path: Path) -> None:
    argv = [str(BENCH / "fuzz.py"), "--surface", "serve", "--bodies", "40", "--json"]
    proc = subprocess.run(
        [sys.executable, *argv, "--workdir", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    figures = parse(proc.stdout)
    for label in ("deaths", "hangs", "5xx", "leaked pages", "failed controls"):
        assert figures[f"serve {label}"].value == 0
