"""Benchmarks that write JSON: `wire` (bench-wire: codecs, frames and compression policies on paced links).
"""
