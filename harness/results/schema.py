"""The JSON Schemas of a sweep report (generated from `harness.results.models.Report`) and of a node's
metrics file (from wiiide's `wiiide.metrics_model.NodeMetricsFile`), shipped side by side as
``harness/results/report.schema.json`` and ``harness/results/node_metrics.schema.json`` for tools that
read reports without this code. The report's schema refers to the node's (by its ``$id``) for every
repeat's ``nodes``.

``python -m harness.results.schema`` rewrites the shipped files; ``--check`` exits 1 when one differs
from what the models generate (a test does the same).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from harness.results.models import NODE_METRICS_SCHEMA_ID, Report
from harness.results.report import SCHEMA_VERSION
from wiiide.metrics import SCHEMA_VERSION as NODE_METRICS_SCHEMA_VERSION
from wiiide.metrics import write_text_atomic
from wiiide.metrics_model import node_metrics_json_schema

SCHEMA_PATH = Path(__file__).with_name("report.schema.json")
SCHEMA_ID = "https://wiiide.invalid/schemas/report.schema.json"  # a name, not a place: nothing is fetched
NODE_METRICS_SCHEMA_PATH = Path(__file__).with_name("node_metrics.schema.json")
_DRAFT = "https://json-schema.org/draft/2020-12/schema"


def report_json_schema() -> dict[str, Any]:
    """The JSON Schema (draft 2020-12) of report.json at the current `SCHEMA_VERSION`, as a dict.

    Generated in "serialization" mode (what the writer emits, every key present); unknown keys are
    allowed everywhere (``additionalProperties``), as the models keep them. A repeat's ``nodes`` values
    are ``{"$ref": NODE_METRICS_SCHEMA_ID}``: a validator resolves it to `node_metrics_schema`.
    """
    schema = Report.model_json_schema(mode="serialization")
    return {**schema, "$schema": _DRAFT, "$id": SCHEMA_ID,
            "title": f"WIIIIIDE sweep report, schema_version {SCHEMA_VERSION}"}


def node_metrics_schema() -> dict[str, Any]:
    """The JSON Schema (draft 2020-12) of a node's metrics file at `wiiide.metrics.SCHEMA_VERSION`."""
    return {**node_metrics_json_schema(), "$schema": _DRAFT, "$id": NODE_METRICS_SCHEMA_ID,
            "title": f"WIIIIIDE node metrics file, schema_version {NODE_METRICS_SCHEMA_VERSION}"}


def _text(schema: dict[str, Any]) -> str:
    return json.dumps(schema, indent=2, sort_keys=True) + "\n"


def schema_text() -> str:
    """`report_json_schema` as the shipped file's text (2-space indent, sorted keys, final newline)."""
    return _text(report_json_schema())


def node_metrics_schema_text() -> str:
    """`node_metrics_schema` as the shipped file's text (as `schema_text`)."""
    return _text(node_metrics_schema())


def shipped_schemas() -> dict[Path, str]:
    """Each shipped schema file and the text the models generate for it."""
    return {SCHEMA_PATH: schema_text(), NODE_METRICS_SCHEMA_PATH: node_metrics_schema_text()}


def main(argv: list[str] | None = None) -> int:
    """Write the shipped schemas, or with ``--check`` compare them; exit code 1 when one is stale."""
    args = sys.argv[1:] if argv is None else argv
    if "--check" in args:
        stale = [path for path, text in shipped_schemas().items()
                 if (path.read_text() if path.exists() else "") != text]
        for path in stale:
            print(f"{path} is stale: run python -m harness.results.schema", file=sys.stderr)
        return 1 if stale else 0
    for path, text in shipped_schemas().items():
        write_text_atomic(path, text)
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
