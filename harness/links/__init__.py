"""The links stage: pure tc argv builders and sizing (`tc`), the shaping plan for a kernel's qdiscs
(`plan`), and the parser of tc's read-back (`readback`). Nothing here runs a command.
"""
