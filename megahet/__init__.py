"""megahet: heterogeneity-aware 3D-parallel pretraining on megatron-core + DeepSpeed ZeRO."""
__version__ = "0.1.0"
