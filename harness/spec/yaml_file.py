"""Reading a spec's YAML safely: `yaml.safe_load` (no Python objects), then a bound on what aliases
expand to, before anything else sees the data.

PyYAML shares the object an alias names instead of copying it, so nine levels of nine aliases load in
microseconds and fit in a few KB, but anything that walks the data as a tree (validation, formatting
an error message, writing the report) meets 9**9 nodes. `load_yaml` counts the nodes the data has
once every alias is expanded (memoised per shared object, so the count itself is cheap) and refuses
more than `MAX_EXPANDED_NODES`, and refuses a structure that contains itself.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from harness.errors import SpecError

MAX_EXPANDED_NODES = 100_000  # a large sweep spec has a few thousand


def expanded_nodes(data: Any, limit: int = MAX_EXPANDED_NODES) -> int:
    """The number of nodes (mappings, sequences, scalars; keys included) of `data` with every shared
    object counted once per reference, stopping early once it exceeds `limit`.

    Raises:
        ValueError: `data` contains itself (a recursive alias).
    """
    sizes: dict[int, int] = {}
    in_progress: set[int] = set()

    def size(node: Any) -> int:
        if not isinstance(node, (dict, list)):
            return 1
        key = id(node)
        if key in sizes:
            return sizes[key]
        if key in in_progress:
            raise ValueError("a structure that contains itself (a recursive alias)")
        in_progress.add(key)
        total = 1
        children = [*node.keys(), *node.values()] if isinstance(node, dict) else node
        for child in children:
            total += size(child)
            if total > limit:
                break
        in_progress.discard(key)
        sizes[key] = total
        return total

    return size(data)


def load_yaml(text: str, source: str) -> Any:
    """`text` parsed with `yaml.safe_load`, checked by `expanded_nodes`.

    Raises:
        SpecError: not valid YAML, a recursive alias, or more than `MAX_EXPANDED_NODES` nodes once
        aliases are expanded (an "alias bomb"), naming `source`.
    """
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise SpecError(f"{source}: not valid YAML: {exc}") from None
    except RecursionError:
        raise SpecError(f"{source}: nested too deeply to be a spec") from None
    try:
        nodes = expanded_nodes(data)
    except ValueError as exc:
        raise SpecError(f"{source}: refused: {exc}") from None
    except RecursionError:
        raise SpecError(f"{source}: nested too deeply to be a spec") from None
    if nodes > MAX_EXPANDED_NODES:
        raise SpecError(f"{source}: refused: its aliases expand to more than {MAX_EXPANDED_NODES:,} nodes "
                        "(an alias bomb?); write the values out or use fewer nested aliases")
    return data


def load_yaml_file(path: Path) -> Any:
    """`load_yaml` of a file. Raises SpecError when it cannot be read, as `load_yaml` does."""
    try:
        text = path.read_text()
    except OSError as exc:
        raise SpecError(f"{path}: cannot read: {exc.strerror or exc}") from None
    return load_yaml(text, str(path))
