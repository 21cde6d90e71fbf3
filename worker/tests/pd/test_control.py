"""The PD control messages: every message survives encode -> decode exactly, and a body that
does not match its dataclass is refused naming the field (down to a list item's index)."""

from __future__ import annotations

import dataclasses
import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from dsv4_worker.pd import control as C

ints = st.integers(min_value=-(2**62), max_value=2**62)
texts = st.text(max_size=12)
int_tuples = st.lists(ints, max_size=40).map(tuple)

sampling = st.builds(
    C.Sampling,
    temperature=st.floats(allow_nan=False, allow_infinity=False),
    top_p=st.floats(allow_nan=False, allow_infinity=False),
    top_k=ints,
    seed=st.none() | ints,
)
messages = st.one_of(
    st.builds(C.Hello, protocol=ints, nonce=texts),
    st.builds(C.Challenge, session=texts, instance=texts, proof=texts),
    st.builds(
        C.Welcome,
        ok=st.booleans(),
        message=texts,
        manifest_hash=texts,
        closed=st.lists(texts, max_size=4).map(tuple),
    ),
    st.builds(C.Ping, echo=ints),
    st.builds(C.Pong, instance=texts, known=st.booleans(), number=ints),
    st.builds(
        C.PrefillRequest,
        room=texts,
        prompt=int_tuples,
        sampling=sampling,
        stop_token_ids=int_tuples,
        timeout_s=st.floats(allow_nan=False, allow_infinity=False),
    ),
    st.builds(
        C.Destination,
        room=texts,
        dst_full_pages=int_tuples,
        dst_swa_pages=int_tuples,
        dst_slot=ints,
        epoch=ints,
    ),
    st.builds(
        C.Done,
        room=texts,
        first_token=ints,
        generator_state=st.none() | texts,
        tags=st.lists(texts, max_size=6).map(tuple),
    ),
    st.builds(C.Failed, room=texts, message=texts),
    st.builds(C.Abort, room=texts),
    st.builds(C.Aborted, room=texts),
)


@given(messages)
def test_every_message_round_trips_exactly(msg: C.Message) -> None:
    decoded = C.decode(C.encode(msg))
    assert decoded == msg and type(decoded) is type(msg)
    for field in dataclasses.fields(decoded):
        assert not isinstance(getattr(decoded, field.name), list)  # tuples stay tuples


MESSAGES = {
    "prefill": C.PrefillRequest("r1", (1, 2, 3), C.Sampling(0.0, 1.0, 0, None), (7,), 60.0),
    "destination": C.Destination("r1", (4, 5), (6,), 1, 7),
}


@pytest.mark.parametrize(
    ("kind", "field", "value", "needle"),
    [
        ("prefill", "prompt", [1, "2", 3], "prefill.prompt[1]: must be an integer, got '2'"),
        ("prefill", "prompt", [1, True], "prefill.prompt[1]: must be an integer, got True"),
        ("prefill", "prompt", [1, 2.0], "prefill.prompt[1]: must be an integer, got 2.0"),
        ("prefill", "prompt", "123", "prefill.prompt: must be a list, got str"),
        ("prefill", "sampling", {"temperature": 0.0}, "prefill.sampling.top_p: required"),
        ("prefill", "timeout_s", float("inf"), "prefill.timeout_s: must be finite"),
        ("destination", "dst_swa_pages", None, "destination.dst_swa_pages: must be a list"),
        ("destination", "dst_slot", KeyError, "destination.dst_slot: required"),
        ("destination", "epoch", KeyError, "destination.epoch: required"),
    ],
)
def test_a_bad_field_is_refused_naming_it(
    kind: str, field: str, value: object, needle: str
) -> None:
    body = json.loads(C.encode(MESSAGES[kind])[1])
    if value is KeyError:
        del body[field]
    else:
        body[field] = value
    with pytest.raises(C.ControlError) as info:
        C.decode([kind.encode(), json.dumps(body).encode()])
    assert needle in str(info.value)


def test_a_tag_list_names_the_bad_item() -> None:
    body = {"room": "r", "first_token": 1, "generator_state": None, "tags": ["a", 2]}
    with pytest.raises(C.ControlError, match=r"done\.tags\[1\]: must be a string, got 2"):
        C.decode([b"done", json.dumps(body).encode()])


@pytest.mark.parametrize(
    ("frames", "needle"),
    [
        ([b"prefill"], "expected 2 frames, got 1"),
        ([b"nope", b"{}"], "unknown type 'nope'"),
        ([b"abort", b"{not json"], "Expecting property name"),
        ([b"abort", b"[]"], "abort: must be an object, got list"),
    ],
)
def test_a_malformed_message_is_refused(frames: list[bytes], needle: str) -> None:
    with pytest.raises(C.ControlError) as info:
        C.decode(frames)
    assert needle in str(info.value)
