"""A running loss total, never reset, back-propagated every iteration."""
import torch
from torch import nn

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
crit = nn.MSELoss()
total = 0
for _ in range(3):
    x, y = torch.randn(16, 4), torch.randn(16, 1)
    loss = crit(model(x), y)
    total = total + loss
    opt.zero_grad()
    total.backward()
    opt.step()
print(total)
