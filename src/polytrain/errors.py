"""The errors polytrain raises: each names the rule, the values and the fix."""

from __future__ import annotations

import numbers
from typing import Iterable

__all__ = ["PolytrainError", "ConfigError", "LaunchError", "CommError", "CommTimeout", "PeerLost",
           "ClosedByTimeout", "is_timeout", "kept_error", "unknown", "at_least", "divisors",
           "first_line", "check_whole", "CLOSED_BY_TIMEOUT"]

# gloo's text for a receive cut off because another wait on the same group timed out.
CLOSED_BY_TIMEOUT = "Application timeout caused pair closure"
# torch's texts for a wait that ran out of time: gloo's, the store's, NCCL's watchdog.
_TIMEOUT_MARKERS = ("Timed out", "timed out", "Timeout", "operation timeout", "wait timeout")


class PolytrainError(Exception):
    """Base of polytrain's errors; the text reads ``what went wrong. HINT: what to do``."""

    def __init__(self, what: str, hint: str | None = None) -> None:
        self.what = what
        self.hint = hint
        super().__init__(what if hint is None else f"{what}. HINT: {hint}")


class ConfigError(PolytrainError, ValueError):
    """Bad input: options, layouts or models that cannot work together."""


def unknown(what: str, value: object, choices: Iterable[str], hint: str, *,
            plural: str | None = None) -> ConfigError:
    """The error for a name that is none of ``choices``, listing them (``plural`` defaults to
    ``what`` + s): ``unknown optimizer 'x'; the optimizers are: sgd, adam``."""
    return ConfigError(f"unknown {what} {value!r}; the {plural or what + 's'} are: "
                       f"{', '.join(choices)}", hint)


def left_run(what: str, hint: str = "finish every sum before the shutdown: a launched "
                                    "process joins its run once") -> ConfigError:
    """The refusal of ``what`` ("'x' was submitted") after this process left the run: its
    groups are gone, so a send or a wait would fail as a lost peer. In a plain ``python
    script.py`` (a run of one worker) :func:`polytrain.init` may join a new run after it."""
    return ConfigError(f"{what} after this process left the run (the shutdown() of its "
                       f"context, polytrain.init()'s, which bps.shutdown() calls)", hint)


def check_whole(flag: str, value: object, hint: str | None = None) -> None:
    """Refuse a count (``flag``'s value; None passes) that is not a whole number: one given
    as 10.5, "32" or True (a JSON config's 1e3 is a float) failed inside every worker, or (a
    seed of 1.5) was cut short silently. ``hint`` (default: pass the flag a whole number,
    the float's own where it is one)."""
    if value is None or (isinstance(value, numbers.Integral) and not isinstance(value, bool)):
        return
    if hint is None:
        hint = (f"pass {flag} {int(value)}" if isinstance(value, float) and value.is_integer()
                else f"pass {flag} as a whole number")
    raise ConfigError(f"{flag} must be a whole number (got {value!r})", hint)


def at_least(name: str, value: float, hint: str, minimum: int = 1, *,
             whole: bool = False) -> None:
    """Refuse ``value`` under ``minimum``: ``--steps must be at least 1 (got 0)``, ``--servers
    must be 0 or more (got -1)``; with ``whole``, first :func:`check_whole` (``num_experts
    must be a whole number (got 4.0)``: a float met torch's TypeError later)."""
    if whole:
        check_whole(name, value, hint)
    if value < minimum:
        least = "0 or more" if minimum == 0 else f"at least {minimum}"
        raise ConfigError(f"{name} must be {least} (got {value})", hint)


def first_line(e: BaseException, limit: int = 200) -> str:
    """``Type: the first line of its text`` (at most ``limit`` characters), for a refusal
    that names an error raised by what it called (torch's texts run over lines)."""
    return f"{type(e).__name__}: {(str(e).strip().splitlines() or [''])[0][:limit]}"


def divisors(n: int, *also: int) -> list[int]:
    """The divisors of ``n`` that also divide each of ``also``, for a hint: ``pass --nodes
    one of [1, 2, 4]``."""
    return [d for d in range(1, n + 1) if all(m % d == 0 for m in (n, *also))]


class LaunchError(PolytrainError, RuntimeError):
    """A launched process failed, died or was interrupted; the text names it."""

    def __init__(self, what: str, hint: str | None = None, *, rank: int | None = None,
                 role: str | None = None, machine: str | None = None,
                 exitcode: int | None = None, bad_input: bool = False,
                 interrupted: bool = False) -> None:
        super().__init__(what, hint)
        self.rank = rank
        self.role = role
        self.machine = machine
        self.exitcode = exitcode
        self.bad_input = bad_input  # the process raised ConfigError: a rerun fails the same
        self.interrupted = interrupted  # the launcher was (Ctrl-C, SIGTERM, SIGHUP)


class CommError(PolytrainError, RuntimeError):
    """Communication with a peer failed: it stopped, or the peers disagree.
    ``names_waited_for``: the text names the peers it waited for already (workers that
    never called a collective ``save()``): a launcher names one of them still working in its
    stead, but not one whose script had ended (the text says why)."""

    names_waited_for = False


class CommTimeout(CommError, TimeoutError):
    """A peer did not answer within the timeout (``waited_s``, where known)."""

    def __init__(self, what: str, hint: str | None = None, *,
                 waited_s: float | None = None, names_waited_for: bool = False) -> None:
        super().__init__(what, hint)
        self.waited_s = waited_s
        self.names_waited_for = names_waited_for


class PeerLost(CommError):
    """A peer process stopped (crashed, was killed, or closed its connections); ``peer``: its
    rank, where known."""

    peer_lost = True

    def __init__(self, what: str, hint: str | None = None, *, peer: int | None = None) -> None:
        super().__init__(what, hint)
        self.peer = peer


class ClosedByTimeout(CommError):
    """Another wait of this process on the same group timed out, and gloo closed every
    connection of the group: that wait's own error is the cause."""

    peer_lost = True  # secondary: the launcher prefers any other cause


def is_timeout(exc: BaseException) -> bool:
    """Whether ``exc`` is a wait for peers that ran out of time: polytrain's
    :class:`CommTimeout`, or torch's own error (a ``RuntimeError``) for one."""
    if isinstance(exc, CommTimeout):
        return True
    text = str(exc)
    return isinstance(exc, RuntimeError) and not isinstance(exc, PolytrainError) and \
        CLOSED_BY_TIMEOUT not in text and any(m in text for m in _TIMEOUT_MARKERS)


def kept_error(kept: BaseException | None, new: BaseException) -> BaseException:
    """Of two errors a process's threads raised, the one to report: the first, unless it was
    only cut off by the other's timeout (:class:`ClosedByTimeout`)."""
    if kept is None or (isinstance(kept, ClosedByTimeout) and
                        not isinstance(new, ClosedByTimeout)):
        return new
    return kept
