"""The present stage: turns reports (`harness.results`) into text tables, comparisons and HTML pages.
"""
