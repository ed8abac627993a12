"""Hand-written transformer models in the styles real training code uses (not HF), for graph tests.

GptFastLM: gpt-fast's model: fused wqkv, interleaved RoPE in real arithmetic (reshape + stack),
hand-written RMSNorm (x * x, fp32 then type_as), SwiGLU ``w2(silu(w1 x) * w3 x)``.
TitanLM: torchtitan / Meta Llama: complex RoPE (``view_as_complex * freqs_cis``), nn.RMSNorm,
separate wq/wk/wv, GQA.
NanoGPT: nanoGPT (LayerNorm, GELU, tied head); NanoChatLM: nanochat (functional norms, RoPE by
-angle on halves, relu^2, a padded lm_head sliced to the vocabulary, fp32 softcap).
All take ``input_ids`` and optional ``labels`` and return the loss when labels are given.
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F


class GptFastRMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def _norm(self, x):
        return x * torch.rsqrt(torch.mean(x * x, dim=-1, keepdim=True) + self.eps)

    def forward(self, x):
        return self._norm(x.float()).type_as(x) * self.weight


def gptfast_freqs(seq_len: int, head_dim: int, base: float = 10000.0) -> torch.Tensor:
    """[T, D/2, 2] (cos, sin) table."""
    freqs = 1.0 / (base ** (torch.arange(0, head_dim, 2)[: head_dim // 2].float() / head_dim))
    angles = torch.outer(torch.arange(seq_len).float(), freqs)
    return torch.stack([angles.cos(), angles.sin()], dim=-1)


def gptfast_rotary(x, freqs_cis):
    """x [B, T, H, D], freqs_cis [T, D/2, 2]."""
    xshaped = x.float().reshape(*x.shape[:-1], -1, 2)
    freqs_cis = freqs_cis.view(1, xshaped.size(1), 1, xshaped.size(3), 2)
    x_out2 = torch.stack(
        [xshaped[..., 0] * freqs_cis[..., 0] - xshaped[..., 1] * freqs_cis[..., 1],
         xshaped[..., 1] * freqs_cis[..., 0] + xshaped[..., 0] * freqs_cis[..., 1]], -1)
    return x_out2.flatten(3).type_as(x)


class GptFastBlock(nn.Module):
    def __init__(self, dim, heads, kv_heads, hidden):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, dim // heads
        self.wqkv = nn.Linear(dim, (heads + 2 * kv_heads) * self.head_dim, bias=False)
        self.wo = nn.Linear(dim, dim, bias=False)
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)
        self.attention_norm = GptFastRMSNorm(dim)
        self.ffn_norm = GptFastRMSNorm(dim)

    def forward(self, x, freqs_cis):
        b, t, _ = x.shape
        h = self.attention_norm(x)
        kv = self.kv_heads * self.head_dim
        q, k, v = self.wqkv(h).split([self.heads * self.head_dim, kv, kv], dim=-1)
        q = gptfast_rotary(q.view(b, t, self.heads, self.head_dim), freqs_cis)
        k = gptfast_rotary(k.view(b, t, self.kv_heads, self.head_dim), freqs_cis)
        v = v.view(b, t, self.kv_heads, self.head_dim)
        q, k, v = (z.transpose(1, 2) for z in (q, k, v))
        rep = self.heads // self.kv_heads
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.wo(y.transpose(1, 2).reshape(b, t, -1))
        h = self.ffn_norm(x)
        return x + self.w2(F.silu(self.w1(h)) * self.w3(h))


class GptFastLM(nn.Module):
    def __init__(self, vocab=96, dim=32, heads=4, kv_heads=2, hidden=48, layers=2, max_seq=64):
        super().__init__()
        self.tok_embeddings = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList(GptFastBlock(dim, heads, kv_heads, hidden) for _ in range(layers))
        self.norm = GptFastRMSNorm(dim)
        self.output = nn.Linear(dim, vocab, bias=False)
        self.register_buffer("freqs_cis", gptfast_freqs(max_seq, dim // heads), persistent=False)

    def forward(self, input_ids, labels=None):
        x = self.tok_embeddings(input_ids)
        freqs = self.freqs_cis[: input_ids.shape[1]]
        for layer in self.layers:
            x = layer(x, freqs)
        logits = self.output(self.norm(x))
        if labels is None:
            return logits
        return F.cross_entropy(logits.view(-1, logits.size(-1)), labels.view(-1))


def titan_freqs_cis(seq_len: int, head_dim: int, theta: float = 10000.0) -> torch.Tensor:
    """[T, D/2] complex64."""
    freqs = 1.0 / (theta ** (torch.arange(0, head_dim, 2)[: head_dim // 2].float() / head_dim))
    angles = torch.outer(torch.arange(seq_len).float(), freqs)
    return torch.polar(torch.ones_like(angles), angles)


def titan_rotary(xq, xk, freqs_cis):
    """xq [B, T, H, D], xk [B, T, Hk, D], freqs_cis [T, D/2] complex."""
    xq_ = torch.view_as_complex(xq.float().reshape(*xq.shape[:-1], -1, 2))
    xk_ = torch.view_as_complex(xk.float().reshape(*xk.shape[:-1], -1, 2))
    freqs_cis = freqs_cis.view(1, xq_.shape[1], 1, xq_.shape[-1])
    xq_out = torch.view_as_real(xq_ * freqs_cis).flatten(3)
    xk_out = torch.view_as_real(xk_ * freqs_cis).flatten(3)
    return xq_out.type_as(xq), xk_out.type_as(xk)


class TitanBlock(nn.Module):
    def __init__(self, dim, heads, kv_heads, hidden):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, dim // heads
        self.wq = nn.Linear(dim, dim, bias=False)
        self.wk = nn.Linear(dim, kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(dim, kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(dim, dim, bias=False)
        self.w1, self.w3 = nn.Linear(dim, hidden, bias=False), nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)
        self.attention_norm, self.ffn_norm = nn.RMSNorm(dim, eps=1e-5), nn.RMSNorm(dim, eps=1e-5)

    def attention(self, q, k, v, *extra):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)

    def forward(self, x, freqs_cis, *extra):  # extra: what a subclass's attention takes (a block mask)
        b, t, _ = x.shape
        h = self.attention_norm(x)
        q = self.wq(h).view(b, t, self.heads, self.head_dim)
        k = self.wk(h).view(b, t, self.kv_heads, self.head_dim)
        v = self.wv(h).view(b, t, self.kv_heads, self.head_dim)
        q, k = titan_rotary(q, k, freqs_cis)
        q, k, v = (z.transpose(1, 2) for z in (q, k, v))
        y = self.attention(q, k, v, *extra)
        x = x + self.wo(y.transpose(1, 2).reshape(b, t, -1))
        h = self.ffn_norm(x)
        return x + self.w2(F.silu(self.w1(h)) * self.w3(h))


class TitanLM(nn.Module):
    def __init__(self, vocab=96, dim=32, heads=4, kv_heads=2, hidden=48, layers=2, max_seq=64):
        super().__init__()
        self.tok_embeddings = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList(TitanBlock(dim, heads, kv_heads, hidden) for _ in range(layers))
        self.norm = nn.RMSNorm(dim, eps=1e-5)
        self.output = nn.Linear(dim, vocab, bias=False)
        self.register_buffer("freqs_cis", titan_freqs_cis(max_seq, dim // heads), persistent=False)

    def forward(self, input_ids, labels=None):
        x = self.tok_embeddings(input_ids)
        for layer in self.layers:
            x = layer(x, self.freqs_cis[: input_ids.shape[1]])
        logits = self.output(self.norm(x))
        if labels is None:
            return logits
        return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(0, 1))


class NanoGPT(nn.Module):
    """nanoGPT: LayerNorm, GELU MLP, learned positions, lm_head tied to the token embedding,
    targets with ignore_index=-1."""

    def __init__(self, vocab=96, dim=32, heads=4, layers=2, max_seq=64):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab, dim), nn.Embedding(max_seq, dim)
        self.blocks = nn.ModuleList(
            nn.TransformerEncoderLayer(dim, heads, 4 * dim, dropout=0.0, activation="gelu", batch_first=True,
                                       norm_first=True) for _ in range(layers))
        self.ln_f = nn.LayerNorm(dim)
        self.lm_head = nn.Linear(dim, vocab, bias=False)
        self.lm_head.weight = self.wte.weight

    def forward(self, input_ids, labels=None):
        t = input_ids.shape[1]
        x = self.wte(input_ids) + self.wpe(torch.arange(t, device=input_ids.device))
        mask = nn.Transformer.generate_square_subsequent_mask(t, device=input_ids.device)
        for block in self.blocks:
            x = block(x, src_mask=mask, is_causal=True)
        logits = self.lm_head(self.ln_f(x))
        if labels is None:
            return logits
        return F.cross_entropy(logits.view(-1, logits.size(-1)), labels.view(-1), ignore_index=-1)


def nanochat_norm(x):
    """nanochat's RMSNorm: functional, no weight."""
    return F.rms_norm(x, (x.size(-1),))


