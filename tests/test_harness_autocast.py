"""The harness under bf16 autocast: what fuses there against fp32 (Result.autocast_gaps), which the loss
curve of the bf16 check cannot show."""
import torch
import torch.nn as nn
import torch.nn.functional as F


class PromotedLogitsBias(nn.Module):
    """BART's head: an unbiased lm_head, then an fp32 [1, V] bias added on its own. Under bf16 autocast
    the add promotes the bf16 logits to fp32, which the fused loss head would not reproduce: it stays
    unfused there (fused in fp32)."""

    def __init__(self, d=8, v=20):
        super().__init__()
        self.lm_head = nn.Linear(d, v, bias=False)
        self.logits_bias = nn.Parameter(torch.randn(1, v))

    def forward(self, x, labels):
        logits = self.lm_head(x) + self.logits_bias
        return F.cross_entropy(logits.view(-1, logits.shape[-1]), labels.view(-1))


def test_harness_reports_sites_that_stop_fusing_under_autocast():
    """The bf16 check compares loss curves, which a site left unfused does not move: the harness also
    compares what fuses under autocast with fp32, and fxfuse check prints the difference."""
    from fxfuse.harness import check
    from fxfuse.zoo import summary

    def build():
        torch.manual_seed(0)
        return PromotedLogitsBias()

    gen = torch.Generator().manual_seed(1)
    inputs = {"x": torch.randn(2, 5, 8, generator=gen), "labels": torch.randint(0, 20, (2, 5), generator=gen)}
    r = check("promoted", build, inputs, loss_of=lambda out: out, has_loss_head=False, bf16_steps=2)
    assert r.fp32_fused["linear_cross_entropy"] == 1 and r.bf16_fused["linear_cross_entropy"] == 0
    assert r.autocast_gaps == ["linear_cross_entropy"]
    assert "under bf16 autocast linear_cross_entropy fuses 0 of the 1 sites fp32 fuses:" in summary(r), summary(r)
    assert "promotes" in summary(r), summary(r)
