"""The ``polytrain`` command: a thin entry point over one module per subcommand."""

from __future__ import annotations

import argparse
import sys
from typing import Sequence

from ..errors import ConfigError, LaunchError, PolytrainError
from . import env, launch, plan, train

__all__ = ["main"]


def build_parser(argv: Sequence[str] = ()) -> argparse.ArgumentParser:
    """The parser of every subcommand; ``argv`` only shapes the help (``train --strategy X -h``)."""
    parser = argparse.ArgumentParser(
        prog="polytrain", description="Hybrid distributed training on torch.distributed.",
        allow_abbrev=False)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    train.add_parser(sub, argv)
    launch.add_parser(sub)
    plan.add_parser(sub)
    env.add_parser(sub)
    for command in sub.choices.values():
        # No prefixes: `plan --device cuda` (a train option) was read as plan's --devices.
        command.allow_abbrev = False
    setattr(parser, "commands", dict(sub.choices))  # noqa: B010 - main() reports with them
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else list(argv)
    parser = build_parser(args)
    ns, unknown = parser.parse_known_args(args)
    ns.argv = args  # as given: argparse drops a '--' right after launch's SCRIPT
    if unknown:  # with the subcommand's usage, not the top level's
        getattr(parser, "commands")[ns.command].error(  # noqa: B009
            f"unrecognized arguments: {' '.join(unknown)}")
    try:
        return int(ns.run(ns))
    except ConfigError as e:
        print(f"polytrain {ns.command}: error: {e}", file=sys.stderr)
        return 2
    except LaunchError as e:
        print(f"polytrain {ns.command}: error: {e}", file=sys.stderr)
        if e.bad_input:  # a process refused its input (ConfigError): as the CLI's own refusal
            return 2
        # The failed process's own exit code (sys.exit(3): 3), else 1 (a signal: negative).
        return e.exitcode if e.exitcode is not None and 0 < e.exitcode < 256 else 1
    except PolytrainError as e:
        print(f"polytrain {ns.command}: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"polytrain {ns.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
