"""Command-line flags made from the fields of frozen option dataclasses."""

from __future__ import annotations

import argparse
import dataclasses
import types
import typing
from dataclasses import dataclass, field
from typing import Any, Iterable

from ..errors import ConfigError

__all__: list[str] = []


@dataclass
class OptionFlag:
    """One flag: its spelling and the owners (strategies) whose Options have the field."""

    flag: str
    owners: list[str] = field(default_factory=list)


def flag_name(f: dataclasses.Field[Any]) -> str:
    """``partition_bytes`` -> ``--partition-bytes``; ``async_`` -> ``--async``."""
    return str(f.metadata.get("flag") or "--" + f.name.rstrip("_").replace("_", "-"))


def _base_type(hint: Any) -> Any:
    """``int | None`` -> ``int``."""
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        if len(args) == 1:
            return args[0]
    return hint


def add_option_flags(parser: Any, owners: Iterable[tuple[str, type]]) -> dict[str, OptionFlag]:
    """Add a flag for every field of every ``(owner, Options class)``; equal names share one.

    Every flag defaults to None ("not given") so the owner's own default
    applies; a bool field that defaults to True gets a ``--no-...`` flag.
    """
    flags: dict[str, OptionFlag] = {}
    actions: dict[str, argparse.Action] = {}
    helps: dict[str, list[str]] = {}
    for owner, options_cls in owners:
        hints = typing.get_type_hints(options_cls)
        for f in dataclasses.fields(options_cls):
            help_text = str(f.metadata.get("help", ""))
            helps.setdefault(f.name, []).append(help_text)
            if f.name in flags:
                flags[f.name].owners.append(owner)
                continue
            kind = _base_type(hints[f.name])
            if kind is bool:
                flag = flag_name(f)
                if f.default is True:
                    flag = "--no-" + flag.removeprefix("--")
                actions[f.name] = parser.add_argument(
                    flag, dest=f.name, action="store_const", const=f.default is not True,
                    default=None, help=help_text)
            else:
                flag = flag_name(f)
                actions[f.name] = parser.add_argument(
                    flag, dest=f.name, type=kind, default=None, help=help_text,
                    choices=f.metadata.get("choices"),
                    metavar=str(f.metadata.get("metavar", f.name.rstrip("_").upper())))
            flags[f.name] = OptionFlag(flag, [owner])
    for name, opt in flags.items():
        if len(opt.owners) == 1:
            actions[name].help = f"{helps[name][0]} [{opt.owners[0]}]".strip()
        else:  # one flag, several meanings: say each owner's
            actions[name].help = "; ".join(f"[{o}] {h}" for o, h in zip(opt.owners, helps[name]))
    return flags


def given_options(ns: argparse.Namespace, owner: str, options_cls: type | None,
                  flags: dict[str, OptionFlag], *, kind: str = "strategy") -> dict[str, Any]:
    """The flags given on the command line for ``owner``; another owner's flag is refused.

    ``kind`` names what owners are (``strategy`` or ``model``) in the error's hint.
    """
    mine = {f.name for f in dataclasses.fields(options_cls)} if options_cls else set()
    out: dict[str, Any] = {}
    for name, opt in flags.items():
        value = getattr(ns, name, None)
        if value is None:
            continue
        if name not in mine:
            raise ConfigError(f"{opt.flag} is an option of {', '.join(opt.owners)}, not of "
                              f"{kind} {owner!r}", f"leave it out, or pick --{kind} "
                              f"{opt.owners[0]}")
        out[name] = value
    return out


def add_network_flags(parser: Any) -> None:
    """``--bandwidth`` and ``--latency``: the emulated network of ``train`` and ``launch``."""
    parser.add_argument("--bandwidth", default=None, metavar="RATE",
                        help="emulate the cluster's network: every machine in a network "
                             "namespace of its own, its NIC shaped to RATE each way (tc's units: "
                             "bit, kbit, mbit, gbit, e.g. 1gbit); needs root and iproute2")
    parser.add_argument("--latency", default=None, metavar="TIME",
                        help="with --bandwidth: delay every packet a machine sends by TIME "
                             "(us, ms, s, e.g. 0.2ms; default 0)")
