"""nn.Dropout(0.5, True) after a ReLU: dropout's in-place write breaks what relu saved."""
import torch
from torch import nn

torch.manual_seed(0)
clf = nn.Sequential(
    nn.Linear(8, 16),
    nn.ReLU(),
    nn.Dropout(0.5, True),
    nn.Linear(16, 2),
)
opt = torch.optim.Adam(clf.parameters(), lr=1e-3)
x, y = torch.randn(32, 8), torch.randint(0, 2, (32,))
for _ in range(3):
    loss = nn.functional.cross_entropy(clf(x), y)
    opt.zero_grad()
    loss.backward()
    opt.step()
