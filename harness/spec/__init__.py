"""The spec stage: what a sweep asks for, checked before anything starts.

`points` (the sweep spec and its grid of points), `cluster` (per-container links, CPU and memory),
`links` (link profiles), `faults` (faults to inject), `sysctls` (host sysctls for a sweep). Reads YAML
and plain values; raises `harness.errors.SpecError` with the file, the field path and what is allowed.
"""
