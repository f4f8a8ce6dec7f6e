"""A small Llama-style model in plain torch, and its tensor-parallel plans.

RMSNorm, attention with rotary position embeddings (RoPE), a SwiGLU MLP, tied or
untied embeddings. Activations are **sequence-first**, ``[S, B, H]`` (as Megatron
lays them out): a row-parallel linear flattens them to ``[S*B, H]``, so sharding the
output on the sequence dim is sharding the GEMM's rows, which is exactly what the
fused GEMM + reduce-scatter produces.

    >>> cfg = LlamaConfig(vocab_size=64, dim=32, n_layers=2, n_heads=4, ffn_hidden=64, max_seq_len=16)
    >>> model = Llama(cfg)
    >>> logits = model(torch.randint(0, 64, (2, 16)))       # tokens [B=2, S=16]
    >>> logits.shape                                         # sequence-first [S, B, vocab]
    torch.Size([16, 2, 64])
    >>> loss = next_token_loss(logits, targets)             # targets [B, S]

The same code runs on plain tensors (one process) and on axedist DTensors after
``parallelize(model, mesh, llama_tp_plan(cfg, sequence_parallel=True))``: every op
it calls has a sharding rule, so no line here knows about devices.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["LlamaConfig", "Llama", "RMSNorm", "Attention", "FeedForward", "TransformerBlock",
           "next_token_loss", "llama_tp_plan"]


@dataclass(frozen=True)
class LlamaConfig:
    """Sizes of the model: ``LlamaConfig(vocab_size=256, dim=128, n_layers=2, n_heads=4)``."""

    vocab_size: int = 256
    dim: int = 128
    n_layers: int = 2
    n_heads: int = 4
    n_kv_heads: int | None = None      # grouped-query attention when < n_heads
    ffn_hidden: int = 256
    max_seq_len: int = 64
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    tie_embeddings: bool = False

    def __post_init__(self):
        kv = self.kv_heads
        if self.dim % self.n_heads:
            raise ValueError(f"dim {self.dim} is not divisible by n_heads {self.n_heads}")
        if (self.dim // self.n_heads) % 2:
            raise ValueError(f"head dim {self.dim // self.n_heads} must be even for RoPE")
        if self.n_heads % kv:
            raise ValueError(f"n_heads {self.n_heads} is not a multiple of n_kv_heads {kv}")

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    @property
    def kv_heads(self) -> int:
        return self.n_kv_heads or self.n_heads


class RMSNorm(nn.Module):
    """``x / rms(x) * weight`` over the last dim (torch's fused ``rms_norm``)."""

    def __init__(self, dim: int, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}"


def rope_tables(head_dim: int, max_seq_len: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin, ``[max_seq_len, head_dim]``: position p, pair i rotates by ``p * theta^(-2i/d)``."""
    inv = theta ** (-torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    angles = torch.outer(torch.arange(max_seq_len, dtype=torch.float64), inv)
    angles = torch.cat([angles, angles], dim=-1)  # rotate_half pairs dim i with i + d/2
    return angles.cos().float(), angles.sin().float()


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    first, second = x.chunk(2, dim=-1)
    return torch.cat([-second, first], dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` ``[S, B, heads, d]`` by the tables ``[S, d]`` (broadcast over B and heads), in
    ``x``'s dtype: under autocast the fp32 tables would otherwise leave q and k in fp32 beside a
    bf16 v, which eager SDPA's autocast casts back but a compiled graph's fake run refuses."""
    cos = cos[:, None, None, :]
    sin = sin[:, None, None, :]
    return (x * cos + _rotate_half(x) * sin).to(x.dtype)


class Attention(nn.Module):
    """Causal self-attention with RoPE; ``[S, B, dim] -> [S, B, dim]``."""

    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.n_heads, self.kv_heads, self.head_dim = cfg.n_heads, cfg.kv_heads, cfg.head_dim
        self.wq = nn.Linear(cfg.dim, cfg.n_heads * cfg.head_dim, bias=False)
        self.wk = nn.Linear(cfg.dim, cfg.kv_heads * cfg.head_dim, bias=False)
        self.wv = nn.Linear(cfg.dim, cfg.kv_heads * cfg.head_dim, bias=False)
        self.wo = nn.Linear(cfg.n_heads * cfg.head_dim, cfg.dim, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        s, b = x.shape[0], x.shape[1]
        q = self.wq(x).view(s, b, self.n_heads, self.head_dim)
        k = self.wk(x).view(s, b, self.kv_heads, self.head_dim)
        v = self.wv(x).view(s, b, self.kv_heads, self.head_dim)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if self.kv_heads != self.n_heads:  # each kv head serves n_heads / kv_heads query heads
            repeat = self.n_heads // self.kv_heads
            k = k.unsqueeze(3).expand(s, b, self.kv_heads, repeat, self.head_dim).reshape(s, b, self.n_heads, -1)
            v = v.unsqueeze(3).expand(s, b, self.kv_heads, repeat, self.head_dim).reshape(s, b, self.n_heads, -1)
        # sdpa wants [B, heads, S, d]
        q, k, v = (t.permute(1, 2, 0, 3) for t in (q, k, v))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        out = out.permute(2, 0, 1, 3).reshape(s, b, self.n_heads * self.head_dim)
        return self.wo(out)


class FeedForward(nn.Module):
    """SwiGLU: ``w2(silu(w1 x) * w3 x)``."""

    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.w1 = nn.Linear(cfg.dim, cfg.ffn_hidden, bias=False)
        self.w3 = nn.Linear(cfg.dim, cfg.ffn_hidden, bias=False)
        self.w2 = nn.Linear(cfg.ffn_hidden, cfg.dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.attention_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.attention = Attention(cfg)
        self.ffn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.feed_forward = FeedForward(cfg)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x), cos, sin)
        return x + self.feed_forward(self.ffn_norm(x))


class Llama(nn.Module):
    """Tokens ``[B, S]`` -> logits ``[S, B, vocab]`` (sequence-first, see the module docstring)."""

    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.cfg = cfg
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleList(TransformerBlock(cfg) for _ in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.output = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight
        cos, sin = rope_tables(cfg.head_dim, cfg.max_seq_len, cfg.rope_theta)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        self.reset_parameters()

    def reset_parameters(self, std: float = 0.02) -> None:
        """Small normal weights (scaled down for the residual projections, as GPT-2 does)."""
        for name, p in self.named_parameters():
            if p.dim() == 1:
                nn.init.ones_(p)
            elif name.endswith(("wo.weight", "w2.weight")):
                nn.init.normal_(p, std=std / math.sqrt(2 * self.cfg.n_layers))
            else:
                nn.init.normal_(p, std=std)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        s = tokens.shape[1]
        if s > self.cfg.max_seq_len:
            raise ValueError(f"sequence length {s} is longer than max_seq_len {self.cfg.max_seq_len}")
        h = self.tok_embeddings(tokens.t())          # [S, B, dim]
        cos, sin = self.rope_cos[:s], self.rope_sin[:s]
        for layer in self.layers:
            h = layer(h, cos, sin)
        return self.output(self.norm(h))


def next_token_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy of logits ``[S, B, V]`` against targets ``[B, S]``."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.t().reshape(-1))


def llama_tp_plan(cfg: LlamaConfig, sequence_parallel: bool = True) -> dict:
    """The tensor-parallel plan for :class:`Llama` (module-name patterns -> styles).

    Attention heads and the MLP's hidden dim are split (q/k/v, w1/w3 column-parallel;
    wo, w2 row-parallel), the embedding and the output projection split the vocabulary,
    and the loss runs on vocab-sharded logits. With ``sequence_parallel`` the residual
    stream and the norms are sharded on the sequence dim (0): every row-parallel output is
    a reduce-scatter (the fused GEMM + reduce-scatter on CUDA) and every block input an
    all-gather; without it they are all-reduces and the norms run replicated.
    """
    from torch.distributed.tensor import Replicate, Shard

    from .parallel import (ColwiseParallel, PrepareModuleInput, RowwiseParallel, SequenceParallel,
                           VocabParallelEmbedding)

    residual = Shard(0) if sequence_parallel else Replicate()
    plan = {
        "tok_embeddings": VocabParallelEmbedding(output_layouts=residual),
        "layers.*.attention.wq": ColwiseParallel(),
        "layers.*.attention.wk": ColwiseParallel(),
        "layers.*.attention.wv": ColwiseParallel(),
        "layers.*.attention.wo": RowwiseParallel(output_layouts=residual),
        "layers.*.feed_forward.w1": ColwiseParallel(),
        "layers.*.feed_forward.w3": ColwiseParallel(),
        "layers.*.feed_forward.w2": RowwiseParallel(output_layouts=residual),
        # logits stay sharded on the vocabulary: the loss reads them that way (no gather)
        "output": ColwiseParallel(input_layouts=residual, output_layouts=Shard(-1)),
    }
    if sequence_parallel:
        # the blocks take the whole sequence: all-gather their sequence-sharded inputs
        plan["layers.*.attention"] = PrepareModuleInput(input_layouts=(residual, None, None),
                                                        desired_input_layouts=(Replicate(), None, None))
        plan["layers.*.feed_forward"] = PrepareModuleInput(input_layouts=(residual,),
                                                           desired_input_layouts=(Replicate(),))
        plan["layers.*.attention_norm"] = SequenceParallel(sequence_dim=0)
        plan["layers.*.ffn_norm"] = SequenceParallel(sequence_dim=0)
        plan["norm"] = SequenceParallel(sequence_dim=0)
    return plan
