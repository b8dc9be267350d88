"""ViT classifier built from megatron-core's TransformerBlock, so its linears are megatron-core TP layers.

Role: models.

Patches -> linear embedding -> [CLS] + learned positions -> TransformerBlock (bidirectional) ->
final LayerNorm -> linear head on the [CLS] token. Pipeline stages follow megatron-core's
convention: `pre_process` owns the embedding, `post_process` the head.

    model = build_vit(cfg)                        # after initialize_parallel
    logits = model(images)                        # (b, c, H, W) -> (b, num_classes) on the last stage
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from megatron.core import parallel_state as ps
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.enums import AttnMaskType, ModelType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import TransformerBlock

from megahet.config import MegahetConfig, ModelConfig
from megahet.models.common import (
    default_layer_spec,
    initializes,
    mark_tensor_parallel_weights,
    transformer_config,
)


class ViTClassifier(MegatronModule):
    def __init__(
        self,
        config: TransformerConfig,
        model_cfg: ModelConfig,
        layer_spec: ModuleSpec,
        pre_process: bool = True,
        post_process: bool = True,
    ):
        super().__init__(config=config)
        self.model_type = ModelType.encoder_or_decoder
        self.pre_process, self.post_process = pre_process, post_process
        self.patch_size = model_cfg.patch_size
        self.num_patches = (model_cfg.image_size // model_cfg.patch_size) ** 2
        h, std = config.hidden_size, config.init_method_std
        initialize = initializes(config)  # false: the weights are loaded right after the build
        linear = (
            torch.nn.Linear
            if initialize
            else lambda *shape: torch.nn.utils.skip_init(torch.nn.Linear, *shape)
        )
        if pre_process:
            patch_dim = model_cfg.in_channels * model_cfg.patch_size**2
            self.patch_embedding = linear(patch_dim, h)
            self.cls_token = torch.nn.Parameter(torch.zeros(1, 1, h))
            positions = (
                torch.randn(self.num_patches + 1, h) * std
                if initialize
                else torch.empty(self.num_patches + 1, h)
            )
            self.position_embeddings = torch.nn.Parameter(positions)
        self.decoder = TransformerBlock(
            config, layer_spec, pre_process=pre_process, post_process=post_process
        )
        if post_process:
            self.head = linear(h, model_cfg.num_classes)

    @property
    def seq_length(self) -> int:
        return self.num_patches + 1

    def set_input_tensor(self, input_tensor) -> None:
        """Called by megatron-core's pipeline schedule with the previous stage's activations."""
        if isinstance(input_tensor, list):
            input_tensor = input_tensor[0]
        self.decoder.set_input_tensor(input_tensor)

    def embed(self, images: torch.Tensor) -> torch.Tensor:
        b, c, _height, _width = images.shape
        p = self.patch_size
        patches = images.unfold(2, p, p).unfold(3, p, p)  # (b, c, H/p, W/p, p, p)
        patches = patches.permute(0, 2, 3, 1, 4, 5).reshape(b, self.num_patches, c * p * p)
        x = self.patch_embedding(patches.to(self.patch_embedding.weight.dtype))  # (b, n, h)
        x = torch.cat([self.cls_token.expand(b, -1, -1), x], dim=1) + self.position_embeddings  # (b, n+1, h)
        return x.transpose(0, 1).contiguous()  # (s, b, h), megatron-core's layout

    def forward(self, images: torch.Tensor | None) -> torch.Tensor:
        hidden = self.embed(images) if self.pre_process else None
        hidden = self.decoder(hidden_states=hidden, attention_mask=None)  # (s, b, h)
        if not self.post_process:
            return hidden
        return self.head(hidden[0])  # [CLS] token -> (b, num_classes)


def build_vit(
    cfg: MegahetConfig,
    layer_spec: ModuleSpec | None = None,
    split: Sequence[int] | None = None,
    initialize: bool = True,
) -> ViTClassifier:
    """The ViT stage of this rank (pre/post-process from its pipeline position); `initialize` false: its
    weights are left uninitialized, to be loaded (pass `not layout.weights_loaded`)."""
    model = ViTClassifier(
        transformer_config(cfg, split, initialize),
        cfg.model,
        layer_spec or default_layer_spec(cfg, AttnMaskType.no_mask),
        pre_process=ps.is_pipeline_first_stage(),
        post_process=ps.is_pipeline_last_stage(),
    )
    if not initialize:
        mark_tensor_parallel_weights(model)
    return model
