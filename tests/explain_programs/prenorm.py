"""A pre-norm transformer block that adds its residuals in place."""
import torch
from torch import nn


class Block(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.n1, self.n2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.ff = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))
        self.ff2 = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x):
        x = x + 0
        x += self.ff(self.n1(x))
        x += self.ff2(self.n2(x))
        return x


torch.manual_seed(0)
block = Block(8)
emb = nn.Embedding(10, 8)
tokens = torch.randint(0, 10, (2, 5))
out = block(emb(tokens))
loss = out.pow(2).mean()
loss.backward()
