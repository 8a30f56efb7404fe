"""A forward and its loss built once, before the epoch loop that back-propagates it."""
import torch
from torch import nn

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
crit = nn.MSELoss()
x, y = torch.randn(16, 4), torch.randn(16, 1)
out = model(x)
loss = crit(out, y)
for _epoch in range(3):
    opt.zero_grad()
    loss.backward()
    opt.step()
