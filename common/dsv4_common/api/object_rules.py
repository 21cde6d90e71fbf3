"""What the Kubernetes API server (and the kubelet, for images) refuses in the fields a
DSV4Deployment hands to the objects it becomes: DNS-1123 names, image references, environment
variable names, label values, the size of annotations and of a whole object. Pure; each check
returns why it fails, or None. Restated from apimachinery's `util/validation` (IsDNS1123Label,
IsDNS1123Subdomain, IsEnvVarName, IsValidLabelValue), `api/validation/objectmeta.go`
(TotalAnnotationSizeLimitB) and the distribution reference grammar the kubelet parses images by.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Final

DNS1123_LABEL: Final = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
DNS1123_SUBDOMAIN: Final = re.compile(
    r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$"
)
MAX_LABEL_CHARS: Final = 63
MAX_SUBDOMAIN_CHARS: Final = 253
# IsEnvVarName before the relaxed rule (1.34): what every supported API server accepts.
ENV_VAR_NAME: Final = re.compile(r"^[-._a-zA-Z][-._a-zA-Z0-9]*$")
TOTAL_ANNOTATION_BYTES: Final = 256 * 1024  # TotalAnnotationSizeLimitB: keys + values
# etcd's default request limit (--max-request-bytes): an object past it is never stored.
MAX_OBJECT_BYTES: Final = 1536 * 1024
MAX_IMAGE_CHARS: Final = 512

# The distribution reference grammar: [domain[:port]/]path[:tag][@digest] (RE2 and Python
# alike; the CRD's `pattern` on spec.image is the same text).
_COMPONENT: Final = r"[a-z0-9]+(?:(?:[._]|__|[-]+)[a-z0-9]+)*"
_DOMAIN: Final = (
    r"(?:[a-zA-Z0-9]|[a-zA-Z0-9][a-zA-Z0-9-]*[a-zA-Z0-9])"
    r"(?:\.(?:[a-zA-Z0-9]|[a-zA-Z0-9][a-zA-Z0-9-]*[a-zA-Z0-9]))*(?::[0-9]+)?"
)
IMAGE_REFERENCE_PATTERN: Final = (
    rf"^(?:{_DOMAIN}/)?{_COMPONENT}(?:/{_COMPONENT})*"
    r"(?::[A-Za-z0-9_][A-Za-z0-9_.-]{0,127})?"
    r"(?:@[A-Za-z][A-Za-z0-9]*(?:[-_+.][A-Za-z][A-Za-z0-9]*)*:[0-9a-fA-F]{32,})?$"
)
IMAGE_REFERENCE: Final = re.compile(IMAGE_REFERENCE_PATTERN)


def dns1123_label_error(name: str) -> str | None:
    if len(name) > MAX_LABEL_CHARS or not DNS1123_LABEL.fullmatch(name):
        return (
            f"{name!r} must be a DNS-1123 label: at most {MAX_LABEL_CHARS} lower-case letters, "
            "digits and '-', starting and ending with a letter or digit"
        )
    return None


def dns1123_subdomain_error(name: str) -> str | None:
    if len(name) > MAX_SUBDOMAIN_CHARS or not DNS1123_SUBDOMAIN.fullmatch(name):
        return (
            f"{name!r} must be a DNS-1123 subdomain: at most {MAX_SUBDOMAIN_CHARS} lower-case "
            "letters, digits, '-' and '.'"
        )
    return None


def image_error(image: str) -> str | None:
    """Why `image` is not an image reference the kubelet can pull (no whitespace, no
    newline, an upper-case repository, an empty tag...), or None."""
    if len(image) > MAX_IMAGE_CHARS or not IMAGE_REFERENCE.fullmatch(image):
        shown = image if len(image) <= 80 else image[:77] + "..."
        return (
            f"{shown!r} is not an image reference ([registry[:port]/]repository[:tag][@digest], "
            f"lower-case repository, no whitespace, at most {MAX_IMAGE_CHARS} characters)"
        )
    return None


def env_name_error(name: str) -> str | None:
    if not ENV_VAR_NAME.fullmatch(name):
        return (
            f"{name!r} must be an environment variable name: letters, digits, '_', '-' and "
            "'.', not starting with a digit"
        )
    return None


def annotations_bytes(annotations: Mapping[str, str]) -> int:
    """What the API server counts against TOTAL_ANNOTATION_BYTES."""
    return sum(len(k.encode()) + len(v.encode()) for k, v in annotations.items())


def annotations_error(annotations: Mapping[str, str]) -> str | None:
    size = annotations_bytes(annotations)
    if size > TOTAL_ANNOTATION_BYTES:
        return f"may not be more than {TOTAL_ANNOTATION_BYTES} bytes in total, got {size}"
    return None
