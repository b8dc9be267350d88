"""Data: the shipped corpora and MNIST, tokenizer, indexed GPT data, per-DP-rank sampling. Role: data."""
