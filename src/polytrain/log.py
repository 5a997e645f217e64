"""Logging with the process's rank, role and machine in every line's prefix."""

from __future__ import annotations

import logging

from . import _env

__all__ = ["set_identity"]

_identity = "[polytrain]"


class _Prefix(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        record.polytrain_id = _identity
        return True


def set_identity(rank: int, role: str, machine: str, label: str = "") -> None:
    """Put ``rank role@machine`` (and the label, if any) in front of every log line."""
    global _identity
    extra = f" {label}" if label else ""
    _identity = f"[polytrain {rank} {role}@{machine}{extra}]"


def _configure() -> None:
    root = logging.getLogger("polytrain")
    if root.handlers:
        return
    handler = logging.StreamHandler()
    handler.addFilter(_Prefix())
    handler.setFormatter(logging.Formatter("%(polytrain_id)s %(levelname)s %(name)s: %(message)s"))
    root.addHandler(handler)
    level = _env.log_level()
    if not isinstance(logging.getLevelName(level), int):  # a name it knows maps to its number
        # A bad setting must not stop `import polytrain`: say so, and keep the default.
        handler.handle(logging.makeLogRecord({
            "name": "polytrain", "levelname": "WARNING", "levelno": logging.WARNING,
            "msg": f"POLYTRAIN_LOG_LEVEL={level!r} is not a level (DEBUG, INFO, WARNING, "
                   f"ERROR): WARNING is used"}))
        level = "WARNING"
    root.setLevel(level)
    root.propagate = False


_configure()
