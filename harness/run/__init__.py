"""The run stage: cluster backends (Docker Compose, local processes) that run one point's configuration
to its end, with the image, link shaping, fault injection, host sysctls and per-container stats.
"""
