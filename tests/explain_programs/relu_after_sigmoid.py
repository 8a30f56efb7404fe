"""ReLU(inplace=True) in a Sequential, right after a Sigmoid."""
import torch
from torch import nn

torch.manual_seed(0)
net = nn.Sequential(
    nn.Linear(4, 8),
    nn.Sigmoid(),
    nn.ReLU(inplace=True),
    nn.Linear(8, 1),
)
loss = net(torch.randn(3, 4)).sum()
loss.backward()
