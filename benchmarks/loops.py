"""Overhead of versionwatch on small-model loops: a DQN and an actor-critic (A2C) loop.

A third loop, ``tiny``, is the tiny MLP of ``overhead.py`` (50 x Linear(32, 32)
+ Tanh, batch 4, SGD with momentum), every step a training step.

Reinforcement-learning loops run tiny networks for hours, and most of their
calls are forwards under ``torch.no_grad()`` (acting), so a fixed cost per
call dominates. Both loops are written here, with a fake environment made of
tensor ops, so that no RL library is needed:

  dqn  Q-net 4 -> 64 -> 64 -> 2 (ReLU). Every step: one acting forward under
       ``no_grad`` and a write to a replay buffer; every 4th step: a batch of
       32 from the buffer, the target net's forward under ``no_grad``, the
       Q-net's forward, smooth L1 loss, ``zero_grad``, ``backward``, Adam's
       ``step``; every 250 steps the target net copies the Q-net.
  a2c  Stable-Baselines3-style actor-critic: a shared 4 -> 64 -> 64 body with a
       policy head (2 actions) and a value head. Rollouts of 5 steps over 8
       environments, each step one forward under ``no_grad``; then one forward
       of the 40 states with grad, policy + value + entropy loss,
       ``zero_grad``, ``backward``, gradient clipping, RMSprop's ``step``.

Configurations, each run over the same blocks of steps, interleaved (every
round runs one block per configuration, rotating who goes first), torch on
one thread:

  unwatched   the plain loop
  watch       ``versionwatch.watch(qnet, opt)`` open for the block
  watch_all   ``versionwatch.watch_all()`` open for the block (what
              ``versionwatch run`` and ``pytest --versionwatch`` use); the
              networks exist before it opens, so they are adopted at their
              first call, as in a script
  strict      ``versionwatch.watch(qnet, opt, strict=True)``
  strict_fingerprint  the same with ``fingerprint=True`` (docs/strict.md)
  watch_python  ``watch`` with the native helper (docs/native.md) set aside for
              the block: the pure-Python default mode, in the same run
  predict_only  a watcher of an unrelated module: every backward of the loop is
              predicted and the process-wide hooks run, but the loop's model
              and optimizer are not watched (no events, no ledger): the floor
              of the default mode, what exact prediction alone costs

The ratio is the median, over rounds, of each round's block time against the
same round's unwatched block time (with its interquartile range).

Usage:
  python benchmarks/loops.py                        # both loops
  python benchmarks/loops.py --loops dqn --repeats 30
  python benchmarks/loops.py --loops dqn,a2c,tiny --clock cpu   # CPU time: a shared machine
  python benchmarks/loops.py --quick                # smoke run: seconds, numbers meaningless
"""

from __future__ import annotations

import argparse
import contextlib
import os
import platform
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

import torch
from torch import nn

try:
    import versionwatch
except ImportError:  # running from a checkout without an install
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
    import versionwatch

try:
    # the optional native helper, where this version has it
    from versionwatch._native import loader as _native
except ImportError:
    _native = None  # type: ignore[assignment]
try:
    from versionwatch import _native_state  # what the predictor reads: the helper, or None
except ImportError:  # a version whose predictor does not use the helper
    _native_state = None  # type: ignore[assignment]


def mlp(sizes: list[int]) -> nn.Sequential:
    layers: list[nn.Module] = []
    for i, (a, b) in enumerate(zip(sizes, sizes[1:])):
        layers.append(nn.Linear(a, b))
        if i < len(sizes) - 2:
            layers.append(nn.ReLU())
    return nn.Sequential(*layers)


