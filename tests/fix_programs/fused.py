"""A fused Adam steps between two backwards of one forward: no version bump, no error, wrong gradients."""
import torch
from torch import nn

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
opt = torch.optim.Adam(model.parameters(), lr=1e-3, fused=True)
for _ in range(3):
    out = model(torch.randn(8, 4))
    opt.zero_grad()
    out.pow(2).mean().backward(retain_graph=True)
    opt.step()
    out.abs().mean().backward()
    opt.step()
