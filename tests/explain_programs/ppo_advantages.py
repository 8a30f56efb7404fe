"""PPO-style: advantages computed once from the critic, reused by every epoch."""
import torch
from torch import nn

torch.manual_seed(0)
actor = nn.Sequential(nn.Linear(4, 32), nn.Tanh(), nn.Linear(32, 2))
critic = nn.Sequential(nn.Linear(4, 32), nn.Tanh(), nn.Linear(32, 1))
opt = torch.optim.Adam(actor.parameters(), lr=3e-4)
obs, actions = torch.randn(64, 4), torch.randint(0, 2, (64,))
returns = torch.randn(64)
advantages = returns - critic(obs).squeeze(-1)
for _epoch in range(4):
    logp = actor(obs).log_softmax(-1).gather(1, actions[:, None]).squeeze(-1)
    loss = -(logp * advantages).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
