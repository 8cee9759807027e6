"""Kernel layer: the ``nsa`` custom ops (``torch.ops.nsa.*``), their torch references, Triton kernels and aiter
dispatch. Importing this package registers the ops; Triton and aiter are imported only when a GPU path runs."""

from . import ops

__all__ = ["ops"]
