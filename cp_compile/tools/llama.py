"""A small Llama-style model written for one device, used by the demo and tests.

Nothing here knows about context parallelism: RoPE reads a ``positions``
input (global positions of the tokens given), attention is plain causal
``F.scaled_dot_product_attention`` with GQA. Under CP the caller passes this
rank's tokens and ``plan.positions(...)``; the compile backend does the rest.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint, create_selective_checkpoint_contexts


@dataclass
class LlamaConfig:
    vocab: int = 256
    dim: int = 64
    layers: int = 2
    heads: int = 4
    kv_heads: int = 2
    hidden: int = 128
    rope_base: float = 10000.0
    checkpoint: str = "none"  # "none" | "full" (torch.utils.checkpoint) | "selective" (a SAC policy)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def rope(x: torch.Tensor, positions: torch.Tensor, base: float) -> torch.Tensor:
    """Rotary embedding of ``x`` [B, H, S, D] at ``positions`` [S]."""
    half = x.shape[-1] // 2
    freqs = base ** (-torch.arange(half, device=x.device, dtype=x.dtype) / half)
    angles = positions.to(x.dtype).unsqueeze(-1) * freqs
    cos, sin = angles.cos(), angles.sin()
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)


class Attention(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.cfg = cfg
        self.head_dim = cfg.dim // cfg.heads
        self.wq = nn.Linear(cfg.dim, cfg.heads * self.head_dim, bias=False)
        self.wk = nn.Linear(cfg.dim, cfg.kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(cfg.dim, cfg.kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(cfg.heads * self.head_dim, cfg.dim, bias=False)

    def forward(self, x, positions):
        b, s, _ = x.shape
        q = self.wq(x).view(b, s, self.cfg.heads, self.head_dim).transpose(1, 2)
        k = self.wk(x).view(b, s, self.cfg.kv_heads, self.head_dim).transpose(1, 2)
        v = self.wv(x).view(b, s, self.cfg.kv_heads, self.head_dim).transpose(1, 2)
        q, k = rope(q, positions, self.cfg.rope_base), rope(k, positions, self.cfg.rope_base)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=self.cfg.heads != self.cfg.kv_heads)
        return self.wo(out.transpose(1, 2).reshape(b, s, -1))


class Block(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.attn_norm, self.attn = RMSNorm(cfg.dim), Attention(cfg)
        self.mlp_norm = RMSNorm(cfg.dim)
        self.w1 = nn.Linear(cfg.dim, cfg.hidden, bias=False)
        self.w3 = nn.Linear(cfg.dim, cfg.hidden, bias=False)
        self.w2 = nn.Linear(cfg.hidden, cfg.dim, bias=False)

    def forward(self, x, positions):
        x = x + self.attn(self.attn_norm(x), positions)
        h = self.mlp_norm(x)
        return x + self.w2(F.silu(self.w1(h)) * self.w3(h))


def _recompute_cheap_ops(ctx, op, *args, **kwargs):
    """Selective checkpointing: keep matmuls and attention, recompute the rest."""
    from torch.utils.checkpoint import CheckpointPolicy

    keep = {torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default}
    if op in keep or op.namespace == "cp" or "attention" in str(op):
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE


def _selective_context():
    # module-level: Dynamo accepts a plain function as context_fn, not a closure
    return create_selective_checkpoint_contexts(_recompute_cheap_ops)


class Llama(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab, cfg.dim)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.layers))
        self.norm = RMSNorm(cfg.dim)
        self.head = nn.Linear(cfg.dim, cfg.vocab, bias=False)

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            if self.cfg.checkpoint == "full":
                x = checkpoint(block, x, positions, use_reentrant=False)
            elif self.cfg.checkpoint == "selective":
                x = checkpoint(block, x, positions, use_reentrant=False, context_fn=_selective_context)
            else:
                x = block(x, positions)
        return self.head(self.norm(x))


def token_loss_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Summed (not averaged) token loss, so shards' losses add up to the global one."""
    logits = logits.float() if logits.dtype in (torch.float16, torch.bfloat16) else logits
    return F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="sum")
