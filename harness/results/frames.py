"""A sweep report as pandas DataFrames, for notebooks: one table per grain of the data
(`to_dataframe(report, table)`, or the functions here by the table's name). docs/results.md lists every
column. Only this module of the results stage imports pandas, and only who asks for a table imports it::

    from harness.results import frames, load_report
    report = load_report("results/seed-buffers-20261121T150827Z")
    df = frames.to_dataframe(report, "repeats")     # = frames.repeats(report)

Tables (one row per ...):
  ``repeats``  repeat of a point: its swept params, status, timings and every `Totals` figure.
  ``nodes``    node of a repeat (coordinator, workers, engine ranks): role, rank and its metrics file
               (`wiiide.metrics_model.NodeMetricsFile`).
  ``stats``    stats sample of a container (docker) or process (local) of a repeat (`Sample`).
  ``evals``    held-out evaluation during a repeat (`HeldOutPoint`), with the metric and its target.

Every table starts with ``point`` (the point's index in the grid) and ``repeat`` (its number within
the point), then the swept params: each axis (`Report.axes`) under its own name, with the value the
spec gave (``"1MiB"``, ``"zlib-1"``), then each key of the points' run config and each cluster key
(links, cpus, mem_limit_bytes) whose value differs between the report's points, under its own name
(``config.KEY`` / ``cluster.KEY`` when an axis has that name and another value). A table's own
column whose name is taken by those gets the table's prefix (``totals.``, ``node.``, ``sample.``,
``eval.``).

Every scalar field of the table's model (`Totals`, `NodeMetricsFile` and its summaries, `Sample`,
`HeldOutPoint`) is a column in every report, in the model's order; keys the models do not name follow.
Nested objects are flattened one level, ``outer.inner`` (``step_time_s.median``,
``batches_per_worker.1``, ``phases_s.run``); what is nested deeper, and lists, are JSON text. Every
column has a nullable pandas dtype, so a figure that was not measured is ``<NA>``: ``Int64``,
``Float64``, ``boolean`` or ``string`` (JSON text too; and a column whose values mix kinds, each value
as JSON). Times of day are ISO 8601 strings in UTC (``pandas.to_datetime`` reads them).
"""

from __future__ import annotations

import json
import types
import typing
from typing import Any, Callable, Iterable, Mapping

import pandas as pd
from pydantic import BaseModel, ValidationError

from harness.errors import HarnessError
from harness.results.models import TABLES, HeldOutPoint, Point, Report, Repeat, Sample, TableName, Totals
from wiiide.metrics_model import NodeMetricsFile

_KEYS = ("point", "repeat")
_DTYPES = {bool: "boolean", int: "Int64", float: "Float64", str: "string"}


# --- columns and dtypes ----------------------------------------------------------------------------
def _json(value: Any) -> str:
    return json.dumps(value, sort_keys=True, default=str)


def _scalar_type(annotation: Any) -> type | None:
    """bool, int, float or str when `annotation` is one of them or it | None; else None."""
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        annotation = args[0] if len(args) == 1 else None
    return annotation if annotation in _DTYPES else None


def _model_dtypes(model: type[BaseModel]) -> dict[str, str]:
    """The dtype of each scalar field of `model`, and of each scalar field of a model-typed field
    flattened one level (``step_time_s.median``), by column name."""
    out: dict[str, str] = {}
    for name, field in model.model_fields.items():
        scalar = _scalar_type(field.annotation)
        if scalar is not None:
            out[name] = _DTYPES[scalar]
            continue
        for arg in typing.get_args(field.annotation) or (field.annotation,):
            if isinstance(arg, type) and issubclass(arg, BaseModel):
                out.update({f"{name}.{k}": v for k, v in _model_dtypes(arg).items()})
    return out


def _flat(mapping: Mapping[str, Any]) -> dict[str, Any]:
    """`mapping` with its dict values flattened one level into ``outer.inner`` keys."""
    out: dict[str, Any] = {}
    for key, value in mapping.items():
        if isinstance(value, Mapping):
            out.update({f"{key}.{inner}": v for inner, v in value.items()})
        else:
            out[key] = value
    return out


def _column(values: list[Any], declared: str | None) -> pd.api.extensions.ExtensionArray:
    """The values as one nullable column: `declared` dtype when the field has one, else from the values'
    Python types (bools, ints, numbers, strings); anything else (lists, objects, mixed kinds) as JSON text."""
    present = [v for v in values if v is not None]
    kinds = {type(v) for v in present}
    dtype = declared
    if dtype is None:
        if not kinds or kinds == {str}:
            dtype = "string"
        elif kinds == {bool}:
            dtype = "boolean"
        elif kinds == {int}:
            dtype = "Int64"
        elif kinds <= {int, float}:
            dtype = "Float64"
    if dtype is None or (dtype == "string" and kinds - {str}):
        return pd.array([None if v is None else _json(v) for v in values], dtype="string")
    return pd.array(values, dtype=dtype)


