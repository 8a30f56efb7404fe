"""WGAN's clipping through .data between the critic's forward and its backward: silent."""
import torch
from torch import nn

torch.manual_seed(0)
critic = nn.Sequential(nn.Linear(2, 16), nn.ReLU(), nn.Linear(16, 1))
opt = torch.optim.RMSprop(critic.parameters(), lr=5e-5)
for _ in range(3):
    out = critic(torch.randn(8, 2)).mean()
    for p in critic.parameters():
        p.data.clamp_(-0.01, 0.01)
    opt.zero_grad()
    out.backward()
    opt.step()
