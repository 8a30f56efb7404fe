"""A boolean-mask write and masked_fill_ after a softmax."""
import torch
from torch import nn

torch.manual_seed(0)
model = nn.Linear(4, 5)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
mask = torch.zeros(8, 5, dtype=torch.bool)
mask[:, 0] = True
for _ in range(3):
    probs = model(torch.randn(8, 4)).softmax(-1)
    probs[mask] = 0.0
    loss = -probs.max(-1).values.log().mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
