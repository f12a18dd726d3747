"""A dense training state for crash tests: every chunk changes at every step, and the
state of any step can be rebuilt from its number alone (a restarted process checks it)."""

from __future__ import annotations

import torch

STATE_NUMEL = 1 << 20  # 4 MiB of fp32: the 1 MiB slack of the default budget cannot hide it


def state_at(step: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return {"w": torch.randn(STATE_NUMEL, generator=g), "step": torch.tensor(step)}
