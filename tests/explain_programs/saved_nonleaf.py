"""A saved non-leaf input, written in place inside a helper after it was saved."""
import torch


def features(x):
    a = x * 2
    b = a.sin()
    a.add_(1)
    return b


torch.manual_seed(0)
x = torch.randn(3, 4, requires_grad=True)
loss = features(x).sum()
loss.backward()
