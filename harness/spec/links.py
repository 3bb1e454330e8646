"""Link profiles: one frozen value object per link's conditions (rate, delay, jitter, loss, queue limit),
validated when built, after Pumba's one value object per network effect (alexei-led/pumba).

In a spec (``link_presets``, ``link``) a profile is a mapping of YAML keys with units::

    {rate: 100mbit, delay: 20ms, jitter: 2ms, distribution: normal, loss: 1%, loss_correlation: 25%,
     limit_packets: 1000, ingress: true, qdisc: htb}
    {delay: 20ms, reorder: 25%, reorder_correlation: 50%, gap: 5, duplicate: 1%,
     loss_gemodel: {p: 1%, r: 30%, 1-h: 100%, 1-k: 0%}}

The keys after ``qdisc`` are netem's own (tc-netem(8)): ``reorder PERCENT [CORRELATION] [gap DISTANCE]``
(it needs a delay, as tc refuses reordering without one), ``duplicate PERCENT [CORRELATION]`` and
``loss gemodel p [r [1-h [1-k]]]``, the Gilbert-Elliott loss: p the good -> bad and r the bad -> good
transition probability, 1-h the loss in the bad state, 1-k in the good one, as a mapping of those four
names or a list in netem's order; what is left out takes netem's defaults (r = 100 % - p, 1-h = 100 %,
1-k = 0 %). A profile has one loss model: ``loss`` (random) or ``loss_gemodel``.

Raises `harness.errors.SpecError` for a value out of range; the tc commands that realise a profile are
built by `harness.links.tc`.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, Mapping

from pydantic import (
    AfterValidator,
    BeforeValidator,
    Field,
    StrictBool,
    StrictFloat,
    StrictInt,
    ValidationInfo,
    WithJsonSchema,
    model_validator,
)
from pydantic.json_schema import SkipJsonSchema

from harness.errors import SpecError
from harness.spec.base import YAML, SpecModel, fail, from_yaml, shown, unit, validate
from wiiide.units import format_rate, parse_pct, parse_rate_bps, parse_time_ms

ROOT_QDISCS = ("htb", "tbf")
DISTRIBUTIONS = ("uniform", "normal", "pareto", "paretonormal")
MIN_RATE_BPS = 1000
MAX_RATE_BPS = 100 * 10**9
MAX_DELAY_MS = 60_000.0
MAX_LIMIT_PACKETS = 10_000_000

# YAML key -> field
PROFILE_KEYS = {
    "rate": "rate_bps", "delay": "delay_ms", "jitter": "jitter_ms", "distribution": "jitter_distribution",
    "loss": "loss_pct", "loss_correlation": "loss_corr_pct", "limit_packets": "limit_packets",
    "ingress": "ingress", "qdisc": "root_qdisc", "reorder": "reorder_pct", "reorder_correlation": "reorder_corr_pct",
    "gap": "reorder_gap", "duplicate": "duplicate_pct", "duplicate_correlation": "duplicate_corr_pct",
    "loss_gemodel": "loss_gemodel_pct",
}
GEMODEL_KEYS = ("p", "r", "1-h", "1-k")  # netem's names, in its order (tc-netem(8), "loss gemodel")
MAX_GAP_PACKETS = 1 << 30
# the fields only netem (or the fallback without it) applies, each with the value that turns it off
NETEM_OFF: dict[str, Any] = {"delay_ms": 0.0, "jitter_ms": 0.0, "jitter_distribution": None, "loss_pct": 0.0,
                             "loss_corr_pct": 0.0, "reorder_pct": 0.0, "reorder_corr_pct": 0.0, "reorder_gap": None,
                             "duplicate_pct": 0.0, "duplicate_corr_pct": 0.0, "loss_gemodel_pct": None}


def _rate_bps(value: Any, info: ValidationInfo) -> Any:
    """YAML: ``100mbit`` (SI, as tc); Python: a number of bit/s or such a string."""
    if value is None or not (isinstance(value, str) or from_yaml(info)):
        return value
    return unit(parse_rate_bps, value)


def _time_ms(value: Any, info: ValidationInfo) -> Any:
    """YAML: ``20ms``, ``500us``, ``1s``; Python: a number of ms or such a string."""
    if not (isinstance(value, str) or from_yaml(info)):
        return value
    return unit(parse_time_ms, value)


def _pct(value: Any) -> Any:
    """``1``, ``0.5``, ``"1%"`` -> percent."""
    return unit(parse_pct, value)


def _gemodel(value: Any) -> Any:
    """``{p: 1%, r: 30%, 1-h: 100%, 1-k: 0%}`` or ``[1%, 30%]`` -> (p, r, 1-h, 1-k) in percent, with
    netem's defaults for what is left out (iproute2's q_netem.c: r = 100 - p, 1-h = 100, 1-k = 0)."""
    if value is None:
        return None
    if isinstance(value, Mapping):
        for key in value:
            if key not in GEMODEL_KEYS:
                raise fail(f"unknown key; allowed: {', '.join(GEMODEL_KEYS)}", str(key))
        if "p" not in value:
            raise fail("missing: p (the good -> bad transition probability) is required", "p")
        given = {key: value[key] for key in GEMODEL_KEYS if key in value}
    elif isinstance(value, (list, tuple)) and 1 <= len(value) <= 4:
        given = dict(zip(GEMODEL_KEYS, value))
    else:
        raise fail(f"{shown(value)}; allowed: a mapping of {', '.join(GEMODEL_KEYS)} or a list of 1 to 4 percentages")
    pct: dict[str, float] = {}
    for key, raw in given.items():
        try:
            pct[key] = unit(parse_pct, raw)
        except ValueError as exc:
            raise fail(str(exc), key) from None
        if not 0 <= pct[key] <= 100:
            raise fail(f"{pct[key]:g} %; allowed: 0..100 % (a probability)", key)
    p = pct["p"]
    return (p, pct.get("r", 100.0 - p), pct.get("1-h", 100.0), pct.get("1-k", 0.0))


def _check_rate(rate_bps: int | None) -> int | None:
    if rate_bps is not None and not MIN_RATE_BPS <= rate_bps <= MAX_RATE_BPS:
        raise ValueError(f"{format_rate(rate_bps)} ({rate_bps} bit/s); allowed: 1kbit..100gbit")
    return rate_bps


def _between(low: float, high: float, unit_name: str) -> AfterValidator:
    def check(value: float) -> float:
        if not low <= value <= high:
            raise ValueError(f"{value:g} {unit_name}; allowed: {low:g}..{high:g} {unit_name}")
        return value
    return AfterValidator(check)


def _string(description: str, *examples: str) -> WithJsonSchema:
    return WithJsonSchema({"type": "string", "description": description, "examples": list(examples)})


_PCT_SCHEMA = WithJsonSchema({"anyOf": [{"type": "number", "minimum": 0, "maximum": 100},
                                        {"type": "string", "examples": ["1%", "0.5%"]}],
                              "description": "percent, 0..100: 1, 0.5 or '1%'"})


class LinkProfile(SpecModel):
    """What one container's link does to its traffic. Units are in the field names; the YAML key of
    each field is its alias (``rate`` for `rate_bps`).

    rate_bps: the rate class at the root (None: no rate limit), 1 kbit/s .. 100 Gbit/s.
    delay_ms (0..60,000), jitter_ms (<= delay), jitter_distribution (None: uniform, netem's draw
    without a table), loss_pct and loss_corr_pct (0..100, correlation only with a loss): netem.
    limit_packets: netem's queue (None: from the bandwidth-delay product, harness.links.tc); with a
    rate and no netem, the rate class's queue. ingress: shape traffic coming in too, through ifb.
    root_qdisc: ``htb`` (a rate class, as Mininet) or ``tbf``. `name` is the preset's name (or
    ``inline``), for messages.

    Raises:
        SpecError: ``link profile '<name>': <key>: <what is allowed>``, when a value is out of range
        (jitter > delay, loss outside 0..100, rate outside 1kbit..100gbit), of the wrong type, or the
        profile does nothing.
    """

    yaml_keys = tuple(PROFILE_KEYS)

    name: SkipJsonSchema[str] = "inline"
    rate_bps: Annotated[StrictInt | None, Field(alias="rate"), BeforeValidator(_rate_bps), AfterValidator(_check_rate),
                        _string("bit rate, SI as tc reads it (k = 1000); unset: no rate limit",
                                "100mbit", "1gbit", "500kbit")] = None
    delay_ms: Annotated[StrictFloat, Field(alias="delay"), BeforeValidator(_time_ms), _between(0, MAX_DELAY_MS, "ms"),
                        _string("one-way delay added by netem, 0..60s", "20ms", "500us")] = 0.0
    jitter_ms: Annotated[StrictFloat, Field(alias="jitter"), BeforeValidator(_time_ms),
                         _between(0, MAX_DELAY_MS, "ms"),
                         _string("delay variation, at most the delay", "2ms")] = 0.0
    jitter_distribution: Annotated[Literal[DISTRIBUTIONS] | None, Field(  # type: ignore[valid-type]
        alias="distribution", description="netem's jitter distribution (unset: uniform)")] = None
    loss_pct: Annotated[StrictFloat, Field(alias="loss"), BeforeValidator(_pct), _between(0, 100, "%"),
                        _PCT_SCHEMA] = 0.0
    loss_corr_pct: Annotated[StrictFloat, Field(alias="loss_correlation"), BeforeValidator(_pct),
                             _between(0, 100, "%"), _PCT_SCHEMA] = 0.0
    limit_packets: Annotated[StrictInt | None, Field(ge=1, le=MAX_LIMIT_PACKETS, description=(
        "netem's queue in packets (unset: from the bandwidth-delay product)"))] = None
    ingress: Annotated[StrictBool, Field(description="shape incoming traffic too, through ifb")] = False
    root_qdisc: Annotated[Literal[ROOT_QDISCS], Field(  # type: ignore[valid-type]
        alias="qdisc", description="the rate class at the root")] = "htb"
    reorder_pct: Annotated[StrictFloat, Field(alias="reorder"), BeforeValidator(_pct), _between(0, 100, "%"),
                           _PCT_SCHEMA] = 0.0
    reorder_corr_pct: Annotated[StrictFloat, Field(alias="reorder_correlation"), BeforeValidator(_pct),
                                _between(0, 100, "%"), _PCT_SCHEMA] = 0.0
    reorder_gap: Annotated[StrictInt | None, Field(alias="gap", ge=1, le=MAX_GAP_PACKETS, description=(
        "netem's reorder gap in packets: a packet may be sent early once gap-1 have been delayed (unset: 1)"))] = None
    duplicate_pct: Annotated[StrictFloat, Field(alias="duplicate"), BeforeValidator(_pct), _between(0, 100, "%"),
                             _PCT_SCHEMA] = 0.0
    duplicate_corr_pct: Annotated[StrictFloat, Field(alias="duplicate_correlation"), BeforeValidator(_pct),
                                  _between(0, 100, "%"), _PCT_SCHEMA] = 0.0
    loss_gemodel_pct: Annotated[tuple[StrictFloat, StrictFloat, StrictFloat, StrictFloat] | None,
                                Field(alias="loss_gemodel"), BeforeValidator(_gemodel), WithJsonSchema({
                                    "anyOf": [{"type": "object", "properties": {k: {} for k in GEMODEL_KEYS},
                                               "required": ["p"], "additionalProperties": False},
                                              {"type": "array", "minItems": 1, "maxItems": 4}],
                                    "description": "netem's Gilbert-Elliott loss: p, r, 1-h, 1-k in percent"})] = None

    @model_validator(mode="after")
    def _consistent(self) -> "LinkProfile":
        d, j = self.delay_ms, self.jitter_ms
        if j > d:
            raise fail(f"{j:g} ms; allowed: <= delay ({d:g} ms)", "jitter")
        if self.jitter_distribution is not None and j <= 0:
            raise fail(f"{self.jitter_distribution!r} needs a jitter > 0", "distribution")
        if self.loss_corr_pct and not self.loss_pct:
            raise fail(f"{self.loss_corr_pct:g} % needs a loss > 0", "loss_correlation")
        if self.reorder_pct and not d:
            raise fail(f"{self.reorder_pct:g} % needs a delay > 0 (a packet is reordered by going out "
                       f"without the delay; tc refuses reordering without one)", "reorder")
        if self.reorder_corr_pct and not self.reorder_pct:
            raise fail(f"{self.reorder_corr_pct:g} % needs a reorder > 0", "reorder_correlation")
        if self.reorder_gap is not None and not self.reorder_pct:
            raise fail(f"{self.reorder_gap} packets needs a reorder > 0", "gap")
        if self.duplicate_corr_pct and not self.duplicate_pct:
            raise fail(f"{self.duplicate_corr_pct:g} % needs a duplicate > 0", "duplicate_correlation")
        if self.loss_gemodel_pct is not None and (self.loss_pct or self.loss_corr_pct):
            raise fail("a profile has one loss model: give loss (random) or loss_gemodel, not both", "loss_gemodel")
        if self.rate_bps is None and not self.needs_netem:
            raise ValueError("does nothing: set a rate, a delay, a loss or a duplicate")
        return self

    @classmethod
    def _where(cls, data: Mapping[str, Any]) -> str:
        return f"link profile {data.get('name', 'inline')!r}"

    @classmethod
    def from_mapping(cls, data: Mapping[str, Any], name: str = "inline") -> "LinkProfile":
        """Build from YAML keys: rate (``100mbit``), delay / jitter (``20ms``), distribution, loss and
        loss_correlation (percent), limit_packets, ingress, qdisc (see the class doc for ranges).

        Raises:
            SpecError: ``link profile '<name>': <key>: ...`` naming the key and what is allowed.
        """
        if not isinstance(data, Mapping):
            raise SpecError(f"link profile {name!r}: {shown(data)}; allowed: a mapping of {', '.join(PROFILE_KEYS)}")
        profile = validate(cls, data, f"link profile {name!r}", context=YAML)
        return profile.model_copy(update={"name": str(name)})

    @property
    def needs_netem(self) -> bool:
        """Whether a netem qdisc is needed (a delay, a loss of either model, or a duplicate; a reorder
        needs a delay)."""
        return self.delay_ms > 0 or self.loss_pct > 0 or self.duplicate_pct > 0 or self.loss_gemodel_pct is not None

    def to_dict(self) -> dict[str, Any]:
        """Every field by its Python name (``rate_bps``, ``delay_ms``, ...), as reports record it."""
        return self.model_dump()

    def replace(self, **changes: Any) -> "LinkProfile":
        """A copy with `changes` (field names), validated like a new profile. Raises SpecError."""
        return type(self)(**{**self.model_dump(), **changes})

    def without_netem(self) -> "LinkProfile | None":
        """The rate part alone (None when there is no rate)."""
        if self.rate_bps is None:
            return None
        return self.replace(**NETEM_OFF)
