"""A compiled actor-critic: the critic steps before the actor's backward."""
import torch
from torch import nn


class ActorCritic(nn.Module):
    def __init__(self):
        super().__init__()
        self.trunk = nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh())
        self.actor = nn.Linear(16, 2)
        self.critic = nn.Linear(16, 1)

    def forward(self, obs):
        h = self.trunk(obs)
        return self.actor(h), self.critic(h)


torch.manual_seed(0)
net = ActorCritic()
cnet = torch.compile(net, backend="aot_eager")
critic_opt = torch.optim.SGD([*net.trunk.parameters(), *net.critic.parameters()], lr=1e-2)
obs, returns = torch.randn(8, 4), torch.randn(8, 1)
logits, value = cnet(obs)
critic_loss = (returns - value).pow(2).mean()
actor_loss = -logits.log_softmax(-1)[:, 0].mean()
critic_loss.backward(retain_graph=True)
critic_opt.step()
actor_loss.backward()
