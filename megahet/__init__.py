"""megahet: heterogeneity-aware 3D-parallel transformer pretraining on megatron-core + DeepSpeed ZeRO.

Role: the package (its import sets the process-wide defaults megatron-core and DeepSpeed need).
"""

import os
import warnings

import torch

__version__ = "0.1.0"

if not torch.cuda.is_available():
    # DeepSpeed picks its accelerator at import time; say "cpu" rather than let it guess and warn.
    os.environ.setdefault("DS_ACCELERATOR", "cpu")

# apex and Transformer Engine are optional speed-ups; megatron-core warns once per module without them.
warnings.filterwarnings("ignore", message=r".*(Apex|Transformer Engine).*not installed")
