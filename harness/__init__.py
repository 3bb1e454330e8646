"""The WIIIIIDE lab harness: runs WIIIIIDE clusters (Docker Compose or local processes), sweeps their
knobs, samples per-container metrics, collects every node's metrics and writes JSON reports.

It imports `wiiide`'s config and metrics schema; `wiiide` never imports `harness`.
"""

from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
