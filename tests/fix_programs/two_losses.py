"""Two losses of one forward, back-propagated one after the other, nothing between."""
import torch
from torch import nn

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for _ in range(3):
    out = model(torch.randn(8, 4))
    opt.zero_grad()
    out.pow(2).mean().backward()
    out.abs().mean().backward()
    opt.step()
