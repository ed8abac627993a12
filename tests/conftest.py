"""Test session setup: Triton kernels run under the interpreter on CPU (set here, before triton is
imported: test files never set it), so graph tests exercise the same kernel code a GPU runs.
FXFUSE_TEST_DEVICE=cuda runs on a GPU. FXFUSE_TEST_KERNELS=reference leaves the interpreter off, so
on CPU the fused ops run their PyTorch reference (for a Triton whose interpreter cannot run the
kernels: 3.2, torch 2.6's), and skips the tests marked ``interpreter`` (the kernel test files),
which compare those kernels against that reference; run them in a pytest call without it."""
import os

REFERENCE_KERNELS = os.environ.get("FXFUSE_TEST_KERNELS") == "reference"
if os.environ.get("FXFUSE_TEST_DEVICE", "cpu") != "cuda" and not REFERENCE_KERNELS:
    os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402

# triton.jit reads TRITON_INTERPRET when a kernel module is imported: import every kernel now, so a
# test that unsets it (to take the PyTorch reference path) is never the first importer, leaving
# compiled-mode kernels behind for the tests after it ("0 active drivers" on this CPU machine)
import fxfuse.kernels.clamped_swiglu  # noqa: E402, F401
import fxfuse.kernels.linear_cross_entropy  # noqa: E402, F401
import fxfuse.kernels.rms_norm  # noqa: E402, F401
import fxfuse.kernels.rope  # noqa: E402, F401
import fxfuse.kernels.swiglu  # noqa: E402, F401
import fxfuse.kernels.swiglu_packed  # noqa: E402, F401

# FXFUSE_TRITON_SPECS=DIR (.ci/run): record each interpreted launch's specialization, for
# tests/triton_specs.py to compile for a GPU after the run (what the interpreter never checks)
if os.environ.get("FXFUSE_TRITON_SPECS") and os.environ.get("TRITON_INTERPRET") == "1":
    from triton_specs import install_recorder  # noqa: E402

    os.makedirs(os.environ["FXFUSE_TRITON_SPECS"], exist_ok=True)
    install_recorder(os.path.join(os.environ["FXFUSE_TRITON_SPECS"],
                                  os.environ.get("PYTEST_XDIST_WORKER", "main") + ".jsonl"),
                     modules=("fxfuse.",))  # the package's kernels (bench probes load theirs by path)

# pytest-xdist (README's test command runs two processes): split the cores between the processes, so
# torch's intra-op threads do not oversubscribe them (both runs of a parity check share the setting)
if os.environ.get("PYTEST_XDIST_WORKER_COUNT"):
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ["PYTEST_XDIST_WORKER_COUNT"])))


def pytest_collection_modifyitems(config, items):
    no_gpu = pytest.mark.skip(reason="needs a CUDA device (run on the device machine)")
    no_interpreter = pytest.mark.skip(reason="FXFUSE_TEST_KERNELS=reference: the Triton interpreter is off")
    for item in items:
        if "gpu" in item.keywords and not torch.cuda.is_available():
            item.add_marker(no_gpu)
        elif "interpreter" in item.keywords and "gpu" not in item.keywords and REFERENCE_KERNELS:
            item.add_marker(no_interpreter)


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    """Each test compiles from scratch: no cached graph from an earlier test."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.fixture(autouse=True)
def _hf_checkpointing(request):
    """Tests marked hf_checkpointing checkpoint HF models: under transformers >= 5.25 they run with
    Dynamo's remedy for the checkpointed layers' side effect, as README tells users to (without it
    every such layer runs eagerly; tests/test_outside.py checks the report says so)."""
    from fxfuse.checkpoint import skip_checkpoint_side_effect_replay

    if request.node.get_closest_marker("hf_checkpointing") is None:
        yield
        return
    with skip_checkpoint_side_effect_replay():
        yield


@pytest.fixture
def exact_fp32():
    """CUDA matmuls and convolutions in full fp32 for the test, the flags restored after it
    (fxfuse.harness.exact_fp32): fp32 parity on a GPU measures fxfuse, not TF32's rounding."""
    from fxfuse.harness import exact_fp32 as exact

    with exact():
        yield


@pytest.fixture
def paths(monkeypatch):
    """Which variant each call of a graph compiled with a run-time checked causal variant ran
    (fxfuse/attention_tags.py): "causal" or "traced", in call order."""
    from fxfuse import backend

    taken = []
    real = backend.dispatch

    def spy(causal, traced, masks, name):
        def c(*a):
            taken.append("causal")
            return causal(*a)

        def t(*a):
            taken.append("traced")
            return traced(*a)

        return real(c, t, masks, name)

    monkeypatch.setattr(backend, "dispatch", spy)
    return taken
