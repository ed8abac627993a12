"""Fused Triton kernels registered as ``torch.ops.fxfuse.*`` custom ops.

Each kernel module registers its op when imported (a pattern's lowering imports it on first use,
so importing fxfuse loads no Triton). Each op runs its Triton kernels on CUDA tensors and
on CPU tensors when ``TRITON_INTERPRET=1`` (tests); otherwise CPU tensors take the PyTorch
reference path at the bottom of each kernel file.
"""
