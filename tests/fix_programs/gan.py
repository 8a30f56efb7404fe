"""A GAN whose discriminator loss takes fake = G(z) without detach()."""
# ruff: noqa: E702  (the program joins statements with ";" on purpose)
import torch
from torch import nn

torch.manual_seed(0)
G = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 2))
D = nn.Sequential(nn.Linear(2, 16), nn.LeakyReLU(0.2), nn.Linear(16, 1))
og = torch.optim.Adam(G.parameters(), lr=2e-4)
od = torch.optim.Adam(D.parameters(), lr=2e-4)
bce = nn.BCEWithLogitsLoss()
ones, zeros = torch.ones(32, 1), torch.zeros(32, 1)
for _ in range(3):
    real, z = torch.randn(32, 2), torch.randn(32, 4)
    fake = G(z)
    d_loss = bce(D(real), ones) + bce(D(fake), zeros)
    od.zero_grad(); d_loss.backward(); od.step()
    g_loss = bce(D(fake), ones)
    og.zero_grad(); g_loss.backward(); og.step()
