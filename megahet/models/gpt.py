"""GPT: megatron-core's GPTModel, GPT-2-shaped (learned positions, LayerNorm, GELU, tied embeddings) or
Llama-shaped (rotary positions, RMSNorm, SwiGLU, grouped-query attention, untied embeddings) by model config.

Role: models.

model = build_gpt(cfg, vocab_size=8192)    # this rank's pipeline stage, after initialize_parallel

`PlacedGPTModel` is megatron-core's GPTModel that also runs micro-batches placed over the CP ranks by a
dynamic plan (megahet/models/cp_placed.py): a rank's tokens are pieces of documents, so its rotary embedding
takes each token's own position (`PlacedDocuments.positions`) instead of a contiguous range.
"""

from __future__ import annotations

from collections.abc import Sequence

from megatron.core import parallel_state as ps
from megatron.core.models.gpt import GPTModel
from megatron.core.transformer.spec_utils import ModuleSpec

from megahet.config import MegahetConfig
from megahet.models.common import default_layer_spec, mark_tensor_parallel_weights, transformer_config


class PlacedGPTModel(GPTModel):
    """GPTModel whose rotary embedding follows per-token positions when the packed parameters carry them."""

    def _preprocess(self, input_ids, position_ids, decoder_input=None, inference_context=None,
                    packed_seq_params=None, padding_mask=None):  # fmt: skip
        out = super()._preprocess(
            input_ids, position_ids, decoder_input, inference_context, packed_seq_params, padding_mask
        )
        positions = getattr(packed_seq_params, "positions", None)
        if positions is None or self.position_embedding_type != "rope" or out[1] is None:
            return out
        freqs = self.rotary_pos_emb.get_emb(packed_seq_params.max_seqlen_q)  # (n, 1, 1, dim), n > positions
        return (out[0], freqs.index_select(0, positions), *out[2:])  # (t, 1, 1, dim): the rank's tokens


def padded_vocab_size(vocab_size: int, divisible_by: int, tp: int) -> int:
    """Pad the vocabulary so each TP shard of the embedding has the same size, as Megatron does."""
    multiple = divisible_by * tp
    return -(-vocab_size // multiple) * multiple


def build_gpt(
    cfg: MegahetConfig,
    vocab_size: int,
    layer_spec: ModuleSpec | None = None,
    split: Sequence[int] | None = None,
    initialize: bool = True,
) -> GPTModel:
    """The GPT stage of this rank (pre/post-process from its pipeline position); `initialize` false: its
    weights are left uninitialized, to be loaded (pass `not layout.weights_loaded`)."""
    m = cfg.model
    placed = cfg.parallel.cp > 1 and cfg.parallel.cp_placement == "dynamic"
    model = (PlacedGPTModel if placed else GPTModel)(
        config=transformer_config(cfg, split, initialize),
        transformer_layer_spec=layer_spec or default_layer_spec(cfg),
        vocab_size=padded_vocab_size(vocab_size, m.make_vocab_size_divisible_by, cfg.parallel.tp),
        max_sequence_length=m.seq_length,
        pre_process=ps.is_pipeline_first_stage(),
        post_process=ps.is_pipeline_last_stage(),
        share_embeddings_and_output_weights=not m.untie_embeddings_and_output_weights,
        position_embedding_type=m.position_embedding_type,
        rotary_base=m.rotary_base,
    )
    if not initialize:
        mark_tensor_parallel_weights(model)
    return model
