"""One forward, then a backward and a step for each chunk of it: the second chunk's backward needs the weights the first step changed."""
import torch
from torch import nn

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.05)
for _ in range(2):
    x, y = torch.randn(12, 4), torch.randn(12, 1)
    out = model(x)
    for oc, yc in zip(out.split(4), y.split(4)):
        loss = (oc - yc).pow(2).mean()
        opt.zero_grad()
        loss.backward(retain_graph=True)
        opt.step()
