"""The links stage: pure tc argv builders and sizing (`tc`), the shaping plan for a kernel's qdiscs
and its summary (`plan`), and the reader of tc's JSON read-back (`readback`). Nothing here runs a
command or formats a report cell (`harness.run.tc_exec` runs, `harness.present.links_text` formats).
"""
