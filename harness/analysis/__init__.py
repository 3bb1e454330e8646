"""The analysis stage: models of a step set against what a sweep measured, outside the sweep's path.

- `round_model`: the synchronous-round model of a step on shaped links (sharded servers, DDP);
- `round_sim`: the timed stages' CPU scheduled on the cores together with the links' messages;
- `egress`: a token-bucket egress, as the shaper's, for both;
- `point_model`: a report's point against the model (`ModelRow`); `round_table`: its rows as text or
  Markdown and the ``round-model`` verb;
- `sched_trace`: the machine's scheduler from tracefs (the cores idle while threads waited), the
  opt-in probe of ``sweep --sched-trace``.

It reads reports and the kernel; nothing here starts a node.
"""
