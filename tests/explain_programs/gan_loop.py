"""The same GAN mistake inside a training loop: it fails in the first iteration."""
import torch
from torch import nn

torch.manual_seed(0)
gen = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 2))
disc = nn.Sequential(nn.Linear(2, 32), nn.Tanh(), nn.Linear(32, 1))
opt_g = torch.optim.SGD(gen.parameters(), lr=0.01)
opt_d = torch.optim.SGD(disc.parameters(), lr=0.01)
for _ in range(3):
    real = torch.randn(16, 2)
    noise = torch.randn(16, 8)
    samples = gen(noise)
    loss_d = disc(samples).mean() - disc(real).mean()
    opt_d.zero_grad()
    loss_d.backward()
    opt_d.step()
    loss_g = -disc(samples).mean()
    opt_g.zero_grad()
    loss_g.backward()
    opt_g.step()
