"""Targets from a teacher network, computed once and reused by every step."""
import torch
from torch import nn

torch.manual_seed(0)
teacher = nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 3))
student = nn.Sequential(nn.Linear(4, 3))
opt = torch.optim.SGD(student.parameters(), lr=0.1)
x = torch.randn(32, 4)
soft_targets = teacher(x).softmax(-1)
for _step in range(3):
    loss = -(soft_targets * student(x).log_softmax(-1)).sum(-1).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
