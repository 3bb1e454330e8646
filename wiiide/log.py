"""The seeds' three logging tiers (seed 004, "Three-tier logging"; study in seed 000).

- ``verbose``: a line per message sent or received (the seeds measured -24 % throughput with it);
- ``normal``: a progress line every `log_every_steps` steps;
- ``silent``: errors only.
"""

from __future__ import annotations

import logging
import sys

from wiiide.config import RunConfig

_LEVELS = {"verbose": logging.DEBUG, "normal": logging.INFO, "silent": logging.ERROR}


class TieredLog:
    """A logger with the tier's checks done once, so a silent node pays nothing per message."""

    def __init__(self, cfg: RunConfig, name: str) -> None:
        self.logger = logging.getLogger(f"wiiide.{name}")
        self.logger.setLevel(_LEVELS[cfg.log_tier])
        if not self.logger.handlers:
            handler = logging.StreamHandler(sys.stderr)
            handler.setFormatter(logging.Formatter(f"%(asctime)s {name} %(levelname)s %(message)s"))
            self.logger.addHandler(handler)
            self.logger.propagate = False
        self.per_message = cfg.log_tier == "verbose"
        self.progress = cfg.log_tier in ("verbose", "normal")
        self.every = cfg.log_every_steps

    def message(self, fmt: str, *args: object) -> None:
        """One line per message (verbose tier only)."""
        if self.per_message:
            self.logger.debug(fmt, *args)

    def step(self, step: int, fmt: str, *args: object) -> None:
        """A progress line every `log_every_steps` steps (verbose and normal tiers)."""
        if self.progress and step % self.every == 0:
            self.logger.info(fmt, *args)

    def info(self, fmt: str, *args: object) -> None:
        """A line in the verbose and normal tiers (not in silent)."""
        if self.progress:
            self.logger.info(fmt, *args)

    def error(self, fmt: str, *args: object) -> None:
        """A line in every tier, silent included."""
        self.logger.error(fmt, *args)
