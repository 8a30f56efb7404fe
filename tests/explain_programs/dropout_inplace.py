"""A classifier with Dropout(inplace=True) right after a ReLU."""
import torch
from torch import nn

torch.manual_seed(0)
clf = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Dropout(0.5, inplace=True), nn.Linear(16, 2))
opt = torch.optim.SGD(clf.parameters(), lr=0.1)
x, y = torch.randn(4, 8), torch.randint(0, 2, (4,))
loss = nn.functional.cross_entropy(clf(x), y)
loss.backward()
opt.step()
