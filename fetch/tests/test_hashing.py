"""The hashing writer: whatever mix of writes, seeks back and truncations a downloader makes,
its digest is the hash of the bytes the file ends up holding, and the callback's sum is the
file's length."""

from __future__ import annotations

import hashlib
from pathlib import Path

from hypothesis import given, settings
from hypothesis import strategies as st

from dsv4_fetch.hashing import HashingWriter, expected_digest
from dsv4_fetch.hub import RepoFile

OPS = st.lists(
    st.one_of(
        st.tuples(st.just("write"), st.binary(min_size=1, max_size=64)),
        st.tuples(st.just("rewind"), st.integers(0, 200)),
    ),
    max_size=20,
)


@settings(max_examples=60, deadline=None)
@given(st.binary(max_size=100), OPS, st.booleans())
def test_the_digest_is_the_files_hash(
    prefix: bytes, ops: list[tuple[str, object]], lfs: bool
) -> None:
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "partial"
        path.write_bytes(prefix)
        sizes: list[int] = []
        with path.open("r+b") as raw:
            raw.seek(0, 2)
            f = RepoFile("x", 0, "0" * 40, "0" * 64 if lfs else None)
            writer = HashingWriter(raw, path, f, sizes.append)
            for op, arg in ops:
                if op == "write":
                    assert isinstance(arg, bytes)
                    writer.write(arg)
                else:
                    assert isinstance(arg, int)
                    position = max(writer.tell() - arg, 0)  # as http_get rewinds on a 200
                    writer.seek(position)
                    writer.truncate()
            raw.flush()
            data = path.read_bytes()
            if lfs:
                want = hashlib.sha256(data).hexdigest()
            else:
                want = hashlib.sha1(b"blob 0\0" + data).hexdigest()  # size is the listing's
            assert writer.hexdigest() == want
            assert writer.length == len(data) == len(prefix) + sum(sizes)


def test_the_expected_digest_is_sha256_for_lfs_and_the_blob_id_otherwise() -> None:
    assert expected_digest(RepoFile("a", 1, "b" * 40, "c" * 64)) == "c" * 64
    assert expected_digest(RepoFile("a", 1, "b" * 40)) == "b" * 40
