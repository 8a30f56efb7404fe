"""Evaluating with EMA weights swapped in between the forward and the backward."""
import copy

import torch
from torch import nn


def evaluate_with_ema(model, ema):
    backup = [p.detach().clone() for p in model.parameters()]
    with torch.no_grad():
        for p, q in zip(model.parameters(), ema.parameters()):
            p.copy_(q)
        model(torch.randn(2, 4))
        for p, b in zip(model.parameters(), backup):
            p.copy_(b)


torch.manual_seed(0)
model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
ema = copy.deepcopy(model)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for _ in range(3):
    loss = model(torch.randn(8, 4)).pow(2).mean()
    evaluate_with_ema(model, ema)
    opt.zero_grad()
    loss.backward()
    opt.step()
    with torch.no_grad():
        for e, p in zip(ema.parameters(), model.parameters()):
            e.lerp_(p, 0.1)
