"""Checkpoints: save, load and resume a run; a manifest of sizes and checksums checks each one."""

from .manifest import CheckpointError, newest, resolve, verify, whole_checkpoints
from .resume import check_compatible, run_record
from .state import Resumed, load, save

__all__ = ["save", "load", "Resumed", "CheckpointError", "newest", "resolve", "verify",
           "whole_checkpoints", "check_compatible", "run_record"]