def _frame(rows: list[dict[str, Any]], leading: Iterable[str], dtypes: Mapping[str, str]) -> pd.DataFrame:
    """A DataFrame of `rows` (dicts; a missing key is <NA>), each column typed by `_column`. Columns:
    `leading`, then every declared one (`dtypes`, in its order: present in every report), then the
    other keys of the rows in the order first seen. A key whose every value is None is left out when
    it has flattened columns (``step_time_s`` beside ``step_time_s.median``)."""
    names = dict.fromkeys(leading)
    names.update(dict.fromkeys(dtypes))
    for row in rows:
        names.update(dict.fromkeys(row))
    nested = {name.rsplit(".", 1)[0] for name in names if "." in name}
    columns = {name: [row.get(name) for row in rows] for name in names}
    return pd.DataFrame({name: _column(values, dtypes.get(name)) for name, values in columns.items()
                         if not (name in nested and name not in dtypes and all(v is None for v in values))})


# --- the swept params ------------------------------------------------------------------------------
def _varying(points: list[Point], values: Callable[[Point], Mapping[str, Any]]) -> list[str]:
    """The keys of `values(point)` whose value is not the same in every point, in order first seen."""
    keys = dict.fromkeys(k for p in points for k in values(p))
    return [k for k in keys if len({_json(values(p).get(k)) for p in points}) > 1]


def swept_params(report: Report) -> dict[int, dict[str, Any]]:
    """Point index -> the swept params' columns of its rows (module docstring), the same names for every
    point: each axis, then the run config keys and cluster keys that vary between points."""
    points = report.points
    axes = report.axes
    columns = {p.index: {axis: p.params.get(axis) for axis in axes} for p in points}
    for prefix, values in (("config", lambda p: p.config), ("cluster", lambda p: p.cluster or {})):
        for key in _varying(points, values):
            name = key
            if key in axes:
                if all(_json(p.params.get(key)) == _json(values(p).get(key)) for p in points):
                    continue  # the axis is the key itself
                name = f"{prefix}.{key}"
            for p in points:
                columns[p.index][name] = values(p).get(key)
    return columns


def _rows(report: Report, prefix: str,
          own: Callable[[Point, Repeat], Iterable[dict[str, Any]]]) -> tuple[list[dict[str, Any]], list[str], set[str]]:
    """One row per item `own(point, repeat)` yields (flattened), after the key and swept columns; returns
    the rows, the leading column names and the names that took `prefix` (a swept column has them)."""
    swept = swept_params(report)
    taken = set(_KEYS) | {name for cols in swept.values() for name in cols}
    leading = list(_KEYS) + list(next(iter(swept.values()), {}))
    rows, renamed = [], set()
    for point in report.points:
        for repeat in point.repeats:
            for item in own(point, repeat):
                row = {"point": point.index, "repeat": repeat.repeat, **swept[point.index]}
                for key, value in _flat(item).items():
                    if key in taken:
                        renamed.add(key)
                        key = f"{prefix}.{key}"
                    row[key] = value
                rows.append(row)
    return rows, leading, renamed


def _renamed(dtypes: dict[str, str], renamed: set[str], prefix: str) -> dict[str, str]:
    return {(f"{prefix}.{k}" if k in renamed else k): v for k, v in dtypes.items()}


# --- the tables ------------------------------------------------------------------------------------
_REPEAT_FIELDS = ("status", "error", "started_at_utc", "elapsed_s")


def repeats(report: Report) -> pd.DataFrame:
    """One row per repeat of every point (failed repeats too), in point and repeat order.

    Columns: ``point``, ``repeat``, the swept params; ``status`` (``ok`` | ``failed``), ``error`` (why it
    failed), ``started_at_utc`` (ISO 8601), ``elapsed_s`` (the whole run, harness phases included, s),
    ``phases_s.<phase>`` (s per harness phase: clean, plan, create, shape, gate, run, stop, collect,
    teardown), ``logs_dir`` (relative to the report's folder); then every `Totals` figure under its
    name, units in the names (``batches_per_s``, ``goodput_bytes_per_s``, ``test_accuracy`` in [0, 1],
    ``time_to_target_s`` ...), its per-worker objects flattened (``batches_per_worker.<rank>``); <NA>
    where not measured (every figure of a failed repeat).
    """
    def own(point: Point, repeat: Repeat) -> list[dict[str, Any]]:
        head = {name: getattr(repeat, name) for name in _REPEAT_FIELDS}
        return [{**head, "phases_s": repeat.phases_s, "logs_dir": repeat.logs_dir,
                 **repeat.totals.model_dump(mode="json")}]

    rows, leading, renamed = _rows(report, "totals", own)
    dtypes = {"status": "string", "error": "string", "started_at_utc": "string", "elapsed_s": "Float64",
              "logs_dir": "string", **_model_dtypes(Totals)}
    return _frame(rows, leading + list(_REPEAT_FIELDS) + ["logs_dir"], _renamed(dtypes, renamed, "totals"))


def node_record(node: Mapping[str, Any], where: str = "node") -> NodeMetricsFile:
    """A node's metrics as kept in a report, typed. Raises HarnessError naming `where` and the field
    when a field has the wrong type."""
    try:
        return NodeMetricsFile.model_validate(dict(node))
    except ValidationError as exc:
        first = exc.errors()[0]
        field = ".".join(str(p) for p in first["loc"])
        raise HarnessError(f"{where}: {field}: {first['msg']} (got {first.get('input')!r:.80})") from None