class Env:
    """A fake vectorised environment: a few tensor ops per step, deterministic."""

    def __init__(self, n: int, seed: int) -> None:
        self.g = torch.Generator().manual_seed(seed)
        self.n = n
        self.state = torch.randn(n, 4, generator=self.g)

    def step(self, action: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        self.state = 0.9 * self.state + 0.1 * torch.randn(self.n, 4, generator=self.g)
        reward = (action.float() - 0.5) * self.state[:, 0]
        done = self.state[:, 1] > 1.5
        return self.state, reward, done


@dataclass
class Loop:
    """A loop's networks, optimizer, and a callable that runs ``n`` env steps."""

    name: str
    model: nn.Module
    opt: torch.optim.Optimizer
    run: Callable[[int], None]
    block: int  # env steps per block


def dqn() -> Loop:
    torch.manual_seed(0)
    qnet, target = mlp([4, 64, 64, 2]), mlp([4, 64, 64, 2])
    target.load_state_dict(qnet.state_dict())
    opt = torch.optim.Adam(qnet.parameters(), lr=1e-3)
    env = Env(1, seed=1)
    size = 10_000
    states = torch.zeros(size, 4)
    actions = torch.zeros(size, dtype=torch.long)
    rewards = torch.zeros(size)
    nexts = torch.zeros(size, 4)
    dones = torch.zeros(size)
    pick = torch.Generator().manual_seed(2)
    t = [0]
    obs = [env.state.clone()]

    def run(n: int) -> None:
        for _ in range(n):
            k = t[0]
            with torch.no_grad():
                action = qnet(obs[0]).argmax(1)
            nxt, reward, done = env.step(action)
            i = k % size
            states[i] = obs[0][0]
            actions[i] = action[0]
            rewards[i] = reward[0]
            nexts[i] = nxt[0]
            dones[i] = done[0].float()
            obs[0] = nxt
            if k % 4 == 3:
                idx = torch.randint(0, min(k + 1, size), (32,), generator=pick)
                with torch.no_grad():
                    best = target(nexts[idx]).max(1).values
                    y = rewards[idx] + 0.99 * best * (1 - dones[idx])
                q = qnet(states[idx]).gather(1, actions[idx].unsqueeze(1)).squeeze(1)
                loss = nn.functional.smooth_l1_loss(q, y)
                opt.zero_grad()
                loss.backward()
                opt.step()
            if k % 250 == 249:
                target.load_state_dict(qnet.state_dict())
            t[0] = k + 1

    return Loop("DQN: Q-net 4-64-64-2, act under no_grad every step, train every 4th "
                "(batch 32, target net, Adam)", qnet, opt, run, block=100)


class ActorCritic(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = mlp([4, 64, 64])
        self.act = nn.ReLU()
        self.pi = nn.Linear(64, 2)
        self.v = nn.Linear(64, 1)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.act(self.body(x))
        return self.pi(h), self.v(h).squeeze(-1)


def a2c() -> Loop:
    torch.manual_seed(0)
    net = ActorCritic()
    opt = torch.optim.RMSprop(net.parameters(), lr=7e-4, alpha=0.99, eps=1e-5)
    envs, n_steps = 8, 5
    env = Env(envs, seed=3)
    pick = torch.Generator().manual_seed(4)
    obs = [env.state.clone()]

    def run(n: int) -> None:
        for _ in range(n):
            states, acts, rews, dones = [], [], [], []
            for _ in range(n_steps):
                with torch.no_grad():
                    logits, _ = net(obs[0])
                    action = torch.multinomial(logits.softmax(-1), 1, generator=pick).squeeze(1)
                nxt, reward, done = env.step(action)
                states.append(obs[0])
                acts.append(action)
                rews.append(reward)
                dones.append(done.float())
                obs[0] = nxt
            with torch.no_grad():
                _, last = net(obs[0])
            returns, ret = [], last
            for r, d in zip(reversed(rews), reversed(dones)):
                ret = r + 0.99 * ret * (1 - d)
                returns.append(ret)
            returns.reverse()
            logits, values = net(torch.cat(states))
            dist = torch.distributions.Categorical(logits=logits)
            adv = torch.cat(returns) - values
            loss = (-(dist.log_prob(torch.cat(acts)) * adv.detach()).mean()
                    + 0.5 * adv.pow(2).mean() - 0.01 * dist.entropy().mean())
            opt.zero_grad()
            loss.backward()
            nn.utils.clip_grad_norm_(net.parameters(), 0.5)
            opt.step()

    return Loop("A2C (SB3-style): shared 4-64-64 body, policy and value heads, 8 envs x "
                "5-step rollouts under no_grad, RMSprop, grad clipping", net, opt, run, block=20)


def tiny() -> Loop:
    """The tiny MLP of ``overhead.py`` (a), as a loop: every step trains."""
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(50):
        layers += [nn.Linear(32, 32), nn.Tanh()]
    model = nn.Sequential(*layers)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
    x, y = torch.randn(4, 32), torch.randn(4, 32)

    def run(n: int) -> None:
        for _ in range(n):
            opt.zero_grad()
            nn.functional.mse_loss(model(x), y).backward()
            opt.step()

    return Loop("tiny MLP: 50 x Linear(32,32)+Tanh, batch 4, SGD(momentum), every step trains",
                model, opt, run, block=10)


LOOPS: dict[str, Callable[[], Loop]] = {"dqn": dqn, "a2c": a2c, "tiny": tiny}


@contextlib.contextmanager
def python_only(watcher: contextlib.AbstractContextManager[object]) -> Iterator[object]:
    """``watcher`` with the native helper set aside (where this versionwatch has one)."""
    native = _native_state
    saved = getattr(native, "CURRENT", None)
    if native is not None:
        native.CURRENT = None
    try:
        with watcher as w:
            yield w
    finally:
        if native is not None:
            native.CURRENT = saved

Config = tuple[str, Callable[[Loop], contextlib.AbstractContextManager[object]]]
CONFIGS: list[Config] = [
    ("unwatched", lambda loop: contextlib.nullcontext()),
    ("watch", lambda loop: versionwatch.watch({"model": loop.model}, loop.opt)),
    # The same, in pure Python: the native helper (docs/native.md) set aside.
    ("watch_python",
     lambda loop: python_only(versionwatch.watch({"model": loop.model}, loop.opt))),
    ("watch_all", lambda loop: versionwatch.watch_all()),
    ("strict", lambda loop: versionwatch.watch({"model": loop.model}, loop.opt, strict=True)),
    ("strict_fingerprint", lambda loop: versionwatch.watch({"model": loop.model}, loop.opt,
                                                           strict=True, fingerprint=True)),
    # The floor of the default mode: a watcher of an unrelated module is open,
    # so every backward of the loop is still predicted (exactly) and the
    # process-wide hooks run, but nothing of the loop's model is watched.
    ("predict_only", lambda loop: versionwatch.watch({"other": nn.Conv1d(1, 1, 1)})),
]


def measure(loop: Loop, configs: list[Config], repeats: int, block: int,
            warmup: int, clock: Callable[[], float] = time.perf_counter) -> dict[str, list[float]]:
    """Per configuration, the block time of each round (seconds)."""
    for _, make in configs:
        with make(loop):
            loop.run(warmup)
    times: dict[str, list[float]] = {name: [] for name, _ in configs}
    for r in range(repeats):
        k = r % len(configs)
        for name, make in configs[k:] + configs[:k]:
            with make(loop):
                t0 = clock()
                loop.run(block)
                times[name].append(clock() - t0)
    return times


def table(times: dict[str, list[float]], block: int) -> str:
    base = times["unwatched"]
    lines = ["| configuration | median block (ms) | µs per env step | ratio to unwatched (IQR) |",
             "|---|---:|---:|---:|"]
    for name, ts in times.items():
        ratios = [t / b for t, b in zip(ts, base)]
        q = statistics.quantiles(ratios, n=4) if len(ratios) >= 2 else [ratios[0]] * 3
        med = statistics.median(ts)
        lines.append(f"| {name} | {med * 1e3:.2f} | {med / block * 1e6:.1f} | "
                     f"{statistics.median(ratios):.3f}x ({q[0]:.3f} - {q[2]:.3f}) |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--loops", default="dqn,a2c", help="comma-separated: dqn, a2c, tiny")
    p.add_argument("--configs", help="comma-separated subset (unwatched always runs)")
    p.add_argument("--repeats", type=int, default=30, help="rounds of interleaved blocks")
    p.add_argument("--block", type=int, help="env steps per block (dqn 100, a2c 20 updates)")
    p.add_argument("--warmup", type=int, default=200, help="untimed steps per configuration")
    p.add_argument("--quick", action="store_true", help="smoke run: numbers meaningless")
    p.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                   help="cpu: this thread's CPU time (time.thread_time), steadier than the "
                        "wall clock on a shared machine; torch runs on this thread")
    args = p.parse_args(argv)
    keys = [k.strip() for k in args.loops.split(",") if k.strip()]
    unknown = [k for k in keys if k not in LOOPS]
    if unknown or not keys:
        p.error(f"unknown loop(s) {unknown}; choose from {', '.join(LOOPS)}")
    configs = CONFIGS
    if args.configs:
        wanted = {c.strip() for c in args.configs.split(",")} | {"unwatched"}
        bad = wanted - {c[0] for c in CONFIGS}
        if bad:
            p.error(f"unknown configuration(s) {sorted(bad)}")
        configs = [c for c in CONFIGS if c[0] in wanted]
    torch.set_num_threads(1)
    clock = time.thread_time if args.clock == "cpu" else time.perf_counter
    status = "none in this version"
    if _native is not None:
        _native.native()  # decided before the first block, not inside it
        status = _native.status() + ("" if _native_state is not None
                                     else " (not used by this version's predictor)")
    print(f"torch {torch.__version__}, versionwatch {versionwatch.__version__}, "
          f"Python {platform.python_version()}, load average {os.getloadavg()[0]:.2f}, "
          f"clock {args.clock}")
    print(f"native helper: {status}")
    for key in keys:
        loop = LOOPS[key]()
        block = args.block or (4 if args.quick else loop.block)
        repeats = 2 if args.quick else args.repeats
        warmup = 4 if args.quick else args.warmup
        t0 = time.perf_counter()
        times = measure(loop, configs, repeats, block, warmup, clock)
        print(f"\n### {loop.name}\n")
        print(f"{repeats} rounds x {block} steps per configuration; "
              f"{time.perf_counter() - t0:.0f} s\n")
        print(table(times, block))
    return 0


if __name__ == "__main__":
    sys.exit(main())
