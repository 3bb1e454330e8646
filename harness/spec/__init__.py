"""The spec stage: what a sweep asks for, checked before anything starts, as pydantic models.

`points` (`SweepSpec`, `Point`, `build_spec`, `load_spec`: the sweep spec and its grid), `cluster`
(per-container links, CPU and memory: `ClusterSettings`), `links` (`LinkProfile`), `faults` (`Fault`),
`sysctls` (host sysctls for a sweep), `base` (the one way they check: `SpecModel` and the translation
of pydantic's errors), `schema` (the JSON Schema of a sweep spec, shipped as sweep-spec.schema.json).
Units go through `wiiide.units`. Every check raises `harness.errors.SpecError` in one line with the
file, the field path and what is allowed.
"""
