"""The training math of the snapshot tests, shared by the worker and the tests' reference.

A small float64 model with an SGD-with-momentum optimizer. Each step's
global batch (``BATCH`` samples, drawn from a generator seeded by the step)
is split across ranks; each sample's gradient is rounded to a multiple of
2**-10, so the sum over any split and in any order is exact: the final
parameters depend only on which steps ran, exactly once each, not on the
world size or the reduction order. A run with a fault restored correctly
ends bitwise equal to :func:`reference`.
"""

from __future__ import annotations

import torch

BATCH = 12
SCALE = 2.0**10


def build() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 4, dtype=torch.float64)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    return model, opt


def samples(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    x = torch.randint(-4, 5, (BATCH, 8), generator=g).double()
    y = torch.randint(-4, 5, (BATCH, 4), generator=g).double()
    return x, y


def local_grads(model: torch.nn.Module, step: int, rank: int, world: int) -> list[torch.Tensor]:
    """Sum of this rank's per-sample gradients (each rounded: exact sums)."""
    x, y = samples(step)
    total = [torch.zeros_like(p) for p in model.parameters()]
    for i in range(rank, BATCH, world):
        model.zero_grad()
        loss = ((model(x[i]) - y[i]) ** 2).sum()
        loss.backward()
        for t, p in zip(total, model.parameters(), strict=False):
            t += torch.round(p.grad * SCALE) / SCALE
    return total


def apply(model: torch.nn.Module, opt: torch.optim.Optimizer, summed: list[torch.Tensor]) -> None:
    for p, g in zip(model.parameters(), summed, strict=False):
        p.grad = g / BATCH
    opt.step()


def reference(steps: int) -> list[str]:
    model, opt = build()
    for step in range(steps):
        apply(model, opt, local_grads(model, step, 0, 1))
    return fingerprint(model)


def fingerprint(model: torch.nn.Module) -> list[str]:
    """The parameters, bit for bit (float.hex)."""
    return [v.hex() for p in model.parameters() for v in p.detach().flatten().tolist()]
