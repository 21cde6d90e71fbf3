"""`dsv4 fetch` against the fake hub: a fresh download in the hub's cache layout, a download
resumed after the process is killed mid-file, a corrupted file refused, a gated repo without a
token, a missing file, a volume too small, `@main` resolved and pinned, the tensor check, the
offline path and the progress document. The kill test runs the command as a process, as the
download Job's container does; the others call the same code in-process."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from fake_hub import FakeHub
from hub_models import synthetic_checkpoint, tiny_config, tiny_files

from dsv4_common.api.fetch_status import FetchStatus, parse_fetch_status
from dsv4_common.api.model_source import HfSource
from dsv4_common.plan.checkpoint_match import TensorEntry
from dsv4_fetch.fetch import FetchOptions
from dsv4_fetch.layout import RepoCache
from dsv4_fetch.run import fetch_with_progress

REPO = "acme/tiny"
BIG = "acme/big-vocab"
# vocab 65536 x hidden 64 x fp32: a 16 MiB embedding and head, past huggingface_hub's 10 MiB
# download chunk, so a stalled download has written a part of its file to disk.
BIG_CONFIG = tiny_config(vocab_size=65536)
CHUNK = 10 << 20


def fetch(
    hub: FakeHub, cache: Path, source: str, *, token: str | None = None, offline: bool = False
) -> tuple[Path | None, FetchStatus]:
    repo, _, rev = source.partition("@")
    options = FetchOptions(cache_dir=cache, endpoint=hub.endpoint, token=token, offline=offline)
    done, status = fetch_with_progress(HfSource(repo, rev or "main"), options, style="none")
    return (done.path if done else None), status


def content_gets(hub: FakeHub) -> list[str]:
    """Paths of file bytes served (the CDN's and the resolve route's GETs)."""
    return [r.path for r in hub.requests if r.method == "GET" and "/api/" not in r.path]


def test_a_fresh_download_lands_in_the_cache_layout_verified(hub: FakeHub, tmp_path: Path) -> None:
    commit = hub.add_repo(REPO, tiny_files())
    path, status = fetch(hub, tmp_path / "cache", REPO)
    assert status.phase == "complete" and status.commit == commit, status
    assert (
        status.bytes_done
        == status.bytes_total
        == sum(p.stat().st_size for p in tiny_files().values())
    )
    assert status.files_done == status.files_total == len(tiny_files())
    assert path == tmp_path / "cache" / "models--acme--tiny" / "snapshots" / commit
    for name, original in tiny_files().items():
        assert (path / name).is_symlink() and (path / name).read_bytes() == original.read_bytes()
    assert (tmp_path / "cache/models--acme--tiny/refs/main").read_text() == commit
    assert "242 tensors match the plan of tiny" in (status.message or "")
    # LFS bytes come from the CDN (no token sent there), small files from the hub.
    assert sum("/cdn/" in p for p in content_gets(hub)) == 2
    # huggingface_hub reads what we wrote: the cache is its layout.
    from huggingface_hub import try_to_load_from_cache

    found = try_to_load_from_cache(REPO, "config.json", cache_dir=tmp_path / "cache")
    assert found == str(path / "config.json")
    # A second fetch finds the verified record: one API call, no byte moves.
    before = len(hub.requests)
    _, again = fetch(hub, tmp_path / "cache", REPO)
    assert again.phase == "complete" and again.commit == commit
    assert [r.path for r in hub.requests[before:]] == [f"/api/models/{REPO}/revision/main"]


@pytest.fixture
def big(hub: FakeHub, tmp_path: Path) -> tuple[str, dict[str, Path]]:
    files = synthetic_checkpoint(tmp_path / "big", BIG_CONFIG, shards=2)
    return hub.add_repo(BIG, files), files


def _cli(cache: Path, endpoint: str, *extra: str) -> list[str]:
    return [
        sys.executable, "-m", "dsv4_cli", "fetch", f"hf://{BIG}", "--cache-dir", str(cache),
        "--endpoint", endpoint, "--progress", "log", *extra,
    ]  # fmt: skip


def _env(tmp_path: Path, token: str | None = None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("HF_")}
    env["HF_HOME"] = str(tmp_path / "hf-home")
    if token is not None:
        env["HF_TOKEN"] = token
    return env


def _wait_for(predicate, timeout_s: float = 60.0) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError("timed out")
        time.sleep(0.05)


def test_a_download_killed_mid_file_resumes_with_a_range_request(
    hub: FakeHub, big: tuple[str, dict[str, Path]], tmp_path: Path
) -> None:
    commit, files = big
    shard = max(
        (n for n in files if n.endswith(".safetensors")), key=lambda n: files[n].stat().st_size
    )
    f = hub.file(BIG, shard)
    assert f.sha256 is not None and f.size > CHUNK + (1 << 20)
    release = hub.stall(f.sha256, CHUNK + (1 << 20))
    cache = tmp_path / "cache"
    partial = RepoCache(cache, BIG).partial_of(f.sha256)
    proc = subprocess.Popen(_cli(cache, hub.endpoint, "--workers", "1"), env=_env(tmp_path))
    try:
        _wait_for(lambda: partial.exists() and partial.stat().st_size >= CHUNK)
        proc.send_signal(signal.SIGKILL)  # as a node going away kills the Job's pod
        proc.wait(30)
    finally:
        release.set()
        if proc.poll() is None:
            proc.kill()
    held = partial.stat().st_size
    assert CHUNK <= held < f.size
    done = subprocess.run(
        _cli(cache, hub.endpoint), env=_env(tmp_path), capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    snapshot = cache / "models--acme--big-vocab" / "snapshots" / commit
    assert done.stdout.strip() == str(snapshot)
    assert (snapshot / shard).read_bytes() == files[shard].read_bytes()
    gets = [r for r in hub.requests if r.method == "GET" and r.path == f"/cdn/{f.sha256}"]
    assert gets[-1].range == f"bytes={held}-" and gets[-1].status == 206
    assert not partial.exists()


def test_a_corrupted_file_is_refused_after_a_second_try(hub: FakeHub, tmp_path: Path) -> None:
    hub.add_repo(REPO, tiny_files())
    hub.corrupt(REPO, "model-00001-of-00002.safetensors")
    path, status = fetch(hub, tmp_path / "cache", REPO)
    assert path is None and status.phase == "failed" and status.reason == "HashMismatch"
    assert "model-00001-of-00002.safetensors" in (status.message or "")
    sha = hub.file(REPO, "model-00001-of-00002.safetensors").sha256
    assert content_gets(hub).count(f"/cdn/{sha}") == 2
    cache = RepoCache(tmp_path / "cache", REPO)
    assert not cache.partial_of(sha).exists()
    assert not any(cache.root.joinpath(".dsv4").glob("*.json"))  # never recorded as verified


def test_a_gated_repo_needs_a_granted_token(hub: FakeHub, tmp_path: Path) -> None:
    hub.add_repo(REPO, tiny_files(), gated=True, tokens=("hf_granted",))
    _, status = fetch(hub, tmp_path / "a", REPO)
    assert status.reason == "Unauthorized" and "401" in (status.message or "")
    assert "gated" in (status.message or "") and "tokenSecretRef" in (status.message or "")
    _, status = fetch(hub, tmp_path / "b", REPO, token="hf_other")
    assert status.reason == "Unauthorized" and "403" in (status.message or "")
    path, status = fetch(hub, tmp_path / "c", REPO, token="hf_granted")
    assert status.phase == "complete" and path is not None
    cdn = [r for r in hub.requests if r.path.startswith("/cdn/")]
    assert cdn and all(r.auth is None for r in cdn)  # the token never leaves the hub
    resolve = [r for r in hub.requests if "/resolve/" in r.path and r.status == 200]
    assert resolve and all(r.auth == "Bearer hf_granted" for r in resolve)


def test_a_private_repo_without_a_token_is_named_unauthorized(hub: FakeHub, tmp_path: Path) -> None:
    hub.add_repo(REPO, tiny_files(), private=True, tokens=("hf_granted",))
    _, status = fetch(hub, tmp_path / "cache", REPO)
    assert status.reason == "Unauthorized" and "401" in (status.message or "")


def test_a_missing_file_is_named(hub: FakeHub, tmp_path: Path) -> None:
    hub.add_repo(REPO, tiny_files())
    hub.hide(REPO, "model.safetensors.index.json")
    _, status = fetch(hub, tmp_path / "cache", REPO)
    assert status.reason == "NotFound" and "model.safetensors.index.json" in (status.message or "")


def test_an_unknown_repo_or_revision_is_not_found(hub: FakeHub, tmp_path: Path) -> None:
    hub.add_repo(REPO, tiny_files())
    _, status = fetch(hub, tmp_path / "cache", f"{REPO}@no-such-branch")
    assert status.reason == "NotFound" and "no-such-branch" in (status.message or "")
    _, status = fetch(hub, tmp_path / "cache", "acme/nothing", token="hf_x")
    assert status.reason == "NotFound"


@pytest.fixture
def small_volume(tmp_path: Path) -> Iterator[Path]:
    """A 4 MiB tmpfs (skipped where mounting is not allowed)."""
    mount = tmp_path / "small"
    mount.mkdir()
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(mount)],
        capture_output=True,
        check=False,
    )
    if done.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here: {done.stderr.decode().strip()}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)


def test_a_volume_too_small_is_refused_before_any_byte_moves(
    hub: FakeHub, big: tuple[str, dict[str, Path]], small_volume: Path
) -> None:
    _, status = fetch(hub, small_volume, BIG)
    assert status.phase == "failed" and status.reason == "VolumeTooSmall", status
    assert "GiB left to download" in (status.message or "")
    assert content_gets(hub) == []


def test_main_is_resolved_once_and_a_commit_stays_pinned(hub: FakeHub, tmp_path: Path) -> None:
    first = hub.add_repo(REPO, tiny_files())
    _, status = fetch(hub, tmp_path / "cache", REPO)
    assert status.commit == first
    changed = {**tiny_files(), "README.md": b"a new readme\n"}
    second = hub.commit(REPO, changed)
    assert second != first
    path, status = fetch(hub, tmp_path / "cache", f"{REPO}@{first}")
    assert status.commit == first and path is not None and path.name == first
    assert (path / "README.md").read_bytes() == tiny_files()["README.md"].read_bytes()
    path, status = fetch(hub, tmp_path / "cache", f"{REPO}@main")
    assert status.commit == second and path is not None
    assert (path / "README.md").read_bytes() == b"a new readme\n"
    # Only the changed file moved: the others' blobs were already there.
    assert [p for p in content_gets(hub) if "README" in p or "/cdn/" in p][-1].endswith("README.md")
    assert (tmp_path / "cache/models--acme--tiny/refs/main").read_text() == second


def test_a_tensor_the_plan_does_not_count_is_named(hub: FakeHub, tmp_path: Path) -> None:
    wrong = {"layers.2.attn.wkv.weight": TensorEntry("F32", (32, 65))}
    files = synthetic_checkpoint(tmp_path / "m", tiny_config(), change=wrong, random=False)
    hub.add_repo(REPO, files)
    _, status = fetch(hub, tmp_path / "cache", REPO)
    assert status.reason == "TensorMismatch", status
    assert (
        "layers.2.attn.wkv.weight: the checkpoint holds F32 [32, 65], the plan counts F32 [32, 64]"
        in (status.message or "")
    )


def test_offline_takes_only_a_verified_snapshot(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    with FakeHub(tmp_path / "hub") as hub:
        commit = hub.add_repo(REPO, tiny_files())
        _, status = fetch(hub, cache, REPO)
        assert status.phase == "complete"
        endpoint = hub.endpoint
    # The hub is gone: offline still finds main's commit, complete.
    options = FetchOptions(cache_dir=cache, endpoint=endpoint, offline=True)
    done, status = fetch_with_progress(HfSource(REPO), options, style="none")
    assert done is not None and done.snapshot.commit == commit and status.phase == "complete"
    done, status = fetch_with_progress(HfSource(REPO, "v2"), options, style="none")
    assert (
        done is None and status.reason == "NotCached" and "never fetched" in (status.message or "")
    )
    # A snapshot whose file went missing is not taken either.
    (cache / "models--acme--tiny" / "snapshots" / commit / "config.json").unlink()
    done, status = fetch_with_progress(HfSource(REPO), options, style="none")
    assert done is None and status.reason == "NotCached"


def test_progress_is_served_while_downloading_and_written_at_the_end(
    hub: FakeHub, big: tuple[str, dict[str, Path]], tmp_path: Path
) -> None:
    commit, files = big
    shard = max(
        (n for n in files if n.endswith(".safetensors")), key=lambda n: files[n].stat().st_size
    )
    f = hub.file(BIG, shard)
    assert f.sha256 is not None
    release = hub.stall(f.sha256, CHUNK + (1 << 20))
    log = tmp_path / "termination-log"
    proc = subprocess.Popen(
        _cli(
            tmp_path / "cache",
            hub.endpoint,
            "--progress-port",
            "0",
            "--progress-host",
            "127.0.0.1",
            "--termination-log",
            str(log),
            "--json",
        ),
        env=_env(tmp_path),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        port = _progress_port(proc)
        seen: list[FetchStatus] = []

        def downloading() -> bool:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/progress", timeout=5) as r:
                seen.append(parse_fetch_status(json.loads(r.read())))
            return seen[-1].phase == "downloading" and seen[-1].bytes_done >= CHUNK

        _wait_for(downloading)
        mid = seen[-1]
        assert mid.commit == commit and mid.bytes_total == sum(
            x.size for x in hub.repos[BIG].commits[commit].values()
        )
        assert mid.bytes_done < mid.bytes_total and mid.files_total == len(files)
    finally:
        release.set()
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    final = parse_fetch_status(json.loads(out))
    assert final.phase == "complete" and final.percent == 100
    assert parse_fetch_status(json.loads(log.read_text())) == final
    assert "tensors match the plan" in (final.message or "") and final.draft_layers


def _progress_port(proc: subprocess.Popen[str]) -> int:
    """The port `--progress-port 0` took, as the command announces it on stderr."""
    assert proc.stderr is not None
    for line in proc.stderr:
        if "progress on http://" in line:
            return int(line.rsplit(":", 1)[1].split("/", 1)[0])
    raise AssertionError("the progress server was never announced")


def test_the_cli_refuses_a_bad_source_fast() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "dsv4_cli", "fetch", "hf://acme"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2 and "hf://ORG/NAME" in done.stderr
