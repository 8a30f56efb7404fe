"""A verified patch trains as the program's author meant (issue #32).

``versionwatch fix`` compares what every ``optimizer.step()`` of a candidate
applies (which losses fed each parameter's gradient, and its values) with the
program run as its author assumed: each backward seeing what its forward saved.
Each test here runs ``fix()`` for real on a program where a plausible patch
trains something else, and checks that it is rejected with its reason, in the
program's own names; then applies the verified patch and compares what each of
its optimizer steps applied (tests/fix_steps.py, a plain run) with a
hand-written reference of what the author meant.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from versionwatch._fix.command import FixResult, apply_patch, fix
from versionwatch._fix.server import ForkServer

HERE = Path(__file__).resolve().parent
PROGRAMS = HERE / "fix_programs"


@pytest.fixture(scope="module")
def server() -> Iterator[ForkServer]:
    s = ForkServer()
    yield s
    s.close()


def run_fix(tmp_path: Path, server: ForkServer, name: str, text: str) -> tuple[FixResult, Path]:
    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    here = os.getcwd()
    os.chdir(tmp_path)
    try:
        return fix([name], check_steps=3, timeout=120, jobs=2, server=server), path
    finally:
        os.chdir(here)


def why(result: FixResult, family: str) -> str:
    hits = [c for c in result.candidates if c.family == family]
    assert hits, [(c.family, c.verified, c.why) for c in result.candidates]
    assert not hits[0].verified, hits[0].why
    return hits[0].why


def applied_steps(result: FixResult, path: Path, tmp_path: Path) -> dict[str, Any]:
    """Apply the first verified patch to ``path``, run it plainly, return its steps."""
    assert result.verified, [(c.family, c.why) for c in result.candidates]
    here = os.getcwd()
    os.chdir(path.parent)
    try:
        assert apply_patch(result.verified[0]) is None
    finally:
        os.chdir(here)
    out = tmp_path / "steps.pt"
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    subprocess.run([sys.executable, str(HERE / "fix_steps.py"), str(out), str(path)],
                   cwd=path.parent, env=env, check=True, timeout=300)
    found: dict[str, Any] = torch.load(out, weights_only=True)
    return found


def assert_steps(steps: list[dict[str, Any]], reference: list[tuple[str, dict[str, Any]]],
                 exact: set[str] = frozenset()) -> None:  # type: ignore[assignment]
    """Every step: the same optimizer, the same parameters, the reference's gradients."""
    assert [s["optimizer"] for s in steps] == [opt for opt, _ in reference]
    for k, (step, (_, grads)) in enumerate(zip(steps, reference)):
        assert set(step["grads"]) == set(grads), k
        for name, want in grads.items():
            got = step["grads"][name]
            if want is None:
                assert got is None or not got.any(), (k, name)
                continue
            assert got is not None, (k, name)
            if name in exact:
                assert torch.equal(got, want), (k, name)
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7, msg=f"step {k} {name}")


# -- a GAN whose two losses share one D(fake) -----------------------------------------------

GAN = '''\
import torch
from torch import nn

torch.manual_seed(0)
G = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 2))
D = nn.Sequential(nn.Linear(2, 16), nn.LeakyReLU(0.2), nn.Linear(16, 1))
opt_g = torch.optim.Adam(G.parameters(), lr=2e-4)
opt_d = torch.optim.Adam(D.parameters(), lr=2e-4)
bce = nn.BCEWithLogitsLoss()
ones, zeros = torch.ones(32, 1), torch.zeros(32, 1)
for _ in range(3):
    real, z = torch.randn(32, 2), torch.randn(32, 4)
    fake = G(z)
    d_real = D(real)
    d_fake = D(fake)
    d_loss = bce(d_real, ones) + bce(d_fake, zeros)
    g_loss = bce(d_fake, ones)
    opt_d.zero_grad()
    d_loss.backward(retain_graph=True)
    opt_d.step()
    opt_g.zero_grad()
    g_loss.backward()
    opt_g.step()
'''


