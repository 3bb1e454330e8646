"""A decoder-only byte-level language model (GPT-style, pre-norm), from torch.nn modules.

Token embedding (256 bytes x width) + learned positions (context x width); `layers` blocks of
LayerNorm -> causal multi-head self-attention (`torch.nn.functional.scaled_dot_product_attention` with
``is_causal=True``: position t sees positions <= t) -> residual, LayerNorm -> MLP (width -> 4 width
-> width, GELU) -> residual; a final LayerNorm and a Linear to 256 logits. No dropout.

Parameters: about 12 L d^2 + 2 d (256 + context) (L layers, d width). L=4, d=128, context 128: 0.88 M;
L=8, d=512: 25.5 M; L=12, d=576: 48.2 M. Input int64 (batch, T) bytes with T <= context, output
float32 (batch, T, 256) logits of the next byte.

Activation checkpointing (``activation_checkpointing = True``): each block runs under
``torch.utils.checkpoint.checkpoint(block, h, use_reentrant=False)`` while gradients are recorded, so
the forward keeps only each block's input and the backward recomputes the block's insides (Chen et
al., "Training Deep Nets with Sublinear Memory Cost", 2016): the same gradients for about one more
forward of the blocks.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

VOCAB_SIZE = 256


class Block(nn.Module):
    """One pre-norm transformer block of width `width` with `heads` heads (width % heads == 0)."""

    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(width)
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)
        self.ln2 = nn.LayerNorm(width)
        self.up = nn.Linear(width, 4 * width)
        self.down = nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(batch, T, width) float32 -> the same shape."""
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=2)
        q, k, v = (z.reshape(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        att = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(att.transpose(1, 2).reshape(b, t, d))
        return x + self.down(nn.functional.gelu(self.up(self.ln2(x))))


class ByteTransformer(nn.Module):
    """See the module docstring."""

    def __init__(self, layers: int, width: int, heads: int, context: int) -> None:
        super().__init__()
        if width % heads:
            raise ValueError(f"transformer_width {width} must be a multiple of transformer_heads {heads}")
        self.context = context
        self.activation_checkpointing = False  # see the module docstring
        self.tokens = nn.Embedding(VOCAB_SIZE, width)
        self.positions = nn.Embedding(context, width)
        self.blocks = nn.ModuleList(Block(width, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(width)
        self.head = nn.Linear(width, VOCAB_SIZE)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """int64 (batch, T) bytes, T <= context -> float32 (batch, T, 256) next-byte logits.

        Raises:
            ValueError: T above the context.
        """
        t = x.shape[1]
        if t > self.context:
            raise ValueError(f"sequence of {t} bytes exceeds the context of {self.context}")
        h = self.tokens(x) + self.positions(torch.arange(t, device=x.device))
        recompute = self.activation_checkpointing and torch.is_grad_enabled()
        for block in self.blocks:
            h = checkpoint(block, h, use_reentrant=False) if recompute else block(h)
        return self.head(self.ln_f(h))


def build_transformer(layers: int, width: int, heads: int, context: int, seed: int) -> ByteTransformer:
    """`ByteTransformer` after ``torch.manual_seed(seed)``. Raises ValueError (width % heads != 0)."""
    torch.manual_seed(seed)
    return ByteTransformer(layers, width, heads, context)
