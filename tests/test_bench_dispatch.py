"""bench/bench_dispatch.py --stub-kernels on CPU: every fused op's Triton host wrapper runs with each
@triton.jit kernel it launches replaced by a no-op, also those of helper modules (kernels/_rms_norm_dw.py:
when the dw reduction moved there the stub missed it and the run died on Triton's missing GPU driver)."""
import os
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_stubbed_wrappers_of_every_op_run_on_cpu():
    cmd = [sys.executable, os.path.join(ROOT, "bench", "bench_dispatch.py"), "--stub-kernels", "-n", "20",
           "--repeats", "5"]  # min of 5 runs: one run under a loaded CPU can invert fwd and fwd+bwd
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert res.returncode == 0, res.stderr[-3000:]
    rows = re.findall(r"^(\w+)\s+fxfuse\s+([\d.]+)\s+([\d.]+)$", res.stdout, re.M)
    assert [r[0] for r in rows] == ["rms_norm", "rope", "swiglu", "linear_cross_entropy"], res.stdout
    assert all(0 < float(fwd) < float(both) for _, fwd, both in rows), rows