def nanochat_rotary(x, cos, sin):
    """nanochat's apply_rotary_emb: x [B, T, H, D], cos / sin [1, T, 1, D/2]."""
    d = x.shape[3] // 2
    x1, x2 = x[..., :d], x[..., d:]
    y1 = x1 * cos + x2 * sin
    y2 = x1 * (-sin) + x2 * cos
    return torch.cat([y1, y2], 3).to(x.dtype)


class NanoChatAttention(nn.Module):
    def __init__(self, dim, heads, kv_heads):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, dim // heads
        self.c_q = nn.Linear(dim, heads * self.head_dim, bias=False)
        self.c_k = nn.Linear(dim, kv_heads * self.head_dim, bias=False)
        self.c_v = nn.Linear(dim, kv_heads * self.head_dim, bias=False)
        self.c_proj = nn.Linear(dim, dim, bias=False)

    def forward(self, x, cos, sin):
        b, t, _ = x.shape
        q = self.c_q(x).view(b, t, self.heads, self.head_dim)
        k = self.c_k(x).view(b, t, self.kv_heads, self.head_dim)
        v = self.c_v(x).view(b, t, self.kv_heads, self.head_dim)
        q, k = nanochat_rotary(q, cos, sin), nanochat_rotary(k, cos, sin)
        q, k = nanochat_norm(q), nanochat_norm(k)  # QK norm, after the rotation
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=self.heads != self.kv_heads)
        return self.c_proj(y.transpose(1, 2).contiguous().view(b, t, -1))


