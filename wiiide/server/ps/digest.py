"""A compact fingerprint of a parameter vector, for comparing runs without shipping the parameters.

Exact equality: the SHA-256 of the float32 bytes. Closeness within float tolerance: the sum, the L2
norm and `PROJECTIONS` dot products with fixed pseudo-random Gaussian vectors (seeded, so equal on
every node); two vectors whose difference has norm d differ in each projection by about d (a
Johnson-Lindenstrauss sketch), so equal sketches within a tolerance mean close parameters.
"""

from __future__ import annotations

import hashlib

import numpy as np

PROJECTIONS = 8
PROJECTION_SEED = 20261123


def params_digest(params: np.ndarray) -> dict:
    """{"sha256", "numel", "sum", "l2", "projections"} of a flat float32 vector (floats in float64)."""
    flat = np.ascontiguousarray(params, dtype=np.float32).reshape(-1)
    as64 = flat.astype(np.float64)
    rng = np.random.default_rng(PROJECTION_SEED)
    projections = [float(rng.standard_normal(flat.size) @ as64) for _ in range(PROJECTIONS)]
    return {"sha256": hashlib.sha256(flat.tobytes()).hexdigest(), "numel": int(flat.size), "sum": float(as64.sum()),
            "l2": float(np.sqrt(as64 @ as64)), "projections": projections}
