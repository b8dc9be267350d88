"""Models: GPT and ViT on megatron-core, built from ModuleSpecs. Role: models."""
