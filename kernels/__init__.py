"""Fused Triton kernels registered as ``torch.ops.fxfuse.*`` custom ops.

Each kernel module registers its op when imported (a pattern's lowering imports it on first use,
so importing fxfuse loads no Triton). Each op runs its Triton kernels on CUDA tensors and
on CPU tensors when ``TRITON_INTERPRET=1`` (tests); otherwise CPU tensors take the PyTorch
reference path at the bottom of each kernel file.
"""

if __name__ == "kernels":  # this folder imported under its own name: a checkout's root is on sys.path
    def _installed_kernels() -> None:
        """The source tree's ``kernels/`` folder (installed as ``fxfuse.kernels``) shadows the
        Hugging Face ``kernels`` package, which transformers >= 5.25 depends on and imports,
        whenever the checkout's root is on sys.path (pytest, ``python -m`` from the root). Put the
        installed package in this module's place when there is one; without it nothing changes."""
        import importlib.machinery
        import importlib.util
        import os
        import sys

        here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        path = [p for p in sys.path if os.path.abspath(p or os.curdir) != here]
        spec = importlib.machinery.PathFinder.find_spec("kernels", path)
        if spec is None or spec.loader is None:
            return
        module = importlib.util.module_from_spec(spec)
        sys.modules["kernels"] = module  # the import statement returns what sys.modules holds
        spec.loader.exec_module(module)

    _installed_kernels()
