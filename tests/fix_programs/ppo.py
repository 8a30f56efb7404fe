"""PPO-style epochs over advantages computed once, before the loop, from the critic."""
import torch
from torch import nn

torch.manual_seed(0)
actor, critic = nn.Linear(4, 2), nn.Linear(4, 1)
opt = torch.optim.Adam(actor.parameters(), lr=1e-3)
obs, actions, returns = torch.randn(16, 4), torch.randint(0, 2, (16,)), torch.randn(16, 1)
values = critic(obs)
adv = returns - values
for _ in range(3):
    logp = actor(obs).log_softmax(-1).gather(1, actions[:, None])
    loss = -(logp * adv).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
