"""An RNN whose hidden state carries the previous step's graph into the next step."""
import torch

torch.manual_seed(0)
rnn = torch.nn.RNNCell(4, 4)
opt = torch.optim.SGD(rnn.parameters(), lr=0.1)
h = torch.zeros(1, 4)
for _ in range(4):
    h = rnn(torch.randn(1, 4), h)
    loss = h.pow(2).sum()
    loss.backward()
    opt.step()
    opt.zero_grad()
