"""``python -m wiiide coordinator|worker``: run one node, configured by WIIIIIDE_* environment variables.

Exit codes: 0 done, 1 error, 2 bad configuration, 3 could not connect (worker) or not all workers
came (coordinator), 4 peer lost, 143 SIGTERM.

The process ends with `exit_now` once the node is done: its metrics file is written (atomically, by
`wiiide.wire.node.run_node`) and its output flushed by then, so the interpreter's own shutdown (tearing
down torch's modules and objects: about 0.5 s of CPU per node, seconds when nine nodes end at once
on two cores) is skipped.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys

from wiiide.config import RunConfig
from wiiide.errors import ConfigError


def main(argv: list[str] | None = None) -> int:
    """Run one node; returns the exit code (0 done, 1 error, 2 bad configuration, 3 no connection,
    4 peer lost, 143 SIGTERM). A `ConfigError` becomes one line on stderr and exit code 2.
    """
    parser = argparse.ArgumentParser(prog="python -m wiiide", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("role", choices=["coordinator", "worker"])
    parser.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE",
                        help="override a config field (after the environment), e.g. --set port=29501")
    args = parser.parse_args(argv)
    try:
        cfg = RunConfig.from_env()
        if args.set:
            overrides = dict(item.split("=", 1) for item in args.set if "=" in item)
            if len(overrides) != len(args.set):
                raise ConfigError("--set takes FIELD=VALUE")
            cfg = cfg.replace(**overrides)
    except ConfigError as exc:
        print(f"wiiide {args.role}: configuration error: {exc}", file=sys.stderr)
        return 2
    if cfg.engine in ("ddp", "fsdp"):  # PyTorch's engines on the same nodes: the coordinator is rank 0
        from wiiide.engines.torch_dist import main as run_torch

        return run_torch(cfg, args.role)
    if args.role == "coordinator":
        from wiiide.server.coordinator import main as run
    else:
        from wiiide.worker import main as run
    return run(cfg)


def exit_now(code: int) -> None:
    """End the process with `code` at once (``os._exit``), after flushing every logging handler,
    stdout and stderr; no atexit hooks, no interpreter shutdown. Call it only when everything the
    process must leave behind (the metrics file) is written. Never returns."""
    for logger in [logging.getLogger(), *logging.Logger.manager.loggerDict.values()]:
        for handler in getattr(logger, "handlers", ()):
            try:
                handler.flush()
            except (OSError, ValueError):
                pass  # a closed or broken stream: nothing more can be written to it
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)


if __name__ == "__main__":
    exit_now(main())
