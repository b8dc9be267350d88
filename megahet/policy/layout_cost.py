"""The layout planner's cost model: a GPT's parameters, memory and time per rank for a TP x PP x DP layout.

Role: policy (pure arithmetic; megahet/policy/layout_search.py evaluates layouts with it).

    shape = ModelShape.of(cfg.model, vocab_size=50257, tp=2)
    shape.rank_params(tp=2, layers=6, first=True, last=False)       # this rank's parameters
    rank_memory_bytes(shape, tp=2, layers=6, first=True, last=False, in_flight=4, dp=2,
                      micro_batch=4, zero_stage=1, precision="bf16")
    layer_seconds(shape, micro_batch=4, tp=2, tflops=312 * 0.45, intra_gbps=300, precision="bf16")

Parameters follow megatron-core's GPT (fused QKV with grouped-query attention, gated MLP for SwiGLU,
biases replicated on the row-parallel layers, norms replicated, the vocabulary padded for TP). Memory
is the ZeRO paper's per parameter (bf16: 2 weights + 2 gradients + 12 optimizer bytes: fp32 masters
and Adam's two moments; fp32: 4 + 4 + 12, as DeepSpeed keeps its fp32 partition apart from the
weights), the optimizer (and with ZeRO-2 the gradients) split over DP; plus the activations the backward keeps, counted tensor by tensor (flash attention:
no s x s scores), for the micro-batches a 1F1B stage holds in flight. Time is matmul FLOPs (3x the
forward: megahet.policy.flops) at the rank's rate, plus TP all-reduces (2 forward + 2 backward per
layer), pipeline sends, and the DP gradient reduction, each as bytes over the link's bandwidth (ring
all-reduce: 2 (n - 1) / n of the bytes). Rates and bandwidths are effective ones: a profiling run
calibrates them (benchmarks/plan_accuracy.py).
"""

from __future__ import annotations

import dataclasses

from megahet.policy.flops import output_layer_flops, transformer_layer_flops

ELEMENT_BYTES = {"bf16": 2, "fp32": 4}
STATE_BYTES = {"bf16": (2, 2, 12), "fp32": (4, 4, 12)}
"""Bytes per parameter: (weights, gradients, optimizer state) by the run's precision. The optimizer state
is DeepSpeed ZeRO's fp32 copy of its partition (kept even when training in fp32) and Adam's moments."""


