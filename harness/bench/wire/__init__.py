"""bench-wire: the WIIIIIDE wire against the socket under it, and the codecs (``python -m harness bench-wire``).

Measured in one run, between two processes (``--backend local``, over 127.0.0.1) or two containers of
the node image on a user-defined bridge (``--backend docker``):

1. ``frames``: for each frame size (64 KiB .. 64 MiB), the raw socket throughput (a plain ``sendall`` /
   ``recv_into`` loop of the same bytes: the limit) and the WIIIIIDE frame throughput (`encode_message`
   + `send_frames` on one side, `FrameReader.read_message` on the other, as the nodes use them) per
   codec, trials interleaved so the ratios compare figures taken side by side. The payload is a slice
   of a real gradient of the larger synthetic model.
2. ``codecs``: each codec's ratio and encode / decode speed (bytes/s of raw bytes, per thread count) on
   a real gradient of the digits MLP (64-512-512-10, 1.2 MB) and of a larger synthetic MLP
   (1024-4096-4096-10, 84 MB).
3. ``links``: synchronous gradient round trips through a sender paced in user space to each link
   rate (0 = unpaced), for each fixed lossless codec, the seeds' rule and ``network-aware``.

Modules, one job each, in the order data flows:

- `plan`: `WirePlan`, what one run measures, and its defaults;
- `payloads`: the real gradients and float32 slices of them;
- `channel`: the peers' TCP connection (socket options, connect, control frames);
- `paced`: `PacedSocket`, a token bucket on `sendmsg` (an emulated link);
- `frames`, `links`, `codec_table`: the three sections;
- `peer`: the sink and the source, and ``python -m harness.bench.wire peer`` (`__main__`);
- `backends`: where the peers run (local processes, docker containers);
- `summary`: the targets from the raw values;
- `run`: `run_bench`, plan -> backend -> ``results/bench-wire-<stamp>.json``;
- `table`: the report as `rich` tables; `cli`: the verb's options.

The peer modules need only the standard library, numpy, torch and `wiiide` (and `harness.errors`),
so they run in the node image with ``harness/`` mounted at /app/harness; nothing is imported here so
that ``python -m harness.bench.wire peer`` loads only what the peer needs.
"""
