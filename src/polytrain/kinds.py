"""The kind of value each field of a dataclass (or keyword of a function) takes, from its
annotation: values of another kind, given from Python, refused in one line."""

from __future__ import annotations

import collections.abc
import dataclasses
import functools
import inspect
import numbers
import os
import types
import typing
from typing import Any, Callable, Collection, Mapping

import numpy

from .errors import ConfigError, check_whole

__all__ = ["check_kinds", "plain"]


def check_kinds(owner: type | Callable[..., Any], values: Mapping[str, Any], *,
                flags: Mapping[str, str] | None = None, paths: Collection[str] = (),
                what: str = "") -> dict[str, Any]:
    """``values`` (fields of dataclass ``owner``, or keywords of function ``owner``, by
    name), refused where one is of another kind than its annotation, given from Python (the
    CLI parses its flags to these): ``lr="0.1"`` failed inside torch, ``quiet="no"`` was
    taken for True. numpy's scalars count as Python's and are made them (a record of them is
    JSON), a count must be a whole number (``check_whole``, named by its flag in
    ``flags``), a float field takes an int too, and a field in ``paths`` a ``pathlib.Path``
    (made a str). ``what`` starts the error (``"strategy 'ddp' option "``). Returns
    ``values`` with those made.

    >>> @dataclasses.dataclass
    ... class Options:
    ...     lr: float = 0.1
    >>> check_kinds(Options, {"lr": numpy.float32(0.5)})
    {'lr': 0.5}
    """
    out = dict(values)
    defaults = _defaults(owner)
    for name, value in values.items():
        kinds = _kinds(owner)[name]
        if isinstance(value, numpy.generic):  # numpy.int64(8192), a numpy comparison's bool
            value = out[name] = plain(value)
        if name in paths and isinstance(value, os.PathLike):
            value = out[name] = os.fspath(value)
        if value is None and type(None) in kinds:
            continue
        if int in kinds and value is not None:
            flag = (flags or {}).get(name)
            check_whole(flag or f"{what}{name}", value, None if flag else (
                f"pass {name}={int(value)}" if isinstance(value, float) and value.is_integer()
                else f"pass {name} as a whole number"))
            continue
        if (isinstance(value, numbers.Real) and not isinstance(value, bool) if float in kinds
                else isinstance(value, kinds)):
            continue
        said = " or ".join(_KIND_NAMES.get(k, f"a {k.__name__}") for k in kinds
                           if k is not type(None))
        said += " or a path" if name in paths and not any(  # a Path's said already
            isinstance(k, type) and issubclass(k, os.PathLike) for k in kinds) else ""
        said += ", or None" if type(None) in kinds else ""
        default = defaults.get(name, dataclasses.MISSING)
        if bool in kinds:
            hint = f"pass {name}=True or {name}=False"
        elif float in kinds and isinstance(value, str) and _is_number(value):
            hint = f"pass {name}={float(value)!r}"
        elif default is not None and default is not dataclasses.MISSING:
            hint = f"pass {name}={default!r}"
        else:
            hint = f"pass {name} as {said}"
        kind = type(value).__name__
        raise ConfigError(f"{what}{name} must be {said} (got {value!r}, "
                          f"{'an' if kind[0] in 'aeiou' else 'a'} {kind})", hint)
    return out


_KIND_NAMES = {int: "a whole number", float: "a number", bool: "True or False", str: "a str",
               collections.abc.Mapping: "a mapping"}


def plain(value: Any) -> Any:
    """``value`` with a numpy scalar made Python's (``numpy.int64(8)`` is 8): a record of it is
    JSON; anything else as it is."""
    return value.item() if isinstance(value, numpy.generic) else value


@functools.cache
def _kinds(owner: type | Callable[..., Any]) -> dict[str, tuple[type, ...]]:
    """Each field's (or keyword's) classes, from its annotation: ``int | None`` is (int,
    NoneType), ``Mapping[str, Any]`` is (Mapping,)."""
    kinds = {}
    for name, hint in typing.get_type_hints(owner).items():
        union = typing.get_origin(hint) in (typing.Union, types.UnionType)
        kinds[name] = tuple(typing.get_origin(a) or a
                            for a in (typing.get_args(hint) if union else (hint,)))
    return kinds


def _defaults(owner: type | Callable[..., Any]) -> dict[str, Any]:
    """Each field's (or keyword's) default, ``dataclasses.MISSING`` where it has none."""
    if isinstance(owner, type) and dataclasses.is_dataclass(owner):
        return {f.name: f.default for f in dataclasses.fields(owner)}
    return {name: dataclasses.MISSING if p.default is inspect.Parameter.empty else p.default
            for name, p in inspect.signature(owner).parameters.items()}


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True
