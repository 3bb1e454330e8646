"""WIIIIIDE: a parameter-server distributed training system over TCP (see the seed documents).

Modules: `config` (RunConfig), `protocol` (frames), `codecs` (compression), `sockets`, `data`, `model`,
`coordinator`, `worker`, `metrics` (per-node JSON). It knows nothing of Docker or sweeps.
"""

__version__ = "0.1.0"
