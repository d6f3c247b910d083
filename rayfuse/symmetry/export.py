"""The graph of a model ``torch.fx`` cannot trace, from ``torch.export`` (non-strict).

Hugging Face models branch on their inputs and configuration in ways symbolic tracing does not follow (a
``BertForSequenceClassification`` stops in its embeddings; transformers 5 no longer ships its own fx tracer).
``torch.export`` in non-strict mode runs the model's Python as is on fake tensors and records the ATen ops it calls,
so the graph it returns is the computation for inputs of the example's shape. :func:`export_graph` returns that
graph as a ``torch.fx.GraphModule`` whose parameters are ``get_attr`` nodes named by their state-dict keys, which
:func:`rayfuse.symmetry.derive_spec` analyses like a traced one (ATen ops under the names of the torch functions
they implement; anything it does not model exactly, such as ``scaled_dot_product_attention``, fixes the units it
touches, with the reason).
"""

from __future__ import annotations

import contextlib
import io
import logging

import torch
import torch.fx
from torch import nn

from rayfuse.errors import InputError

__all__ = ["export_graph"]


def export_graph(model: nn.Module, example_input: torch.Tensor, untraceable: InputError | None = None) -> torch.fx.GraphModule:
    """``model``'s graph for ``example_input`` from ``torch.export.export(..., strict=False)``, in eval mode (the
    model's modes are restored). The graph's own input guards are dropped (they check the input's shape and compute
    nothing the analysis reads).

    Raises
    ------
    InputError
        ``input`` when the model does not run on ``example_input``; ``architecture`` when it runs but cannot be
        exported either (naming both failures when ``untraceable``, the error from ``torch.fx``, is given).
    """
    modes = [(m, m.training) for m in model.modules()]
    model.eval()
    try:
        try:  # an input the model refuses is the input's fault, not the export's: said as such
            with torch.no_grad():
                model(example_input)
        except Exception as exc:
            message = (str(exc).strip().splitlines() or [""])[0][:160]
            raise InputError(
                "input", "an example batch the model accepts", f"shape {tuple(example_input.shape)}", f"{type(exc).__name__}: {message}"
            ) from None
        quiet = logging.root.manager.disable
        logging.disable(logging.WARNING)  # export logs its guards and failures as warnings; the error below says it in one line
        try:
            # export prints the graph it had when it fails; the error below says what failed in one line
            with torch.no_grad(), contextlib.redirect_stderr(io.StringIO()), contextlib.redirect_stdout(io.StringIO()):
                program = torch.export.export(model, (example_input,), strict=False)
        except Exception as exc:  # export raises from anywhere in the user's code: one line naming both attempts
            message = (str(exc).strip().splitlines() or [""])[0][:120]
            got = untraceable.got if untraceable is not None and untraceable.got is not InputError._MISSING else type(model).__name__
            fx_reason = f"torch.fx: {untraceable.hint}; " if untraceable is not None and untraceable.hint else ""
            raise InputError(
                "architecture",
                "a model torch.fx can trace or torch.export can export",
                got,
                f"{fx_reason}torch.export: {type(exc).__name__}: {message}",
            ) from None
        finally:
            logging.disable(quiet)
    finally:  # the model's modes as they were, whatever happened
        for m, training in modes:
            m.training = training
    gm = program.module()
    assert isinstance(gm, torch.fx.GraphModule)
    for node in list(gm.graph.nodes):
        if node.op == "call_module" and str(node.target) == "_guards_fn" and not node.users:
            gm.graph.erase_node(node)
    gm.recompile()
    return gm
