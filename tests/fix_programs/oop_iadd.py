"""`+=` on a saved output: tanh saved h."""
import torch
from torch import nn

torch.manual_seed(0)
model = nn.Linear(4, 4)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for _ in range(3):
    x = torch.randn(8, 4)
    skip = torch.randn(8, 4)
    h = torch.tanh(model(x))
    h += skip * 0.5  # residual, in place
    loss = h.pow(2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
