"""Recurrent state carried across iterations without detach (truncated BPTT is the fix)."""
import torch
from torch import nn

torch.manual_seed(0)
cell = nn.GRUCell(4, 8)
head = nn.Linear(8, 1)
opt = torch.optim.SGD([*cell.parameters(), *head.parameters()], lr=0.1)
hidden = torch.zeros(2, 8)
for _step in range(4):
    hidden = cell(torch.randn(2, 4), hidden)
    loss = head(hidden).pow(2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
