"""The wire: frames, sockets, TLS, authentication and admission of every connection.

Modules, one job each, in the order their imports run (a module imports only those above it):

- `wiiide.wire.format`: the frame layout, its constants and limits, the dtype whitelist, `byte_view`;
- `wiiide.wire.messages`: `WireTensor`, `Message` (decoded) and `Frame` (encoded, ready to send);
- `wiiide.wire.encode`: `encode_message` (the JSON header from cached templates, the payload a codec
  made) and `with_meta`;
- `wiiide.wire.send`: `send_frames` (scatter-gather `sendmsg`; TLS buffers joined by `coalesced`);

  these four import no codec: the codecs and their compression policy (`wiiide.codecs.policy`) build
  on them;

- `wiiide.wire.decode`: `parse_header` and `decode_payload`, by the codec registry (`wiiide.codecs`);
- `wiiide.wire.reader`: `FrameReader`, size limits and an absolute deadline per read;
- `wiiide.wire.tls_stream`: `TLSStream`, TLS 1.3 over two memory BIOs on a plain socket;
- `wiiide.wire.tls`: the TLS contexts and handshake, `wrap_server`/`wrap_client`;
- `wiiide.wire.auth`: the HMAC handshake (hello, welcome, verify);
- `wiiide.wire.admission`: the handshake gate (slots, per-address limits, refusals);
- `wiiide.wire.sockets`: socket options from config, with read-back; congestion control per route.
- `wiiide.wire.tensors`: torch tensors to and from `WireTensor` (no pickle);
- `wiiide.wire.node`: `Connection` (one socket's frames with the node's accounting) and `run_node`,
  the node's life cycle;
- `wiiide.wire.handshake`: one handshake and session set-up for every connection (`accept_hello`,
  `dial`, `join`), over `node`, `auth`, `tls`, `admission` and `sockets`.

This package re-exports nothing: import the module that does the job.
"""
