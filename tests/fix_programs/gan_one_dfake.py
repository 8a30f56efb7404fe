"""A GAN whose one forward d_fake = D(fake) feeds both losses, made before opt_d.step()."""
import torch
from torch import nn

torch.manual_seed(0)
G = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 2))
D = nn.Sequential(nn.Linear(2, 16), nn.LeakyReLU(0.2), nn.Linear(16, 1))
opt_g = torch.optim.Adam(G.parameters(), lr=2e-4)
opt_d = torch.optim.Adam(D.parameters(), lr=2e-4)
bce = nn.BCEWithLogitsLoss()
ones, zeros = torch.ones(32, 1), torch.zeros(32, 1)
for _ in range(3):
    real, z = torch.randn(32, 2), torch.randn(32, 4)
    fake = G(z)
    d_real = D(real)
    d_fake = D(fake)
    d_loss = bce(d_real, ones) + bce(d_fake, zeros)
    g_loss = bce(d_fake, ones)  # the same D(fake) as d_loss
    opt_d.zero_grad()
    d_loss.backward(retain_graph=True)
    opt_d.step()
    opt_g.zero_grad()
    g_loss.backward()
    opt_g.step()
