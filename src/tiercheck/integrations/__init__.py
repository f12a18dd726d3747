"""tiercheck under training frameworks.

- :mod:`tiercheck.integrations.lightning`: a PyTorch Lightning ``CheckpointIO``
  (``pip install "tiercheck[lightning]"``);
- :mod:`tiercheck.integrations.hf`: exact resume for ``transformers.Trainer``
  (``pip install "tiercheck[hf]"``).

For ``torch.distributed.checkpoint`` users, :mod:`tiercheck.integrations.dcp` has a
``StorageWriter`` and a ``StorageReader``. Each module imports its framework; this package
imports nothing.
"""

from tiercheck.integrations._pointer import Pointer, read_pointer, write_pointer

__all__ = ["Pointer", "read_pointer", "write_pointer"]
