"""Small deterministic models and training loops shared by engine tests."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn


class TinyGPT(nn.Module):
    """A two-layer causal transformer language model with a few thousand parameters."""

    def __init__(self, vocab: int = 32, dim: int = 32, layers: int = 2, ctx: int = 16):
        super().__init__()
        self.tok = nn.Embedding(vocab, dim)
        self.pos = nn.Parameter(torch.zeros(ctx, dim))
        layer = nn.TransformerEncoderLayer(dim, 2, 2 * dim, dropout=0.1, batch_first=True)
        self.blocks = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = nn.Linear(dim, vocab)
        self.ctx = ctx

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n = x.shape[1]
        mask = nn.Transformer.generate_square_subsequent_mask(n)
        h = self.tok(x) + self.pos[:n]
        return self.head(self.blocks(h, mask=mask, is_causal=True))


class Trainer:
    """Model, AdamW, a LR schedule, a seeded data order and RNG: everything to resume."""

    def __init__(self, seed: int = 0) -> None:
        torch.manual_seed(seed)
        self.model = TinyGPT()
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=3e-3, weight_decay=0.01)
        self.sched = torch.optim.lr_scheduler.CosineAnnealingLR(self.opt, T_max=50)
        self.data = torch.Generator().manual_seed(seed + 1)
        self.corpus = torch.randint(0, 32, (4096,), generator=torch.Generator().manual_seed(7))
        self.loader = {"epoch": 0, "position": 0}

    def state(self) -> dict[str, Any]:
        import tiercheck

        return {
            "model": self.model,
            "optim": self.opt,
            "sched": self.sched,
            "loader": self.loader,
            "data_rng": self.data.get_state(),
            "rng": tiercheck.rng_state(),
        }

    def after_restore(self, state: dict[str, Any]) -> None:
        import tiercheck

        self.loader = state["loader"]
        self.data.set_state(state["data_rng"])
        tiercheck.set_rng_state(state["rng"])

    def step(self) -> float:
        idx = torch.randint(0, len(self.corpus) - 17, (4,), generator=self.data)
        batch = torch.stack([self.corpus[i : i + 17] for i in idx.tolist()])
        self.loader["position"] += 4
        logits = self.model(batch[:, :-1])
        loss = nn.functional.cross_entropy(logits.reshape(-1, 32), batch[:, 1:].reshape(-1))
        self.opt.zero_grad()
        loss.backward()
        self.opt.step()
        self.sched.step()
        return float(loss.detach())


def snapshot(trainer: Trainer) -> dict[str, torch.Tensor]:
    """Every tensor of the trainer's model and optimizer state, cloned, by name."""
    return snapshot_of(trainer.model, trainer.opt)


def snapshot_of(model: nn.Module, opt: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """Every tensor of ``model``'s and ``opt``'s state, cloned, by name."""
    out = {f"model/{k}": v.detach().clone() for k, v in model.state_dict().items()}
    for pid, st in opt.state_dict()["state"].items():
        for k, v in st.items():
            if isinstance(v, torch.Tensor):
                out[f"optim/{pid}/{k}"] = v.clone()
    return out


def assert_bit_identical(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].dtype == b[k].dtype and a[k].shape == b[k].shape, k
        assert torch.equal(a[k].view(-1).view(torch.uint8), b[k].view(-1).view(torch.uint8)), k
