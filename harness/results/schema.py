"""The JSON Schema of a sweep report, generated from the models (`harness.results.models.Report`) and
shipped as ``harness/results/report.schema.json`` for tools that read reports without this code.

``python -m harness.results.schema`` rewrites the shipped file; ``--check`` exits 1 when it differs
from what the models generate (a test does the same).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from harness.results.models import Report
from harness.results.report import SCHEMA_VERSION
from wiiide.metrics import write_text_atomic

SCHEMA_PATH = Path(__file__).with_name("report.schema.json")
SCHEMA_ID = "https://wiiide.invalid/schemas/report.schema.json"  # a name, not a place: nothing is fetched


def report_json_schema() -> dict[str, Any]:
    """The JSON Schema (draft 2020-12) of report.json at the current `SCHEMA_VERSION`, as a dict.

    Generated in "serialization" mode (what the writer emits, every key present); unknown keys are
    allowed everywhere (``additionalProperties``), as the models keep them.
    """
    schema = Report.model_json_schema(mode="serialization")
    return {**schema, "$schema": "https://json-schema.org/draft/2020-12/schema", "$id": SCHEMA_ID,
            "title": f"WIIIIIDE sweep report, schema_version {SCHEMA_VERSION}"}


def schema_text() -> str:
    """`report_json_schema` as the shipped file's text (2-space indent, sorted keys, final newline)."""
    return json.dumps(report_json_schema(), indent=2, sort_keys=True) + "\n"


def main(argv: list[str] | None = None) -> int:
    """Write the shipped schema, or with ``--check`` compare it; exit code 1 when it is stale."""
    args = sys.argv[1:] if argv is None else argv
    if "--check" in args:
        current = SCHEMA_PATH.read_text() if SCHEMA_PATH.exists() else ""
        if current != schema_text():
            print(f"{SCHEMA_PATH} is stale: run python -m harness.results.schema", file=sys.stderr)
            return 1
        return 0
    write_text_atomic(SCHEMA_PATH, schema_text())
    print(SCHEMA_PATH)
    return 0


if __name__ == "__main__":
    sys.exit(main())
