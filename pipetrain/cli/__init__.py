"""The ``pipetrain`` command: each subcommand parses its flags, calls the Python API and prints.

Errors are printed as one line."""
from __future__ import annotations

import argparse
import sys
import warnings

from pipetrain.cli import bench, common, planning, train
from pipetrain.errors import first_line

__all__ = ["build_parser", "main"]

DESCRIPTION = """Train a PyTorch model over several workers when communication is the bottleneck: PipeDream
pipeline parallelism, Pipe-SGD and CPU-GPU data parallelism (CGDP), or let pipetrain pick the fastest.

Start with `pipetrain demo`; `pipetrain train --strategy auto --workers N ...` trains your own model.
`pipetrain COMMAND --help` describes each command."""


def build_parser() -> argparse.ArgumentParser:
    parser = common.Parser(prog="pipetrain", description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    train.register(sub)
    planning.register(sub)
    bench.register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    warnings.showwarning = common.one_line_warnings
    try:
        args.func(args)
    except (ValueError, RuntimeError, OSError) as e:
        print(f"pipetrain {args.command}: error: {first_line(e, None)}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"\npipetrain {args.command}: interrupted; the workers were stopped (checkpoints already written are "
              "kept)", file=sys.stderr)
        return 130
    finally:
        warnings.showwarning = common.show_warning
    return 0
