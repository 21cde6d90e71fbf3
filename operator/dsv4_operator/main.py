"""`kopf run -m dsv4_operator.main`: registers the start-up settings and the handlers."""

from __future__ import annotations

from dsv4_operator import handlers, settings

__all__ = ["handlers", "settings"]
