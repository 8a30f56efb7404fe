"""Two losses of one forward, backpropagated one after the other, no step between."""
import torch
from torch import nn

torch.manual_seed(0)
net = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
opt = torch.optim.SGD(net.parameters(), lr=0.1)
x, y = torch.randn(16, 4), torch.randn(16, 1)
out = net(x)
mse = (out - y).pow(2).mean()
mse.backward()
l1 = (out - y).abs().mean()
l1.backward()
opt.step()