def gan_reference() -> list[tuple[str, dict[str, Any]]]:
    """The GAN as meant: D's step applies d_loss's gradient only (on the fake G made,
    not back into G); G's step applies g_loss's, through D as it is after its step."""
    torch.manual_seed(0)
    G = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 2))
    D = nn.Sequential(nn.Linear(2, 16), nn.LeakyReLU(0.2), nn.Linear(16, 1))
    opt_g = torch.optim.Adam(G.parameters(), lr=2e-4)
    opt_d = torch.optim.Adam(D.parameters(), lr=2e-4)
    bce = nn.BCEWithLogitsLoss()
    ones, zeros = torch.ones(32, 1), torch.zeros(32, 1)
    out: list[tuple[str, dict[str, Any]]] = []
    for _ in range(3):
        real, z = torch.randn(32, 2), torch.randn(32, 4)
        fake = G(z)
        d_loss = bce(D(real), ones) + bce(D(fake.detach()), zeros)
        grads = torch.autograd.grad(d_loss, list(D.parameters()))
        out.append(("opt_d", {f"D.{n}": g for (n, _), g in zip(D.named_parameters(), grads)}))
        for p, g in zip(D.parameters(), grads):
            p.grad = g
        opt_d.step()
        g_loss = bce(D(fake), ones)
        grads = torch.autograd.grad(g_loss, list(G.parameters()))
        out.append(("opt_g", {f"G.{n}": g for (n, _), g in zip(G.named_parameters(), grads)}))
        for p, g in zip(G.parameters(), grads):
            p.grad = g
        opt_g.step()
    return out


def test_gan_one_d_fake_rejects_the_step_moved_and_the_sum(tmp_path: Path,
                                                            server: ForkServer) -> None:
    result, path = run_fix(tmp_path, server, "gan.py", GAN)
    assert result.status == "checked"
    # D's step after g_loss.backward(): it would push D to call fakes real.
    assert why(result, "move_step") == "`opt_d.step()` would also apply `g_loss`'s gradient to `D`"
    assert why(result, "sum_losses") == "`opt_d.step()` would also apply `g_loss`'s gradient to `D`"
    assert not any(c.family in ("move_step", "sum_losses") for c in result.verified)
    chosen = result.verified[0]
    assert chosen.family == "refresh", [(c.family, c.why) for c in result.candidates]
    assert "differ from the program's, as they must" in chosen.why, chosen.why
    found = applied_steps(result, path, tmp_path)
    assert_steps(found["steps"], gan_reference())


# -- an actor-critic on a shared trunk --------------------------------------------------------

