"""A language model whose GRU state (a tensor) carries the previous batch's graph into the next."""
import torch
from torch import nn
from torch.nn import functional as F

VOCAB = 16


class LM(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, 8)
        self.gru = nn.GRU(8, 8, batch_first=True)
        self.head = nn.Linear(8, VOCAB)

    def forward(self, x, state):
        out, state = self.gru(self.emb(x), state)
        return self.head(out), state


torch.manual_seed(0)
model = LM()
opt = torch.optim.SGD(model.parameters(), lr=0.1)
tokens = torch.randint(0, VOCAB, (2, 25))
state = None
for i in range(3):
    x, y = tokens[:, i * 8:i * 8 + 8], tokens[:, i * 8 + 1:i * 8 + 9]
    logits, state = model(x, state)
    loss = F.cross_entropy(logits.reshape(-1, VOCAB), y.reshape(-1))
    opt.zero_grad()
    loss.backward()
    opt.step()
