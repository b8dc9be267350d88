"""The compiled path (issue 48): `torch.compile` of each transformer layer's forward, as torchtitan
compiles each block, so that a layer's elementwise work fuses and Python launches fewer kernels.

Role: setup (megahet/training.py applies it to the task's model before the engine wraps it).

    python pretrain_gpt.py --train.compile true ...
    compile_layers(model)        # the number of layers compiled

Only `forward` is compiled, not the module call: the hooks registered on a layer (the balancer's clock,
the pipeline balancer's timing) stay eager, outside the graph, so they read the host clock around the
compiled work and not inside a trace. megatron-core's TP collectives are autograd functions around
torch.distributed calls: the graph breaks around them. A resizable layer's plan (its kept rows, guest
weights) is read by its forward: a new plan is a new guard and the layer recompiles once for it.
"""

from __future__ import annotations

import torch
from megatron.core.transformer.transformer_layer import TransformerLayer


def compile_layers(model: torch.nn.Module) -> int:
    """Compile the forward of every megatron-core TransformerLayer in `model`; the number compiled."""
    layers = [m for m in model.modules() if isinstance(m, TransformerLayer)]
    for layer in layers:
        layer.forward = torch.compile(layer.forward, dynamic=False)
    return len(layers)
