"""An actor and a critic on a shared trunk, two optimizers: the critic steps before the actor's backward."""
import torch
from torch import nn


class ActorCritic(nn.Module):
    def __init__(self):
        super().__init__()
        self.trunk = nn.Sequential(nn.Linear(4, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh())
        self.actor = nn.Linear(32, 2)
        self.critic = nn.Linear(32, 1)

    def forward(self, obs):
        h = self.trunk(obs)
        return self.actor(h), self.critic(h)


torch.manual_seed(0)
net = ActorCritic()
critic_opt = torch.optim.SGD([*net.trunk.parameters(), *net.critic.parameters()], lr=1e-2)
actor_opt = torch.optim.SGD(net.actor.parameters(), lr=1e-2)
for _ in range(3):
    obs, actions, returns = torch.randn(8, 4), torch.randint(0, 2, (8,)), torch.randn(8, 1)
    logits, value = net(obs)
    advantage = (returns - value).detach()
    critic_loss = (returns - value).pow(2).mean()
    actor_loss = -(logits.log_softmax(-1).gather(1, actions[:, None]) * advantage).mean()
    critic_opt.zero_grad()
    critic_loss.backward(retain_graph=True)
    critic_opt.step()  # changes trunk.* in place
    actor_opt.zero_grad()
    actor_loss.backward()
    actor_opt.step()
