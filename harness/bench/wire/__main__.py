"""``python -m harness.bench.wire peer ...``: one peer of bench-wire (the verb itself is ``python -m harness bench-wire``)."""

import sys

from harness.bench.wire.peer import peer_main

if len(sys.argv) > 1 and sys.argv[1] == "peer":
    sys.exit(peer_main(sys.argv[2:]))
print("usage: python -m harness bench-wire ... (or: python -m harness.bench.wire peer ...)", file=sys.stderr)
sys.exit(2)
