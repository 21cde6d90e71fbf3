"""The roles of router.json, read again when the file changes: how a router started from
`--config-dir` learns of groups added or removed while it runs (`dsv4 up` scaling; the
operator's routers find groups through DNS instead). The file is replaced atomically by its
writer; a file that does not parse is logged and the roles known so far are kept.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from pathlib import Path

from dsv4_common.api.names import WorkerRole
from dsv4_router.config import ConfigError, RoleTargets, read_roles

log = logging.getLogger(__name__)

Stamp = tuple[int, int, int]  # (inode, size, mtime in ns)


class RolesFile:
    def __init__(self, path: Path) -> None:
        self._path = path
        self._stamp = self._read_stamp()

    def _read_stamp(self) -> Stamp | None:
        try:
            st = os.stat(self._path)
        except OSError:
            return None
        return (st.st_ino, st.st_size, st.st_mtime_ns)

    def changed(self) -> Mapping[WorkerRole, RoleTargets] | None:
        """The roles, when the file changed since the last look and parses; else None."""
        stamp = self._read_stamp()
        if stamp is None or stamp == self._stamp:
            return None
        self._stamp = stamp
        try:
            roles = read_roles(self._path)
        except ConfigError as exc:
            log.warning(
                "%s changed but cannot be used (%s); keeping the roles known", self._path, exc
            )
            return None
        counts = ", ".join(f"{role} {len(t.instances)}" for role, t in roles.items())
        log.info("%s changed: instances now %s", self._path, counts)
        return roles