class NanoChatBlock(nn.Module):
    def __init__(self, dim, heads, kv_heads):
        super().__init__()
        self.attn = NanoChatAttention(dim, heads, kv_heads)
        self.c_fc, self.c_proj = nn.Linear(dim, 4 * dim, bias=False), nn.Linear(4 * dim, dim, bias=False)

    def forward(self, x, cos, sin):
        x = x + self.attn(nanochat_norm(x), cos, sin)
        return x + self.c_proj(F.relu(self.c_fc(nanochat_norm(x))).square())


class NanoChatLM(nn.Module):
    """nanochat: weightless functional RMSNorm (also on q / k after the rotation), RoPE by -angle on
    halves, relu^2 MLP, untied embedding and lm_head padded to a multiple of 64 rows, the logits
    sliced back to the vocabulary, .float(), softcap 15 in fp32; targets with ignore_index=-1."""

    def __init__(self, vocab=96, dim=32, heads=4, kv_heads=2, layers=2, max_seq=64):
        super().__init__()
        self.vocab = vocab
        padded = -(-vocab // 64) * 64
        self.wte = nn.Embedding(padded, dim)
        self.blocks = nn.ModuleList(NanoChatBlock(dim, heads, kv_heads) for _ in range(layers))
        self.lm_head = nn.Linear(dim, padded, bias=False)
        half = dim // heads // 2
        inv_freq = 1.0 / (10000 ** (torch.arange(half).float() / half))
        angles = torch.outer(torch.arange(max_seq).float(), inv_freq)[None, :, None, :]  # [1, T, 1, D/2]
        self.register_buffer("cos", angles.cos(), persistent=False)
        self.register_buffer("sin", angles.sin(), persistent=False)

    def forward(self, input_ids, labels=None):
        t = input_ids.shape[1]
        cos, sin = self.cos[:, :t], self.sin[:, :t]
        x = nanochat_norm(self.wte(input_ids))
        for block in self.blocks:
            x = block(x, cos, sin)
        logits = self.lm_head(nanochat_norm(x))[..., :self.vocab]
        logits = logits.float()
        logits = 15 * torch.tanh(logits / 15)
        if labels is None:
            return logits
        return F.cross_entropy(logits.view(-1, logits.size(-1)), labels.view(-1), ignore_index=-1)
