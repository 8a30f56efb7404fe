"""A saved non-leaf input still held by a variable, written in place after it was saved."""
import torch

torch.manual_seed(0)
w = torch.randn(4, 4, requires_grad=True)
x = torch.randn(3, 4)
a = x @ w
b = a * a
a += 1
loss = b.sum()
loss.backward()