def actor_critic_reference() -> list[tuple[str, dict[str, Any]]]:
    """tests/fix_programs/actor_critic.py as meant: the critic's step applies the critic
    loss's gradient to the trunk and the critic head; the actor's, the actor loss's
    gradient to the actor head, from the forward's own values."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("ac_models", PROGRAMS / "actor_critic.py")
    assert spec is not None
    source = (PROGRAMS / "actor_critic.py").read_text(encoding="utf-8")
    scope: dict[str, Any] = {}
    exec(compile(source.split("torch.manual_seed(0)")[0], "actor_critic.py", "exec"), scope)
    torch.manual_seed(0)
    net = scope["ActorCritic"]()
    critic_params = [*net.trunk.parameters(), *net.critic.parameters()]
    critic_names = [f"net.trunk.{n}" for n, _ in net.trunk.named_parameters()] + [
        f"net.critic.{n}" for n, _ in net.critic.named_parameters()]
    critic_opt = torch.optim.SGD(critic_params, lr=1e-2)
    actor_opt = torch.optim.SGD(net.actor.parameters(), lr=1e-2)
    out: list[tuple[str, dict[str, Any]]] = []
    for _ in range(3):
        obs, actions, returns = torch.randn(8, 4), torch.randint(0, 2, (8,)), torch.randn(8, 1)
        logits, value = net(obs)
        advantage = (returns - value).detach()
        critic_loss = (returns - value).pow(2).mean()
        actor_loss = -(logits.log_softmax(-1).gather(1, actions[:, None]) * advantage).mean()
        actor_grads = torch.autograd.grad(actor_loss, list(net.actor.parameters()),
                                          retain_graph=True)
        grads = torch.autograd.grad(critic_loss, critic_params)
        out.append(("critic_opt", dict(zip(critic_names, grads))))
        for p, g in zip(critic_params, grads):
            p.grad = g
        critic_opt.step()
        out.append(("actor_opt", {f"net.actor.{n}": g for (n, _), g in
                                  zip(net.actor.named_parameters(), actor_grads)}))
        for p, g in zip(net.actor.parameters(), actor_grads):
            p.grad = g
        actor_opt.step()
    return out


def test_actor_critic_rejects_the_step_that_would_train_the_trunk_with_the_actor(
        tmp_path: Path, server: ForkServer) -> None:
    text = (PROGRAMS / "actor_critic.py").read_text(encoding="utf-8")
    result, path = run_fix(tmp_path, server, "actor_critic.py", text)
    said = "`critic_opt.step()` would also apply `actor_loss`'s gradient to `net.trunk`"
    assert why(result, "move_step") == said
    assert why(result, "sum_losses") == said
    chosen = result.verified[0]
    assert chosen.family not in ("move_step", "sum_losses")
    found = applied_steps(result, path, tmp_path)
    assert_steps(found["steps"], actor_critic_reference())


# -- two steps merged into one --------------------------------------------------------------

SEED = (PROGRAMS / "seed_story.py").read_text(encoding="utf-8")


def seed_reference(momentum: float) -> dict[str, torch.Tensor]:
    """The seed story as meant: two steps per iteration, loss2's gradient taken on the
    weights its forward used; the parameters at the end."""
    w = {"w1": torch.tensor([2.0]), "w2": torch.tensor([3.0]), "w3": torch.tensor([4.0])}
    params = {k: nn.Parameter(v) for k, v in w.items()}
    opt = torch.optim.SGD(params.values(), lr=0.01, momentum=momentum)
    x, y1, y2 = torch.tensor([1.0]), torch.tensor([5.0]), torch.tensor([7.0])
    for it in range(3):
        saved = {k: p.detach().clone() for k, p in params.items()}
        s = x * params["w1"]
        loss1 = nn.functional.mse_loss(s * params["w2"], y1)
        opt.zero_grad(set_to_none=False)
        loss1.backward()
        opt.step()
        opt.zero_grad(set_to_none=False)
        w1, w3 = (saved[k].requires_grad_() for k in ("w1", "w3"))
        loss2 = nn.functional.mse_loss(x * w1 * w3, y2)
        g1, g3 = torch.autograd.grad(loss2, [w1, w3])
        params["w1"].grad, params["w3"].grad = g1, g3
        if it == 0:  # the first iteration's w3 had no .grad before loss2: set_to_none=False
            pass
        opt.step()
    return {f"model.{k}": p.detach() for k, p in params.items()}


def test_seed_story_one_step_of_the_summed_gradients_is_verified_for_plain_sgd(
        tmp_path: Path, server: ForkServer) -> None:
    assert "SGD(model.parameters(), lr=0.01)" in SEED
    result, path = run_fix(tmp_path, server, "seed_story.py", SEED)
    chosen = result.verified[0]
    assert chosen.family == "move_step"
    assert "the steps it merges into one leave the parameters as the program's two did" \
        in chosen.why, chosen.why
    found = applied_steps(result, path, tmp_path)
    want = seed_reference(momentum=0.0)
    for name, value in want.items():
        torch.testing.assert_close(found["final"][name], value, rtol=1e-5, atol=1e-6)


def test_merging_two_momentum_steps_is_rejected(tmp_path: Path, server: ForkServer) -> None:
    text = SEED.replace("lr=0.01)", "lr=0.01, momentum=0.9)")
    result, _ = run_fix(tmp_path, server, "seed_story.py", text)
    said = ("it changes the training: one `optim.step()` of the summed gradients instead of "
            "two, and the parameters after it differ from the program's")
    assert why(result, "move_step").startswith(said)
    assert why(result, "sum_losses").startswith(said)
    assert not any(c.family in ("move_step", "sum_losses") for c in result.verified)


# -- every run from the same files, none of them the user's ------------------------------------

SIDE_EFFECTS = '''\
import os
import torch
from torch import nn

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
start = 0
if os.path.exists("ckpt.pt"):  # resume
    state = torch.load("ckpt.pt")
    model.load_state_dict(state["model"])
    start = state["step"]
if os.path.exists("data/old.txt"):
    os.remove("data/old.txt")
for step in range(start, start + 3):
    out = model(torch.randn(8, 4))
    opt.zero_grad()
    out.pow(2).mean().backward(retain_graph=True)
    opt.step()
    opt.zero_grad()
    out.abs().mean().backward()
    opt.step()
    with open("log.txt", "a") as f:
        f.write(f"step {step}\\n")
    torch.save({"model": model.state_dict(), "step": step + 1}, "ckpt.pt")
'''


def listing(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*"))
            if p.is_file()}


def scratch_folders() -> set[str]:
    import tempfile

    return {p.name for p in Path(tempfile.gettempdir()).glob("versionwatch-fix-*")}



def test_check_runs_never_touch_the_users_folder(tmp_path: Path, server: ForkServer,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """Each run starts from a copy of the folder as it was: the checkpoint the program
    resumes from, the log it appends to and the file it deletes stay as they were."""
    import tempfile

    from versionwatch._fix.command import main as fix_main

    # Its own temporary folder: what other processes make in /tmp is theirs.
    (tmp_path / ".tmp").mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / ".tmp"))
    tmp_path = tmp_path / "project"
    tmp_path.mkdir()

    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "old.txt").write_text("keep\n", encoding="utf-8")
    (tmp_path / "log.txt").write_text("step 0\n", encoding="utf-8")
    (tmp_path / "train.py").write_text(SIDE_EFFECTS, encoding="utf-8")
    before = listing(tmp_path)
    temps = scratch_folders()
    here = os.getcwd()
    os.chdir(tmp_path)
    try:
        assert fix_main(["train.py"], server=server) == 1
        assert listing(tmp_path) == before
        assert fix_main(["--apply", "train.py"], server=server) == 0
    finally:
        os.chdir(here)
    after = listing(tmp_path)
    assert set(after) == set(before)
    assert {k for k in before if after[k] != before[k]} == {"train.py"}
    patched = after["train.py"].decode().splitlines()
    assert "    opt.zero_grad()" in patched and patched.count("    opt.step()") == 1
    assert not scratch_folders() - temps  # no run's copy left behind


def test_a_folder_too_big_to_copy_for_each_run_needs_in_place(
        tmp_path: Path, server: ForkServer, capsys: pytest.CaptureFixture[str]) -> None:
    from versionwatch._fix.command import main as fix_main
    from versionwatch._fix.workspace import LIMIT_BYTES

    (tmp_path / "train.py").write_text(SIDE_EFFECTS, encoding="utf-8")
    with open(tmp_path / "dataset.bin", "wb") as f:
        f.truncate(LIMIT_BYTES + 1)  # sparse: big to copy, nothing on disk
    here = os.getcwd()
    os.chdir(tmp_path)
    try:
        assert fix_main(["train.py"], server=server) == 2
        err = capsys.readouterr().err
        assert err.startswith("versionwatch fix: error: the working folder holds over 256 MB")
        assert "pass --in-place to run the checks in yours" in err
        assert not (tmp_path / "log.txt").exists()  # nothing ran
        # --in-place: the runs happen here, as the program's own would.
        assert fix_main(["--in-place", "train.py"], server=server) == 1
        assert (tmp_path / "log.txt").exists()
    finally:
        os.chdir(here)
