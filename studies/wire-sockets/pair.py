"""Frames against the raw loop between two peers, with the nodes' socket set-ups side by side (`ab.sh`
runs it between two containers): raw sendmsg/recv_into, frames on blocking sockets, with a Python
timeout (`settimeout`) and with the kernel's timeouts (`wiiide.wire.sockets.set_io_timeout`). The
variants named on the command line run in turns, each repeat starting one further on.
`python pair.py sink PORT`; `python pair.py source HOST PORT raw,encode,...` (env SIZE, COUNT, REPEATS)."""
import os, socket, sys, time, statistics, json
import numpy as np
from wiiide.codecs import codec_from_name
from wiiide.wire.encode import encode_message
from wiiide.wire.messages import WireTensor
from wiiide.wire.reader import FrameReader
from wiiide.wire.send import send_frames

SIZE = int(os.environ.get("SIZE", 1 << 20))
COUNT = int(os.environ.get("COUNT", 512))
REPEATS = int(os.environ.get("REPEATS", 5))

def cfg(s):
    s.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 8 << 20)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 8 << 20)
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

def sink(port):
    l = socket.socket(); l.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1); cfg(l)
    l.bind(("0.0.0.0", port)); l.listen(1); print("listening", flush=True)
    c, _ = l.accept(); cfg(c)
    reader = FrameReader(c, 1 << 31, reuse_buffers=True, whole_frames=True)
    buf = memoryview(bytearray(SIZE + 4096))
    while True:
        hdr = bytearray(8); v = memoryview(hdr); got = 0
        while got < 8:
            n = c.recv_into(v[got:]);
            if not n: return
            got += n
        mode, count = hdr[0], int.from_bytes(hdr[1:8], "big")
        set_mode(c, mode if mode in (3, 4) else 1)
        cpu0 = time.process_time()
        stages = {}
        if mode == 0:  # raw whole
            view = buf[:SIZE]
            for _ in range(count):
                got = c.recv_into(view)
                while got < SIZE:
                    got += c.recv_into(view[got:])
        elif mode in (1, 3, 4):
            for _ in range(count):
                reader.read_message()
        else:  # timed: thread CPU in read_raw (recv calls, prefix, header parse) and in decode_payload
            from wiiide.wire.decode import decode_payload
            tt = time.thread_time
            read_s = dec_s = 0.0
            for _ in range(count):
                a = tt(); h, pl, n = reader.read_raw(); b = tt(); decode_payload(h, pl); dec_s += tt() - b; read_s += b - a
            stages = {"sink_read_raw_us": read_s / count * 1e6, "sink_decode_us": dec_s / count * 1e6}
        cpu = time.process_time() - cpu0
        set_mode(c, 1)
        out = json.dumps({"cpu": cpu, **stages}).encode()
        c.sendall(len(out).to_bytes(8, "big") + out)

def set_mode(sock, mode):
    """The node's socket set-up of a frames trial: 1 blocking (the bench's), 3 a Python timeout of 10 s
    (main's nodes: settimeout(io_timeout_s)), 4 the kernel's timeouts (set_io_timeout)."""
    import struct
    sock.settimeout(None)
    zero = struct.pack("ll", 0, 0)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, zero); sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, zero)
    if mode == 3:
        sock.settimeout(10.0)
    elif mode == 4:
        from wiiide.wire.sockets import set_io_timeout
        set_io_timeout(sock, 10.0)

def busy(us):
    t = time.perf_counter() + us * 1e-6
    while time.perf_counter() < t: pass

def source(host, port, variants):
    s = socket.create_connection((host, port)); cfg(s)
    p = np.random.default_rng(0).standard_normal(SIZE // 4).astype(np.float32)
    raw = memoryview(p).cast("B")
    codec = codec_from_name("none")
    pre = encode_message("gradients", {"step": 0}, [WireTensor("grad", p)], codec, None)
    def run(name, count):
        mode = (0 if name.startswith("raw") else 2 if name.endswith("timed") else 3 if name == "encode-pytimeout"
                else 4 if name == "encode-kerneltimeout" else 1)
        stages = {}
        s.sendall(bytes([mode]) + count.to_bytes(7, "big"))
        set_mode(s, mode if mode in (3, 4) else 1)
        t0, c0 = time.perf_counter(), time.process_time()
        if name == "raw":
            for _ in range(count):
                sent = s.sendmsg((raw,))
                while sent < SIZE: sent += s.sendmsg((raw[sent:],))
        elif name.startswith("rawbusy"):
            us = float(name[7:])
            for _ in range(count):
                busy(us)
                sent = s.sendmsg((raw,))
                while sent < SIZE: sent += s.sendmsg((raw[sent:],))
        elif name == "rawtimed":
            tt = time.thread_time; send_s = 0.0
            for _ in range(count):
                a = tt()
                sent = s.sendmsg((raw,))
                while sent < SIZE: sent += s.sendmsg((raw[sent:],))
                send_s += tt() - a
            stages = {"src_send_us": send_s / count * 1e6}
        elif name == "encodetimed":
            tt = time.thread_time; enc_s = send_s = 0.0
            for _ in range(count):
                a = tt()
                f = encode_message("gradients", {"step": 0}, [WireTensor("grad", p)], codec, None)
                b = tt()
                send_frames(s, [f])
                send_s += tt() - b; enc_s += b - a
            stages = {"src_encode_us": enc_s / count * 1e6, "src_send_us": send_s / count * 1e6}
        elif name == "prebuilt":
            for _ in range(count): send_frames(s, [pre])
        elif name in ("encode", "encode-pytimeout", "encode-kerneltimeout"):
            for _ in range(count):
                f = encode_message("gradients", {"step": 0}, [WireTensor("grad", p)], codec, None)
                send_frames(s, [f])
        elif name.startswith("prebusy"):
            us = float(name[7:])
            for _ in range(count):
                busy(us); send_frames(s, [pre])
        set_mode(s, 1)
        def exact(n):
            b = b""
            while len(b) < n: b += s.recv(n - len(b))
            return b
        ack = json.loads(exact(int.from_bytes(exact(8), "big")))
        dt = time.perf_counter() - t0
        stages.update({k: v for k, v in ack.items() if k != "cpu"})
        return count * SIZE / dt, (time.process_time() - c0) / dt, ack["cpu"] / dt, stages
    res = {v: [] for v in variants}
    for r in range(REPEATS):
        order = variants[r % len(variants):] + variants[:r % len(variants)]
        for v in order:
            run(v, max(2, COUNT // 8))
            res[v].append(run(v, COUNT))
    base = res[variants[0]]
    for v in variants:
        bps = [x[0] for x in res[v]]
        ratio = statistics.median([a[0] / b[0] for a, b in zip(res[v], base)])
        print(f"{v:12s} {statistics.median(bps)/1e6:8.0f} MB/s  vs {variants[0]} {ratio:.3f}  "
              f"src_cpu {statistics.median([x[1] for x in res[v]]):.2f} sink_cpu {statistics.median([x[2] for x in res[v]]):.2f}  "
              f"all {[round(b/1e6) for b in bps]}", flush=True)
        st = res[v][0][3]
        if st:
            print("   stages (us per frame, median):", {k: round(statistics.median([x[3][k] for x in res[v]]), 2) for k in st}, flush=True)

if __name__ == "__main__":
    if sys.argv[1] == "sink": sink(int(sys.argv[2]))
    else: source(sys.argv[2], int(sys.argv[3]), sys.argv[4].split(","))
