"""Attention scores masked in place after softmax saved them."""
import torch
from torch import nn


class Attention(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.q, self.k = nn.Linear(d, d), nn.Linear(d, d)

    def forward(self, x, mask):
        scores = (self.q(x) @ self.k(x).transpose(-1, -2)).softmax(-1)
        scores[mask] = 0.0
        return scores @ x


torch.manual_seed(0)
attn = Attention(8)
x = torch.randn(2, 5, 8)
mask = torch.rand(2, 5, 5) > 0.8
loss = attn(x, mask).sum()
loss.backward()
