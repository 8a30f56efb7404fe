"""The seed story: two losses from shared weights, a step between their backwards.

It fails on the second iteration only: zero_grad(set_to_none=False) leaves a zero
.grad on w3, so the first step of iteration 2 updates w3 after the forward saved it.
"""
import torch
from torch import nn


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.w1 = nn.Parameter(torch.tensor([2.0]))
        self.w2 = nn.Parameter(torch.tensor([3.0]))
        self.w3 = nn.Parameter(torch.tensor([4.0]))

    def forward(self, a):
        s = a * self.w1
        return s * self.w2, s * self.w3


torch.manual_seed(0)
model = Model()
optim = torch.optim.SGD(model.parameters(), lr=0.01)
mse = nn.MSELoss()
x, y1, y2 = torch.tensor([1.0]), torch.tensor([5.0]), torch.tensor([7.0])
for _ in range(3):
    y1_pred, y2_pred = model(x)
    optim.zero_grad(set_to_none=False)
    loss1 = mse(y1_pred, y1)
    loss1.backward(retain_graph=True)
    optim.step()
    optim.zero_grad(set_to_none=False)
    loss2 = mse(y2_pred, y2)
    loss2.backward()
    optim.step()
