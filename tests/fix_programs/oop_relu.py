"""`t.relu_()` on the output of exp, which exp saved."""
import torch
from torch import nn

torch.manual_seed(0)
model = nn.Linear(4, 4)
opt = torch.optim.SGD(model.parameters(), lr=0.01)
for _ in range(3):
    t = torch.exp(model(torch.randn(8, 4)) - 1)
    t.relu_()
    loss = t.mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
