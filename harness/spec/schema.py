"""The JSON Schema of a sweep spec (experiments/*.yaml), generated from the `SweepSpec` model.

The schema is shipped as ``harness/spec/sweep-spec.schema.json`` so that editors and other tools can
check a spec without this code; tests/unit/test_spec.py checks that the shipped file is what the
models generate. After changing a model (or RunConfig's fields), write it again::

    python -m harness.spec.schema            # writes harness/spec/sweep-spec.schema.json
    python -m harness.spec.schema --check    # exit 1 when the shipped file is stale

The schema describes what the file may hold (keys, types, units as strings, ranges); some checks
need the code: RunConfig's own rules, a ``worker-N`` beyond a point's workers, a preset name that
exists.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from harness.spec.points import SweepSpec

SCHEMA_FILE = Path(__file__).with_name("sweep-spec.schema.json")
SCHEMA_DIALECT = "https://json-schema.org/draft/2020-12/schema"


def sweep_spec_schema() -> dict[str, Any]:
    """The JSON Schema (draft 2020-12) of a sweep spec file: YAML keys (aliases), validation mode."""
    schema = SweepSpec.model_json_schema(by_alias=True, mode="validation")
    return {"$schema": SCHEMA_DIALECT, **schema}


def schema_text() -> str:
    """`sweep_spec_schema` as the shipped file holds it: sorted keys, 2-space indent, a final newline."""
    return json.dumps(sweep_spec_schema(), indent=2, sort_keys=True) + "\n"


def write_schema(path: Path = SCHEMA_FILE) -> Path:
    """Write the schema to `path` (default: the shipped file). Returns `path`. Raises OSError."""
    path.write_text(schema_text())
    return path


def main(argv: list[str] | None = None) -> int:
    """``python -m harness.spec.schema [--check] [--output PATH]``. Returns the exit status: 0, or 1
    when ``--check`` finds the file stale."""
    parser = argparse.ArgumentParser(prog="python -m harness.spec.schema", description=__doc__.split("\n")[0])
    parser.add_argument("--check", action="store_true", help="do not write; exit 1 if the file differs")
    parser.add_argument("--output", type=Path, default=SCHEMA_FILE, help="where the schema goes")
    args = parser.parse_args(argv)
    if args.check:
        current = args.output.read_text() if args.output.exists() else ""
        if current != schema_text():
            print(f"{args.output} is stale: run python -m harness.spec.schema", file=sys.stderr)
            return 1
        print(f"{args.output} is up to date")
        return 0
    print(f"wrote {write_schema(args.output)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
