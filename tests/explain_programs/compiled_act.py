"""The output of a compiled block, changed in place before the backward."""
import torch
from torch import nn


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        return torch.tanh(self.fc(x))


torch.manual_seed(0)
block = torch.compile(Block(), backend="aot_eager")
out = block(torch.randn(3, 4))
out.mul_(2)
loss = out.sum()
loss.backward()
