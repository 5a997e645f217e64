"""Command-line flags made from the fields of frozen option dataclasses, a help group per owner."""

from __future__ import annotations

import argparse
import dataclasses
import types
import typing
from dataclasses import dataclass, field
from typing import Any, Sequence

from ..errors import ConfigError

__all__: list[str] = []


@dataclass
class OptionFlag:
    """One flag: its spelling and the owners (strategies) whose Options have the field."""

    flag: str
    owners: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class Owner:
    """A strategy or model whose Options class makes flags, and its one-line description."""

    name: str
    description: str
    options: type | None


def flag_name(f: dataclasses.Field[Any]) -> str:
    """``partition_bytes`` -> ``--partition-bytes``; ``async_`` -> ``--async``."""
    return str(f.metadata.get("flag") or "--" + f.name.rstrip("_").replace("_", "-"))


def flag_value(args: Sequence[str], flag: str) -> str | None:
    """The value ``args`` give ``flag`` (``--flag V`` or ``--flag=V``; the last wins), or None.

    Read before parsing, because argparse prints ``--help`` as soon as it meets it.
    """
    value = None
    for i, arg in enumerate(args):
        if arg == flag and i + 1 < len(args):
            value = args[i + 1]
        elif arg.startswith(flag + "="):
            value = arg.partition("=")[2]
    return value


def _base_type(hint: Any) -> Any:
    """``int | None`` -> ``int``."""
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        if len(args) == 1:
            return args[0]
    return hint


def _metavar(f: dataclasses.Field[Any]) -> str:
    return str(f.metadata.get("metavar", f.name.rstrip("_").upper()))


def _help(f: dataclasses.Field[Any]) -> str:
    return str(f.metadata.get("help", ""))


def _add_flag(target: Any, options_cls: type, f: dataclasses.Field[Any]) -> argparse.Action:
    """The flag of field ``f``: None ("not given") by default, so the owner's default applies.

    A bool field that defaults to True gets a ``--no-...`` flag.
    """
    kind = _base_type(typing.get_type_hints(options_cls)[f.name])
    flag = flag_name(f)
    if kind is bool:
        if f.default is True:
            flag = "--no-" + flag.removeprefix("--")
        return target.add_argument(flag, dest=f.name, action="store_const",
                                   const=f.default is not True, default=None)
    return target.add_argument(flag, dest=f.name, type=kind, default=None,
                               choices=f.metadata.get("choices"), metavar=_metavar(f))


def add_option_groups(parser: argparse.ArgumentParser, owners: Sequence[Owner], *, kind: str,
                      chosen: str | None = None) -> dict[str, OptionFlag]:
    """A flag for every field of every owner's Options, shown in a help group per owner.

    Fields of the same name in several owners share one flag (argparse cannot
    add a flag twice), which parses as the first owner's field says. The help:

    - ``chosen`` names no owner (``--help`` alone): every owner's group
      ("byteps options": its description, then its flags); the shared flags in
      one group ahead of them with each owner's meaning, and named in each
      owner's group, so that a reader of one group misses none of its flags.
    - ``chosen`` names an owner (``--strategy hetpipe --help``): its group
      alone, a shared flag in it with its own meaning; the other owners' flags
      still parse but are hidden behind one line that names those owners, so
      that the help stays short however many there are.
    """
    fields: dict[str, list[tuple[str, Any, dataclasses.Field[Any]]]] = {}  # (owner, Options, field)
    for owner in owners:
        for f in dataclasses.fields(owner.options) if owner.options else ():
            fields.setdefault(f.name, []).append((owner.name, owner.options, f))
    owned = {o.name: [f.name for f in dataclasses.fields(o.options)] if o.options else []
             for o in owners}
    focus = chosen if chosen in owned else None
    shared = [] if focus else [n for n, entries in fields.items() if len(entries) > 1]
    shared_group = parser.add_argument_group(
        f"shared {kind} options",
        "each flag here belongs to several groups below, its meaning in each tagged [NAME]"
    ) if shared else None
    groups = {o.name: parser.add_argument_group(f"{o.name} options", o.description)
              for o in owners if focus in (None, o.name)}
    others = [o for o in owned if focus and o != focus and owned[o]]
    if others:
        parser.add_argument_group(
            f"other {kind} options",
            f"{', '.join(others)} have options of their own: pass --{kind} NAME --help to see "
            f"one's, or --help without --{kind} to see every {kind}'s.")

    flags: dict[str, OptionFlag] = {}
    # The focused owner's flags first and in its own order; the rest are hidden.
    ahead = owned[focus] if focus else []
    for name in [*ahead, *(n for n in fields if n not in ahead)]:
        entries = fields[name]
        first_owner, first_cls, first = entries[0]
        meanings = {o: f for o, _, f in entries}
        target: Any
        if focus:
            shown = meanings.get(focus)
            target = groups[focus] if shown else parser
        elif name in shared:
            shown, target = first, shared_group
        else:
            shown, target = first, groups[first_owner]
        action = _add_flag(target, first_cls, first)
        if shown is None:
            action.help = argparse.SUPPRESS
        elif name in shared:  # owners that mean the same say it once, tagged together
            alike: dict[str, list[str]] = {}
            for o, f in meanings.items():
                alike.setdefault(_help(f), []).append(o)
            action.help = "; ".join(f"[{', '.join(os)}] {text}" for text, os in alike.items())
        else:
            action.help = _help(shown)
        if action.metavar is not None and shown is not None:  # as the shown help names it
            action.metavar = _metavar(shown)
        flags[name] = OptionFlag(action.option_strings[0], list(meanings))

    for name, group in groups.items():
        if not owned[name]:
            group.description = f"{group.description} No options of its own."
        elif also := [flags[n].flag for n in owned[name] if n in shared]:
            group.description = (f"{group.description} Also {', '.join(also)}, under shared "
                                 f"{kind} options.")
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


def add_network_flags(parser: Any, *, planning: bool = False) -> None:
    """``--bandwidth`` and ``--latency``: the emulated network of ``train`` and ``launch``, or
    (``planning``) the network ``plan`` predicts for."""
    units = "tc's units: bit, kbit, mbit, gbit, e.g. 1gbit"
    parser.add_argument("--bandwidth", default=None, metavar="RATE", help=(
        f"the cluster's network: every machine's NIC at RATE each way ({units}); predicted, "
        f"nothing is shaped" if planning else
        f"emulate the cluster's network: every machine in a network namespace of its own, its "
        f"NIC shaped to RATE each way ({units}); needs root and iproute2"))
    parser.add_argument("--latency", default=None, metavar="TIME", help=(
        f"with --bandwidth: {'the delay of' if planning else 'delay'} every packet a machine "
        f"sends{'' if planning else ' by TIME'} (us, ms, s, e.g. 0.2ms; default 0)"))


def add_hidden_flags(parser: argparse.ArgumentParser, owners: Sequence[Owner]
                     ) -> dict[str, OptionFlag]:
    """Every owner's flags, parsed but not shown: for a command that refuses them by name."""
    flags: dict[str, OptionFlag] = {}
    for owner in owners:
        if owner.options is None:
            continue
        for f in dataclasses.fields(owner.options):
            if f.name in flags:
                flags[f.name].owners.append(owner.name)
                continue
            action = _add_flag(parser, owner.options, f)
            action.help = argparse.SUPPRESS
            flags[f.name] = OptionFlag(action.option_strings[0], [owner.name])
    return flags
