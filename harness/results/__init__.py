"""The results stage: a sweep's report (per point, per repeat, totals and stats), saved atomically and
loaded back, older schema versions included.
"""
