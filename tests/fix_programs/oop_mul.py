"""An in-place method on a saved activation: sigmoid saved y, y.mul_(2) changes it."""
import torch
from torch import nn

torch.manual_seed(0)
model = nn.Linear(4, 4)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for _ in range(3):
    x = torch.randn(8, 4)
    y = torch.sigmoid(model(x))
    y.mul_(2)  # sigmoid saved y for its backward
    loss = y.pow(2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
