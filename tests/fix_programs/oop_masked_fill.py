"""masked_fill_ on a saved softmax output."""
import torch
from torch import nn

torch.manual_seed(0)
model = nn.Linear(4, 5)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
mask = torch.arange(5) == 0
for _ in range(3):
    probs = model(torch.randn(8, 4)).softmax(-1)
    probs.masked_fill_(mask, 0.0)
    loss = -probs.max(-1).values.log().mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
