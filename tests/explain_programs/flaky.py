"""Not deterministic: the replay finds a marker file and takes another branch."""
import os

import torch

first = not os.path.exists("marker")
open("marker", "w").close()
torch.manual_seed(0)
x = torch.randn(3, 4, requires_grad=True)
a = x.sigmoid()
b = x.tanh()
(a if first else b).mul_(2)
loss = (a * b).sum()
loss.backward()
