"""The OwnerReferencesPermissionEnforcement admission plugin (on by default in OpenShift), for
the fake API server; pure. It restates kubernetes plugin/pkg/admission/gc/gc_admission.go,
gcPermissionsEnforcement.Validate:

- a write that does not change the object's ownerReferences passes (isChangingOwnerReference:
  on create, any reference is a change); so does `pods/status` (the plugin's whitelist);
- an update (not a create) that changes them needs `delete` on the object itself ("cannot set
  an ownerRef on a resource you can't delete");
- each reference that newly sets `blockOwnerDeletion: true` (newBlockingOwnerDeletionRefs: new,
  or not blocking before) needs `update` on the owner's `finalizers` subresource, by the
  owner's name, in the object's namespace (ownerRefToDeleteAttributeRecords); an owner kind
  the server does not serve is refused too (no RESTMapping).

The refusal is a 403 worded by admission.NewForbidden: `<resource> "<name>" is forbidden: ...`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

from support.rbac import Attributes, Policy, User, authorize, qualified

Obj = Mapping[str, Any]
# (apiVersion, kind) of an owner -> (group, resource), or None when the kind is not served.
ResourceOf = Callable[[str, str], tuple[str, str] | None]

_WHITELIST = (("", "pods", "status"),)


def _refs(obj: Obj | None) -> list[Obj]:
    return list(((obj or {}).get("metadata") or {}).get("ownerReferences") or [])


def _newly_blocking(new: Obj, old: Obj | None) -> list[Obj]:
    blocking = [r for r in _refs(new) if r.get("blockOwnerDeletion") is True]
    if old is None:
        return blocking
    before = {r.get("uid"): r for r in _refs(old)}
    return [
        r
        for r in blocking
        if r.get("uid") not in before or before[r.get("uid")].get("blockOwnerDeletion") is not True
    ]


def refusal(
    user: User,
    policy: Policy,
    write: Attributes,
    new: Obj,
    old: Obj | None,
    resource_of: ResourceOf,
) -> str | None:
    """The 403 message refusing this create (`old` None) or update, or None to admit it.
    `write` names the object written (group, resource, subresource, namespace, name)."""
    if (write.api_group, write.resource, write.subresource) in _WHITELIST:
        return None
    if old is None and not _refs(new):
        return None
    if old is not None and _refs(new) == _refs(old):
        return None
    name = write.name or (new.get("metadata") or {}).get("name", "")
    subject = qualified(write.api_group, write.resource, name)
    if old is not None:
        delete = dataclasses.replace(write, verb="delete", name=name, resource_request=True)
        allowed, reason = authorize(policy, user, delete)
        if not allowed:
            return (
                f"{subject} is forbidden: cannot set an ownerRef on a resource you can't "
                f"delete: {reason}, <nil>"
            )
    for ref in _newly_blocking(new, old):
        api_version, kind = str(ref.get("apiVersion", "")), str(ref.get("kind", ""))
        owner = resource_of(api_version, kind)
        if owner is None:
            return (
                f"{subject} is forbidden: cannot set blockOwnerDeletion in this case because "
                f"cannot find RESTMapping for APIVersion {api_version} Kind {kind}: , no "
                f'matches for kind "{kind}" in version "{api_version}"'
            )
        group, resource = owner
        finalizers = Attributes(
            "update",
            "",
            True,
            api_group=group,
            api_version=api_version.rpartition("/")[2],
            namespace=write.namespace,
            resource=resource,
            subresource="finalizers",
            name=str(ref.get("name", "")),
        )
        allowed, reason = authorize(policy, user, finalizers)
        if not allowed:
            return (
                f"{subject} is forbidden: cannot set blockOwnerDeletion if an ownerReference "
                f"refers to a resource you can't set finalizers on: {reason}, <nil>"
            )
    return None