@dataclasses.dataclass(frozen=True)
class ModelShape:
    layers: int
    hidden: int
    heads: int
    query_groups: int
    ffn: int
    seq: int
    vocab: int
    """The padded vocabulary (a multiple of make_vocab_size_divisible_by x TP)."""
    gated: bool = False
    bias: bool = True
    layer_norm: bool = True
    """LayerNorm (weight and bias) or RMSNorm (weight only)."""
    learned_positions: bool = True
    tied: bool = True

    @classmethod
    def of(cls, model, vocab_size: int, tp: int) -> ModelShape:
        """The shape of megahet's GPT for a ModelConfig and the tokenizer's vocabulary, padded for `tp`."""
        multiple = model.make_vocab_size_divisible_by * tp
        return cls(
            layers=model.num_layers, hidden=model.hidden_size, heads=model.num_attention_heads,
            query_groups=model.query_groups, ffn=model.ffn_size, seq=model.seq_length,
            vocab=-(-vocab_size // multiple) * multiple, gated=model.activation == "swiglu",
            bias=model.add_bias_linear, layer_norm=model.normalization == "LayerNorm",
            learned_positions=model.position_embedding_type == "learned_absolute",
            tied=not model.untie_embeddings_and_output_weights,
        )  # fmt: skip

    @property
    def kv(self) -> int:
        """Width of the keys (and of the values): hidden x query groups / heads."""
        return self.hidden * self.query_groups // self.heads

    def _norm(self) -> int:
        return self.hidden * (2 if self.layer_norm else 1)

    def split_layer_params(self, tp: int = 1) -> int:
        """One transformer layer's parameters that TP splits, on one of `tp` ranks: its work units' (the
        ones a TP plan resizes or migrates)."""
        h, qkv, up = self.hidden, self.hidden + 2 * self.kv, self.ffn * (2 if self.gated else 1)
        split = h * qkv + h * h + h * up + self.ffn * h  # QKV, projection, fc1 (gate and up), fc2
        if self.bias:
            split += qkv + up  # column-parallel biases are split; row-parallel ones are replicated
        return split // tp

    def layer_params(self, tp: int = 1) -> int:
        """One transformer layer's parameters on one of `tp` ranks."""
        replicated = 2 * self._norm() + (2 * self.hidden if self.bias else 0)
        return self.split_layer_params(tp) + replicated

    def rank_params(self, tp: int, layers: int, first: bool, last: bool, pp: int = 1) -> int:
        """A rank's parameters: its stage's `layers`, the embedding on the first stage, the final norm and
        the output layer on the last (a tied one is a copy there when PP > 1)."""
        params = layers * self.layer_params(tp)
        if first:
            params += self.vocab * self.hidden // tp + (
                self.seq * self.hidden if self.learned_positions else 0
            )
        if last:
            params += self._norm()
            if not self.tied or pp > 1:
                params += self.vocab * self.hidden // tp
        return params

    def layer_flops(self, tokens: int, causal: bool = True) -> float:
        """Forward matmul FLOPs of one layer over `tokens` tokens (causal: the attention kernel skips the
        masked half, as flash attention does; False: the full s x s, as megahet's FLOP counters count)."""
        per_token = transformer_layer_flops(
            self.hidden, self.ffn, self.seq, heads=self.heads, query_groups=self.query_groups,
            gated=self.gated, causal=causal,
        )  # fmt: skip
        return per_token * tokens

    def layer_activation_bytes(self, micro_batch: int, tp: int, precision: str) -> int:
        """What one layer keeps for its backward per micro-batch: the two norms' and the two blocks'
        inputs (replicated over TP), then per TP rank Q, K, V, the attention output, fc1's output and the
        activation's output (flash attention keeps no s x s scores; dropout off: no masks)."""
        e, tokens, h = ELEMENT_BYTES[precision], self.seq * micro_batch, self.hidden
        replicated = 4 * h
        split = (h + 2 * self.kv) + h + self.ffn * (2 if self.gated else 1) + self.ffn
        return e * tokens * (replicated + split // tp)


def rank_memory_bytes(
    shape: ModelShape,
    *,
    tp: int,
    layers: int,
    first: bool,
    last: bool,
    pp: int,
    dp: int,
    in_flight: int,
    micro_batch: int,
    zero_stage: int,
    precision: str,
) -> int:
    """A rank's training memory: weights, gradients and optimizer state (ZeRO-1: the optimizer split over
    DP; ZeRO-2: the gradients too), plus the activations of `in_flight` micro-batches (1F1B: stage s of
    PP holds min(PP - s, micro-batches)) and the last stage's logits (fp32, per TP rank)."""
    params = shape.rank_params(tp, layers, first, last, pp)
    weights, grads, optimizer = STATE_BYTES[precision]
    state = params * (weights + grads / (dp if zero_stage >= 2 else 1) + optimizer / dp)
    activations = in_flight * layers * shape.layer_activation_bytes(micro_batch, tp, precision)
    if last:
        activations += in_flight * 4 * shape.seq * micro_batch * shape.vocab // tp
    return int(state + activations)


def all_reduce_seconds(nbytes: float, ranks: int, gbps: float) -> float:
    """A ring all-reduce of `nbytes` over `ranks` ranks on links of `gbps` GB/s per direction."""
    return 0.0 if ranks <= 1 else 2 * (ranks - 1) / ranks * nbytes / (gbps * 1e9)


def layer_seconds(
    shape: ModelShape,
    *,
    micro_batch: int,
    tp: int,
    tflops: float,
    intra_gbps: float,
    precision: str,
    latency_s: float = 0.0,
) -> float:
    """One layer's forward + backward on one micro-batch, on a TP group of `tp` ranks of `tflops` each:
    its FLOPs (3x the forward) split over the group, and 4 all-reduces of the layer's activations (each
    `latency_s` plus its bytes over the link)."""
    tokens = shape.seq * micro_batch
    compute = 3 * shape.layer_flops(tokens) / (tp * tflops * 1e12)
    activation = ELEMENT_BYTES[precision] * tokens * shape.hidden
    return compute + (4 * (latency_s + all_reduce_seconds(activation, tp, intra_gbps)) if tp > 1 else 0.0)


def output_seconds(shape: ModelShape, *, micro_batch: int, tp: int, tflops: float) -> float:
    """The output layer's forward + backward on one micro-batch (the last stage's extra work)."""
    tokens = shape.seq * micro_batch
    return 3 * output_layer_flops(shape.hidden, shape.vocab) * tokens / (tp * tflops * 1e12)


def gradient_sync_seconds(params: int, dp: int, gbps: float, precision: str, latency_s: float = 0.0) -> float:
    """A stage's DP gradient reduction of `params` per rank (ZeRO-1/2: reduce-scatter of the gradients,
    all-gather of the updated weights: an all-reduce's volume) over `dp` replicas on links of `gbps`."""
    if dp == 1:
        return 0.0
    return latency_s + all_reduce_seconds(params * STATE_BYTES[precision][1], dp, gbps)


def send_seconds(
    shape: ModelShape, *, micro_batch: int, gbps: float, precision: str, latency_s: float = 0.0
) -> float:
    """Pipeline sends of one micro-batch across a stage boundary: the activation forward, its gradient
    backward (each `latency_s` plus its bytes over the link)."""
    return 2 * (latency_s + ELEMENT_BYTES[precision] * shape.seq * micro_batch * shape.hidden / (gbps * 1e9))


def one_f_one_b_seconds(stage_s: list[float], microbatches: int) -> float:
    """A 1F1B pipeline over stages of per-micro-batch times `stage_s` (forward + backward, sends
    included): the first micro-batch crosses every stage, the others follow at the slowest stage's pace."""
    return sum(stage_s) + (microbatches - 1) * max(stage_s)
