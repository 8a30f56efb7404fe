"""An actor and a critic on a shared trunk: the actor's optimizer trains the trunk and steps before the critic's backward."""
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
actor_opt = torch.optim.Adam([*net.trunk.parameters(), *net.actor.parameters()], lr=1e-3)
critic_opt = torch.optim.Adam(net.critic.parameters(), lr=1e-3)
for _ in range(3):
    obs, actions, returns = torch.randn(8, 4), torch.randint(0, 2, (8,)), torch.randn(8, 1)
    logits, value = net(obs)
    advantage = (returns - value).detach()
    actor_loss = -(logits.log_softmax(-1).gather(1, actions[:, None]) * advantage).mean()
    critic_loss = (returns - value).pow(2).mean()
    actor_opt.zero_grad()
    actor_loss.backward(retain_graph=True)
    actor_opt.step()  # changes trunk.* in place
    critic_opt.zero_grad()
    critic_loss.backward()
    critic_opt.step()
