"""The harness under bf16 autocast: what fuses there against fp32 (Result.autocast_gaps), which the loss
curve of the bf16 check cannot show."""
import torch
import torch.nn as nn
import torch.nn.functional as F


class MixedGate(nn.Module):
    """act(gate) * up with up computed in fp32 on its own: under bf16 autocast the gate is bf16 and up fp32
    (as Mamba's scan output times act(gate)), which the gated-MLP op does not take."""

    def __init__(self, d=8):
        super().__init__()
        self.gate, self.out = nn.Linear(d, d), nn.Linear(d, d)

    def forward(self, x):
        up = x.float().exp()  # autocast runs exp in fp32
        return self.out(F.silu(self.gate(x)) * up).pow(2).mean()


def test_harness_reports_sites_that_stop_fusing_under_autocast():
    """The bf16 check compares loss curves, which a site left unfused does not move: the harness also
    compares what fuses under autocast with fp32, and fxfuse check prints the difference."""
    from fxfuse.harness import check
    from fxfuse.zoo import summary

    def build():
        torch.manual_seed(0)
        return MixedGate()

    x = torch.randn(2, 5, 8, generator=torch.Generator().manual_seed(1))
    r = check("mixed", build, {"x": x}, loss_of=lambda out: out, has_loss_head=False, bf16_steps=2)
    assert r.fp32_fused["swiglu"] == 1 and r.bf16_fused["swiglu"] == 0 and r.autocast_gaps == ["swiglu"]
    assert "under bf16 autocast swiglu fuses 0 of the 1 sites fp32 fuses: mixed dtypes" in summary(r), summary(r)
