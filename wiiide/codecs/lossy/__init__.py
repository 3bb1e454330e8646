"""Lossy codecs for float32 gradients: fp16 and bf16 casts, 8-, 4-, 3- and 2-bit blockwise quantization (linear), 2- and
3-bit Lloyd-Max, top-k.

Each one refuses a message holding any tensor that is not float32 (`supports`), so it can only be
chosen for float32 payloads; the policies use them for gradient messages only, after warm-up
(`wiiide.codecs.policy`). The receiver rebuilds float32 tensors of exactly the declared shapes; the
payload size is checked against what the header's shapes and ``codec_params`` imply before any
array is built, so a lossy frame can never decode to more than its declared ``raw_nbytes``. Decoding
always builds a new array (never a view of the payload), so a receiver may keep it past the next read
(`wiiide.server.pace.feedback.received_values`).

Error bounds (tested in tests/unit/test_wire_codecs.py), for finite inputs x:
- fp16: |x| <= 65504 (larger values are clamped to +-65504): relative error <= 2**-11 for normal
  halves (|x| >= 2**-14), absolute error <= 2**-25 below; nan stays nan.
- bf16: round to nearest even of the top 16 bits: relative error <= 2**-8; nan stays nan.
- int8: per block of `block` elements, scale = max|x| / 127; |error| <= scale / 2.
- int4: per block of `block` elements, scale = max|x| / 7; |error| <= scale / 2 (two values a byte).
- int3: per block of `block` elements, scale = max|x| / 3; |error| <= scale / 2 (eight values to three bytes).
- int3z: int3's values exactly (its codes entropy-coded with zstd).
- int2: per block of `block` elements, scale = max|x|, codes -1..1; |error| <= scale / 2 (four values a
  byte).
- lloyd2: no bound per value (four levels +-0.5675 m, +-1.8930 m, m = the block's mean |x|); relative squared
  error about 0.12 on Gaussian blocks (Max 1960's 0.1175), under error feedback only.
- lloyd3: no bound per value (eight levels +-0.3072, +-0.9475, +-1.6845, +-2.6971 m); relative squared error about
  0.035 on Gaussian blocks (Max 1960's 0.03454), under error feedback only.
- topk: the k = ceil(fraction * n) largest |x + residual| per tensor travel exactly; the rest is kept
  in the sender's residual and added to that tensor next time (error feedback, as in Stich et al.
  2018, "Sparsified SGD with memory", and PyTorch's PowerSGD hook). So the sum of everything decoded
  plus the residual equals the sum of everything encoded.

Modules, imports running down this list:

- `wiiide.codecs.lossy.casts`: fp16, bf16, and the float32-only checks every lossy codec shares;
- `wiiide.codecs.lossy.blockwise`: the blockwise codecs' block size and naming; int8;
- `wiiide.codecs.lossy.packed`: int4, int3, int3z, int2 and their code packing;
- `wiiide.codecs.lossy.lloyd`: lloyd2, lloyd3;
- `wiiide.codecs.lossy.topk`: top-k with error feedback.

This package re-exports nothing: `wiiide.codecs.registry` maps wire ids to these classes.
"""
