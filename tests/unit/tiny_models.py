"""Config overrides of the tiny models the single-process model tests build (not a test module).

TINY_GPT: 2 layers, hidden 32, 4 heads, MLP 64, no padding of the vocabulary (add model.seq_length);
LLAMA: on top of it, the Llama family's shape (rotary positions, RMSNorm, SwiGLU, 2 key/value heads,
untied output layer, no linear biases). Imported by test_attention.py, test_device_placement.py and
test_packed_documents.py.
"""

TINY_GPT = {
    "model.num_layers": 2,
    "model.hidden_size": 32,
    "model.num_attention_heads": 4,
    "model.ffn_hidden_size": 64,
    "model.make_vocab_size_divisible_by": 1,
}

LLAMA = {
    "model.position_embedding_type": "rope",
    "model.normalization": "RMSNorm",
    "model.activation": "swiglu",
    "model.num_query_groups": 2,
    "model.add_bias_linear": False,
    "model.untie_embeddings_and_output_weights": True,
}
