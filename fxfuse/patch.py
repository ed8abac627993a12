"""``fxfuse.patch(model)``: fuse any model in one call, in place (the Liger-style entry point, without
model-specific code).

``patch`` compiles ``model`` in place (``nn.Module.compile``, which sets ``model._compiled_call_impl``
and leaves the module, its class, its parameters and its ``state_dict`` keys untouched) with a small
backend that runs the fxfuse backend and keeps the report of every graph compiled for *this*
model. ``fxfuse.patch_report(model)`` merges them. Compilation is lazy: the reports exist after the
first forward.

Why in place rather than ``torch.compile(model)``: trainers (HF Trainer, TRL), PEFT, DDP and FSDP2
take and return the module object itself; an ``OptimizedModule`` wrapper renames every
``state_dict`` key (``_orig_mod.``) and hides the model's attributes from code that inspects them.
In-place compile also composes with wrapping afterwards (``DDP(fxfuse.patch(model))``,
``fully_shard`` after patching): DDP's graph splitting (Dynamo's DDPOptimizer) and FSDP2's
parameter hooks apply to the patched module as to any compiled one.

A deep copy of a patched model is not patched (torch drops ``_compiled_call_impl`` when copying a
module; the copied patch state still names the original as its owner, so ``patch_report`` refuses
it and ``patch(copy)`` compiles it anew).
"""
from __future__ import annotations

import weakref

import torch
import torch.nn as nn

from . import backend as _backend
from .options import Options
from .report import Report

COMPILE_KWARGS = ("dynamic", "fullgraph", "mode")


class _PatchState:
    """What ``patch`` left on a model: the options it compiled with, the model it belongs to (a weak
    reference: a deep copy keeps pointing at the original, so it is not taken for patched) and the
    reports of its graphs."""

    def __init__(self, model: nn.Module, key: tuple, compiled_call):
        self.owner = weakref.ref(model)
        self.key = key
        self.compiled_call = compiled_call
        self.reports: list[Report] = []


def _reporting_backend(reports: list[Report], options: dict, mode: str | None):
    """A Dynamo backend: the fxfuse backend, plus the reports it produced appended to ``reports``.
    Under DDP, Dynamo calls it once per bucket subgraph; each graph gets its own report.

    The compile runs under ``fork_rng``: tracing the patterns the first time draws example tensors
    from the global CPU generator (fxfuse/pattern.py), which would otherwise shift the user's random
    stream (a Trainer's data order, dropout masks) and make a patched run differ from an eager one."""

    def fxfuse_patched(gm, example_inputs):
        n0 = len(_backend._REPORTS)
        try:
            with torch.random.fork_rng(devices=[]):
                return _backend.fxfuse_backend(gm, example_inputs, options=options, mode=mode)
        finally:
            reports.extend(r for _, r in _backend._REPORTS[n0:])

    return fxfuse_patched


def _check_compilable(model) -> None:
    if isinstance(model, torch._dynamo.eval_frame.OptimizedModule):
        raise TypeError("fxfuse.patch: got the wrapper torch.compile returned; pass the module itself "
                        "(model._orig_mod), which patch compiles in place")
    if not isinstance(model, nn.Module):
        kind = type(model).__name__
        raise TypeError(f"fxfuse.patch: expected a torch.nn.Module, got {kind}; for a function use "
                        "torch.compile(fn, backend='fxfuse')")
    if isinstance(model, torch.jit.ScriptModule):
        raise TypeError("fxfuse.patch: a TorchScript module cannot be compiled by torch.compile; "
                        "patch the eager nn.Module it was scripted from")
    if not torch._dynamo.is_dynamo_supported():
        raise RuntimeError("fxfuse.patch: torch.compile is not supported on this platform / Python "
                           "version (torch._dynamo.is_dynamo_supported() is False)")
    compiled = getattr(model, "_compiled_call_impl", None)
    state = model.__dict__.get("_fxfuse_patch")
    if compiled is not None and (state is None or state.owner() is not model or state.compiled_call is not compiled):
        raise ValueError("fxfuse.patch: this module was already compiled in place with another backend "
                         "(module.compile(...)); set module._compiled_call_impl = None first to replace it")


def patch(model: nn.Module, *, dynamic: bool | None = None, fullgraph: bool = False, mode: str | None = None,
          **options) -> nn.Module:
    """Compile ``model`` in place with the fxfuse backend and return it (the same object).

    options: the backend's options (``inner``, ``patterns``, ``debug_dir``, ``inductor_config``),
    validated now; ``dynamic``, ``fullgraph`` and ``mode`` go to ``torch.compile``. Calling patch
    again with the same arguments does nothing; with other arguments the model is compiled anew
    with them (its report list starts empty). Raises TypeError / ValueError / RuntimeError at once
    on a model that cannot be compiled (not an ``nn.Module``, a ``torch.compile`` wrapper, a
    TorchScript module, compiled in place with another backend, Dynamo unsupported here) or on an
    unknown option.
    """
    opts = Options.parse(options)  # unknown option / pattern: error now, not at the first forward
    _check_compilable(model)
    key = (opts.inner, opts.patterns, opts.debug_dir, tuple(sorted(opts.inductor_config.items())),
           dynamic, fullgraph, mode)
    state = model.__dict__.get("_fxfuse_patch")
    if state is not None and state.owner() is model and state.key == key \
            and model._compiled_call_impl is state.compiled_call:
        return model
    reports: list[Report] = []
    model._compiled_call_impl = None
    model.compile(backend=_reporting_backend(reports, dict(options), mode), dynamic=dynamic, fullgraph=fullgraph)
    state = _PatchState(model, key, model._compiled_call_impl)
    state.reports = reports
    model.__dict__["_fxfuse_patch"] = state
    return model


def is_patched(model: nn.Module) -> bool:
    state = getattr(model, "__dict__", {}).get("_fxfuse_patch")
    return state is not None and state.owner() is model and model._compiled_call_impl is state.compiled_call


def patch_report(model: nn.Module) -> Report:
    """All sites fused (and not fused) in the graphs compiled for a patched ``model`` so far, merged
    (one graph per Dynamo frame; several under DDP bucket splitting or graph breaks). Empty before
    the first forward; ``ValueError`` if ``model`` was not patched."""
    if not is_patched(model):
        raise ValueError("fxfuse.patch_report: this module was not patched with fxfuse.patch(model)")
    return Report.merge(model.__dict__["_fxfuse_patch"].reports)