def nodes(report: Report) -> pd.DataFrame:
    """One row per node per repeat (a failed repeat's nodes: those that wrote a metrics file).

    Columns: ``point``, ``repeat``, the swept params; ``node`` (the node's name in the repeat:
    ``coordinator``, ``worker-1`` ...), then every field of its metrics file
    (`wiiide.metrics_model.NodeMetricsFile`, docs/results.md): ``role``, ``rank``, ``status``, ``steps``,
    ``batches``, ``samples``, ``train_time_s``, the byte counters (``payload_bytes_sent`` ...,
    bytes), ``goodput_bps`` (bits/s), times in s, ``peak_rss_bytes``, the summaries flattened
    (``step_time_s.median``, ``training_summary.throughput_samples_per_s``), the fields its role adds
    (``test_accuracy``, ``engine``, ``ps.*`` ...). Lists (``events``, ``socket_options``) are JSON text.

    Raises:
        HarnessError: a node's metrics have a field of the wrong type (the message names the node).
    """
    def own(point: Point, repeat: Repeat) -> list[dict[str, Any]]:
        where = f"point {point.index} repeat {repeat.repeat} node"
        return [{"node": name, **node_record(node, f"{where} {name}").model_dump(mode="json")}
                for name, node in repeat.nodes.items()]

    rows, leading, renamed = _rows(report, "node", own)
    dtypes = {"node": "string", **_model_dtypes(NodeMetricsFile)}
    return _frame(rows, leading + ["node", "role", "rank"], _renamed(dtypes, renamed, "node"))


def stats(report: Report) -> pd.DataFrame:
    """One row per stats sample of every container (docker) or process (local) of every repeat.

    Columns: ``point``, ``repeat``, the swept params; ``container`` (its name), ``role``
    (``coordinator`` | ``worker``), ``kind`` (``container`` | ``process``); then the `Sample`:
    ``t_s`` (s since the run started), ``cpu_percent`` (% of one core), ``memory_bytes`` (without page
    cache), ``net_rx_bytes``, ``net_tx_bytes``, ``blk_read_bytes``, ``blk_write_bytes`` (counters since
    the container started; <NA> where the backend cannot measure them: the local backend's network).
    """
    def own(point: Point, repeat: Repeat) -> list[dict[str, Any]]:
        return [{"container": name, "role": c.role, "kind": c.kind, **s.model_dump(mode="json")}
                for name, c in repeat.containers.items() for s in c.samples]

    rows, leading, renamed = _rows(report, "sample", own)
    dtypes = {"container": "string", "role": "string", "kind": "string", **_model_dtypes(Sample)}
    return _frame(rows, leading + ["container", "role", "kind", *Sample.model_fields],
                  _renamed(dtypes, renamed, "sample"))


def evals(report: Report) -> pd.DataFrame:
    """One row per held-out evaluation during training, per repeat that evaluated (``eval_every_s`` > 0),
    in time order.

    Columns: ``point``, ``repeat``, the swept params; ``metric`` (``accuracy`` | a loss),
    ``higher_is_better``, ``target`` (the metric's, <NA>: none); then the `HeldOutPoint`: ``t_s`` (s
    since training started, when the parameters were copied), ``step``, ``samples`` (training samples
    by then), ``value`` (the metric; accuracy in [0, 1], a loss in nats), ``eval_s`` (s the evaluation
    took), ``final`` (the evaluation of the final parameters).
    """
    def own(point: Point, repeat: Repeat) -> list[dict[str, Any]]:
        held = repeat.held_out
        if held is None:
            return []
        head = {"metric": held.metric, "higher_is_better": held.higher_is_better, "target": held.target}
        return [{**head, **e.model_dump(mode="json")} for e in held.curve]

    rows, leading, renamed = _rows(report, "eval", own)
    dtypes = {"metric": "string", "higher_is_better": "boolean", "target": "Float64", **_model_dtypes(HeldOutPoint)}
    return _frame(rows, leading + ["metric", "higher_is_better", "target", *HeldOutPoint.model_fields],
                  _renamed(dtypes, renamed, "eval"))


_BUILDERS: dict[str, Callable[[Report], pd.DataFrame]] = {"repeats": repeats, "nodes": nodes, "stats": stats,
                                                          "evals": evals}
assert tuple(_BUILDERS) == TABLES, "every table has a builder"


def to_dataframe(report: Report, name: TableName = "repeats") -> pd.DataFrame:
    """The table `name` (one of `TABLES`: ``repeats``, ``nodes``, ``stats``, ``evals``) of `report` as a
    DataFrame (the functions of the same names document the columns).

    Raises:
        HarnessError: `name` is not a table, or a node's metrics have a field of the wrong type.
    """
    builder = _BUILDERS.get(name)
    if builder is None:
        raise HarnessError(f"no table {name!r}: the tables are {', '.join(TABLES)}")
    return builder(report)
