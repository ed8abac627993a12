"""The batches of ``fxfuse audit``: the same token ids in every mode, synthetic or from a token file."""
from __future__ import annotations

import torch


class Batches:
    """Batch ``i`` as the model's keyword arguments, identical in every mode: input_ids [batch, seq],
    labels (the same ids: HF shifts them) and, with ``mask``, the attention_mask a collator passes.

    Synthetic, from a generator seeded by (seed, i): "uniform" tokens (nothing to learn: the loss can
    only approach ln(vocab), and once there AdamW's steps follow gradient noise), or "zipf": token
    ranks drawn with probability ~ 1 / rank, as word frequencies in text, over a seeded permutation of
    the vocabulary, so the loss has somewhere to go for hundreds of steps. Token file (.npy, .pt, or a
    raw uint16 .bin as nanoGPT writes): batch i is the next batch*seq tokens, wrapping around.

    ``mask``: "none" (no attention_mask: the model builds its causal mask itself), "ones" (an all-ones
    attention_mask, as a collator passes when nothing is padded: the mask then depends on an input),
    "padded" (row r keeps a seeded length in [seq/2, seq] and is right-padded: attention_mask 0 and
    labels -100 after it, as an SFT collator pads). ``seq_lengths``: batch i has sequence length
    seq_lengths[i % len(seq_lengths)] instead of ``seq`` (batches padded to their longest sample).
    """

    def __init__(self, vocab: int, batch: int, seq: int, seed: int, device: str, token_file: str | None = None,
                 synthetic: str = "uniform", mask: str = "none", seq_lengths: list[int] | None = None):
        if synthetic not in SYNTHETIC:
            raise ValueError(f"synthetic={synthetic!r}: expected one of {SYNTHETIC}")
        if mask not in MASKS:
            raise ValueError(f"mask={mask!r}: expected one of {MASKS}")
        if seq_lengths is not None and (not seq_lengths or min(seq_lengths) < 2):
            raise ValueError(f"seq_lengths={seq_lengths!r}: expected lengths >= 2")
        self.mask, self.seq_lengths = mask, list(seq_lengths) if seq_lengths else None
        self.vocab, self.batch, self.seq, self.seed, self.device = vocab, batch, seq, seed, device
        self.zipf = _zipf(vocab, seed) if synthetic == "zipf" and not token_file else None
        self.tokens = _load_tokens(token_file) if token_file else None
        if self.tokens is not None:
            if self.tokens.numel() < batch * seq + 1:
                raise ValueError(f"token file has {self.tokens.numel()} tokens, fewer than one batch ({batch * seq})")
            top = int(self.tokens.max())
            if top >= vocab:
                raise ValueError(f"token file has token id {top} >= the model's vocab_size {vocab}")

    def seq_len(self, i: int) -> int:
        return self.seq_lengths[i % len(self.seq_lengths)] if self.seq_lengths else self.seq

    def __call__(self, i: int) -> dict[str, torch.Tensor]:
        seq = self.seq_len(i)
        n = self.batch * seq
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + i)
        if self.tokens is None:
            if self.zipf is None:
                ids = torch.randint(0, self.vocab, (self.batch, seq), generator=g)
            else:
                probs, token_of_rank = self.zipf
                ranks = torch.multinomial(probs, n, replacement=True, generator=g)
                ids = token_of_rank[ranks].view(self.batch, seq)
        else:
            start = (i * n) % (self.tokens.numel() - n)
            ids = self.tokens[start:start + n].view(self.batch, seq)
        batch = {"input_ids": ids, "labels": ids}
        if self.mask != "none":
            keep = torch.ones(self.batch, seq, dtype=torch.long)
            if self.mask == "padded":  # right padding after each row's length; pad id 0, label -100
                lengths = torch.randint(seq // 2, seq + 1, (self.batch, 1), generator=g)
                keep = (torch.arange(seq) < lengths).long()
                batch = {"input_ids": ids * keep, "labels": ids.masked_fill(keep == 0, -100)}
            batch["attention_mask"] = keep
        return {k: v.to(self.device) for k, v in batch.items()}


SYNTHETIC = ("uniform", "zipf")
MASKS = ("none", "ones", "padded")


def _zipf(vocab: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(p(rank) ~ 1 / rank over [vocab] fp64, the token id of each rank: a permutation seeded by seed)."""
    probs = 1.0 / torch.arange(1, vocab + 1, dtype=torch.float64)
    return probs / probs.sum(), torch.randperm(vocab, generator=torch.Generator().manual_seed(seed))


def _load_tokens(path: str) -> torch.Tensor:
    if path.endswith(".pt"):
        t = torch.load(path)
    elif path.endswith(".npy"):
        import numpy as np

        t = torch.from_numpy(np.load(path).astype("int64"))
    else:
        import numpy as np

        t = torch.from_numpy(np.fromfile(path, dtype=np.uint16).astype("int64"))
    return t.reshape(-1).long()
