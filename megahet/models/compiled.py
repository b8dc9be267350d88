"""The compiled path (issue 48): `torch.compile` of each transformer layer's forward, as torchtitan
compiles each block, so that a layer's elementwise work fuses and Python launches fewer kernels.

Role: setup (megahet/training.py applies it to the task's model before the engine wraps it).

    python pretrain_gpt.py --train.compile true ...
    compile_layers(model)        # the number of layers compiled

Only `forward` is compiled, not the module call: the hooks registered on a layer (the balancer's clock,
the pipeline balancer's timing) stay eager, outside the graph, so they read the host clock around the
compiled work and not inside a trace. megatron-core's TP collectives are autograd functions around
torch.distributed calls: the graph breaks around them. A resizable layer's plan (its kept rows, guest
weights) is read by its forward: a new plan is a new guard and the layer recompiles for it (shapes that
change again are then compiled dynamic, once).
"""

from __future__ import annotations

import torch
from megatron.core.transformer.transformer_layer import TransformerLayer


def compile_layers(model: torch.nn.Module) -> int:
    """Compile the forward of every megatron-core TransformerLayer in `model`; the number compiled."""
    # The resizable layers count the FLOPs they execute in int attributes (the balancer's measured work).
    # dynamo specializes on a module's int attributes by default: every step's new count would be a new
    # guard, a recompile, and after 8 the eager fallback. Unspecialized, the count is a symbolic int
    # updated as a side effect of the compiled graph, with no guard on its value.
    torch._dynamo.config.allow_unspec_int_on_nn_module = True
    # The layers share their classes' forward code, and dynamo's recompile limit counts per code object:
    # with each layer's own plan (its kept and guest rows) the variants add up over the layers. Weights
    # whose shapes differ are compiled dynamic after the first variant, and the limit grows with depth.
    torch._dynamo.config.force_parameter_static_shapes = False
    layers = [m for m in model.modules() if isinstance(m, TransformerLayer)]
    limit = torch._dynamo.config.recompile_limit
    torch._dynamo.config.recompile_limit = max(limit, 4 * len(layers))
    for layer in layers:
        layer.forward = torch.compile(layer.forward)
    return len(layers)
