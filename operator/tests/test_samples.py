"""The spec model and the CRD agree: every committed sample the CRD accepts parses (with the
same defaults the API server would fill in), and every invalid sample is rejected naming the
field its `# expect:` line names."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from support import crd_support as S

from dsv4_common.api.spec import SpecError, parse_spec

VALID = S.valid_samples()
INVALID = S.invalid_samples()


def test_there_are_samples_of_both_kinds() -> None:
    assert len(VALID) >= 3 and len(INVALID) >= 10


@pytest.mark.parametrize("path", VALID, ids=[p.name for p in VALID])
def test_valid_sample_parses_with_the_crd_defaults(path: Path) -> None:
    body = yaml.safe_load(path.read_text())
    defaulted = S.apply_defaults(S.crd_schema(), body)
    assert parse_spec(body) == parse_spec(defaulted)


@pytest.mark.parametrize("path", INVALID, ids=[p.name for p in INVALID])
def test_invalid_sample_is_rejected_naming_the_field(path: Path) -> None:
    with pytest.raises(SpecError) as info:
        parse_spec(yaml.safe_load(path.read_text()))
    field = S.expected_path(path)
    assert any(e.startswith(field) for e in info.value.errors), info.value.errors
