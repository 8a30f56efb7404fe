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


def applied_steps(result: FixResult, path: Path, tmp_path: Path,
                  index: int = 0) -> dict[str, Any]:
    """Apply the first (or ``index``-th) verified patch to ``path`` (as the run found it),
    run it plainly, return its steps."""
    assert len(result.verified) > index, [(c.family, c.why) for c in result.candidates]
    here = os.getcwd()
    os.chdir(path.parent)
    try:
        assert apply_patch(result.verified[index]) is None
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

GAN = (PROGRAMS / "gan_one_dfake.py").read_text(encoding="utf-8")


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
    result, path = run_fix(tmp_path, server, "gan_one_dfake.py", GAN)
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


# -- one test per family: the first verified patch trains as the author meant ----------------

def program_defs(name: str) -> dict[str, Any]:
    """The classes and constants of ``fix_programs/name``: its text up to ``manual_seed``."""
    source = (PROGRAMS / name).read_text(encoding="utf-8")
    scope: dict[str, Any] = {}
    exec(compile(source.split("torch.manual_seed(0)")[0], name, "exec"), scope)
    return scope


def named(prefix: str, module: nn.Module, grads: Any) -> dict[str, Any]:
    return {f"{prefix}.{n}": g for (n, _), g in zip(module.named_parameters(), grads)}


def step_with(opt: torch.optim.Optimizer, params: list[nn.Parameter], grads: Any) -> None:
    for p, g in zip(params, grads):
        p.grad = g
    opt.step()


def candidates_of(result: FixResult) -> list[tuple[str, bool]]:
    return [(c.family, c.verified) for c in result.candidates]


# actor_critic_shared.py: the author meant the actor's step to apply actor_loss's gradient to
# the trunk and the actor head, and the critic's step to apply critic_loss's gradient, from
# the forward's own values (the trunk as it was before the actor's step), to the critic head.

def actor_critic_shared_reference() -> list[tuple[str, dict[str, Any]]]:
    ActorCritic = program_defs("actor_critic_shared.py")["ActorCritic"]
    torch.manual_seed(0)
    net = ActorCritic()
    actor_params = [*net.trunk.parameters(), *net.actor.parameters()]
    actor_names = [f"net.trunk.{n}" for n, _ in net.trunk.named_parameters()] + [
        f"net.actor.{n}" for n, _ in net.actor.named_parameters()]
    critic_params = list(net.critic.parameters())
    actor_opt = torch.optim.Adam(actor_params, lr=1e-3)
    critic_opt = torch.optim.Adam(critic_params, lr=1e-3)
    out: list[tuple[str, dict[str, Any]]] = []
    for _ in range(3):
        obs, actions, returns = torch.randn(8, 4), torch.randint(0, 2, (8,)), torch.randn(8, 1)
        h = net.trunk(obs)
        logits, value = net.actor(h), net.critic(h)
        advantage = (returns - value).detach()
        actor_loss = -(logits.log_softmax(-1).gather(1, actions[:, None]) * advantage).mean()
        critic_loss = (returns - value).pow(2).mean()
        # Both gradients before any step: each from the values this forward saw.
        actor_grads = torch.autograd.grad(actor_loss, actor_params, retain_graph=True)
        critic_grads = torch.autograd.grad(critic_loss, critic_params)
        out.append(("actor_opt", dict(zip(actor_names, actor_grads))))
        step_with(actor_opt, actor_params, actor_grads)
        out.append(("critic_opt", named("net.critic", net.critic, critic_grads)))
        step_with(critic_opt, critic_params, critic_grads)
    return out


def test_actor_critic_shared_critic_backward_on_its_own_head(tmp_path: Path,
                                                             server: ForkServer) -> None:
    text = (PROGRAMS / "actor_critic_shared.py").read_text(encoding="utf-8")
    result, path = run_fix(tmp_path, server, "actor_critic_shared.py", text)
    assert result.status == "checked"
    assert [c.family for c in result.verified] == ["backward_inputs", "reorder_backwards"], \
        candidates_of(result)
    # actor_opt's step after critic_loss.backward(): the trunk would get the critic's gradient.
    said = "`actor_opt.step()` would also apply `critic_loss`'s gradient to `net.trunk`"
    assert why(result, "move_step") == said
    assert why(result, "sum_losses") == said
    assert "with the same values" in result.verified[0].why, result.verified[0].why
    reference = actor_critic_shared_reference()
    found = applied_steps(result, path, tmp_path)
    assert_steps(found["steps"], reference)
    # The other verified patch (critic_loss's backward before the actor's step) too.
    path.write_text(text, encoding="utf-8")
    found = applied_steps(result, path, tmp_path, index=1)
    assert_steps(found["steps"], reference)


# lstm_state.py: the author meant truncated backpropagation through time: each batch starts
# from the previous batch's state values, and each step applies the gradient of that batch's
# loss only (the carried state a constant).

def lstm_reference() -> list[tuple[str, dict[str, Any]]]:
    defs = program_defs("lstm_state.py")
    LM, VOCAB = defs["LM"], defs["VOCAB"]
    torch.manual_seed(0)
    model = LM()
    params = list(model.parameters())
    opt = torch.optim.SGD(params, lr=0.1)
    tokens = torch.randint(0, VOCAB, (2, 25))
    state = None
    out: list[tuple[str, dict[str, Any]]] = []
    for i in range(3):
        x, y = tokens[:, i * 8:i * 8 + 8], tokens[:, i * 8 + 1:i * 8 + 9]
        carried = None if state is None else tuple(s.detach() for s in state)
        logits, state = model(x, carried)
        loss = nn.functional.cross_entropy(logits.reshape(-1, VOCAB), y.reshape(-1))
        grads = torch.autograd.grad(loss, params)
        out.append(("opt", named("model", model, grads)))
        step_with(opt, params, grads)
    return out


def test_lstm_state_detached_is_truncated_bptt(tmp_path: Path, server: ForkServer) -> None:
    text = (PROGRAMS / "lstm_state.py").read_text(encoding="utf-8")
    result, path = run_fix(tmp_path, server, "lstm_state.py", text)
    assert result.status == "checked"
    assert result.verified[0].family == "detach_state", candidates_of(result)
    # retain_graph keeps the old batch's graph: its weights have stepped since.
    said = why(result, "retain_graph")
    assert said.startswith("another hazard at backward #2 (lstm_state.py:31): "
                           "InplaceModificationError"), said
    # torch 2.4 names the LSTM's flattened weight copy "a tensor"; later releases the weight.
    assert "saved by MkldnnRnnLayerBackward0 was modified by an inplace operation" in said, said
    found = applied_steps(result, path, tmp_path)
    assert_steps(found["steps"], lstm_reference())


# loss_before_loop.py: the author meant each epoch's step to apply the gradient of the loss of
# a fresh forward of the same (x, y) at the weights as they are at that epoch.

def test_loss_before_loop_forward_moved_into_the_loop(tmp_path: Path,
                                                      server: ForkServer) -> None:
    text = (PROGRAMS / "loss_before_loop.py").read_text(encoding="utf-8")
    result, path = run_fix(tmp_path, server, "loss_before_loop.py", text)
    assert result.status == "checked"
    assert result.verified[0].family == "move_forward", candidates_of(result)
    said = why(result, "retain_graph")
    assert said.startswith("another hazard at backward #2 (loss_before_loop.py:14): "
                           "InplaceModificationError"), said
    assert "model.2.weight saved by AddmmBackward0 was modified by an inplace operation" \
        in said, said

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    params = list(model.parameters())
    opt = torch.optim.SGD(params, lr=0.1)
    x, y = torch.randn(16, 4), torch.randn(16, 1)
    reference: list[tuple[str, dict[str, Any]]] = []
    for _ in range(3):
        grads = torch.autograd.grad(nn.functional.mse_loss(model(x), y), params)
        reference.append(("opt", named("model", model, grads)))
        step_with(opt, params, grads)
    found = applied_steps(result, path, tmp_path)
    assert_steps(found["steps"], reference)


# accumulator.py: the author meant each step to apply the gradient of this iteration's loss
# only (the total is a running sum for the log, not something to back-propagate again).

def test_accumulator_reset_each_iteration(tmp_path: Path, server: ForkServer) -> None:
    text = (PROGRAMS / "accumulator.py").read_text(encoding="utf-8")
    result, path = run_fix(tmp_path, server, "accumulator.py", text)
    assert result.status == "checked"
    # Both verified; the one that keeps the printed total first.
    assert [c.family for c in result.verified] == ["item_accumulator", "reset_accumulator"], \
        candidates_of(result)
    assert result.verified[1].summary.startswith("`total = 0` again at the end of each iteration")
    said = why(result, "retain_graph")
    assert said.startswith("another hazard at backward #2 (accumulator.py:15): "
                           "InplaceModificationError"), said
    assert "model.2.weight saved by AddmmBackward0 was modified by an inplace operation" \
        in said, said

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    params = list(model.parameters())
    opt = torch.optim.SGD(params, lr=0.1)
    reference: list[tuple[str, dict[str, Any]]] = []
    for _ in range(3):
        x, y = torch.randn(16, 4), torch.randn(16, 1)
        grads = torch.autograd.grad(nn.functional.mse_loss(model(x), y), params)
        reference.append(("opt", named("model", model, grads)))
        step_with(opt, params, grads)
    found = applied_steps(result, path, tmp_path)
    assert_steps(found["steps"], reference)
    # reset_accumulator (`total = 0` at the end of each iteration) trains the same.
    path.write_text(text, encoding="utf-8")
    found = applied_steps(result, path, tmp_path, index=1)
    assert_steps(found["steps"], reference)


# ema.py: the author meant plain training of `model` (evaluate_with_ema swaps the EMA weights
# in and restores the model's own, bit for bit, so it changes no step), each step the
# gradient of that iteration's loss at the weights its forward used; and `ema` an exponential
# moving average (0.1) of the weights after each step. The evaluation draws its own batch,
# after the training batch, in each iteration.

def test_ema_evaluation_moved_after_the_step(tmp_path: Path, server: ForkServer) -> None:
    text = (PROGRAMS / "ema.py").read_text(encoding="utf-8")
    result, path = run_fix(tmp_path, server, "ema.py", text)
    assert result.status == "checked"
    assert result.verified[0].family == "move_update", candidates_of(result)
    assert "the same losses as the program meant, with the same values" \
        in result.verified[0].why, result.verified[0].why
    # The tool proposes no other candidate here (no wrong one to see rejected).
    assert candidates_of(result) == [("move_update", True)]

    import copy

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    ema = copy.deepcopy(model)
    params = list(model.parameters())
    opt = torch.optim.SGD(params, lr=0.1)
    reference: list[tuple[str, dict[str, Any]]] = []
    for _ in range(3):
        loss = model(torch.randn(8, 4)).pow(2).mean()
        torch.randn(2, 4)  # the evaluation's batch
        grads = torch.autograd.grad(loss, params)
        reference.append(("opt", named("model", model, grads)))
        step_with(opt, params, grads)
        with torch.no_grad():
            for e, p in zip(ema.parameters(), params):
                e.lerp_(p, 0.1)
    found = applied_steps(result, path, tmp_path)
    # The same ops in the same order as the program's: every gradient bitwise.
    assert_steps(found["steps"], reference, exact=set(reference[0][1]))
    # The weights and their moving average at the end, bitwise.
    finals = {**named("model", model, params), **named("ema", ema, ema.parameters())}
    assert set(found["final"]) == set(finals)
    for name, value in finals.items():
        assert torch.equal(found["final"][name], value.detach()), name


# oop_relu.py: the author meant the gradient of mean(relu(exp(model(x) - 1))) as written,
# relu's write not clobbering the output exp saved for its backward.

def test_oop_relu_out_of_place_is_bitwise_the_function_as_written(
        tmp_path: Path, server: ForkServer) -> None:
    text = (PROGRAMS / "oop_relu.py").read_text(encoding="utf-8")
    result, path = run_fix(tmp_path, server, "oop_relu.py", text)
    assert result.status == "checked"
    assert result.verified[0].family == "out_of_place", candidates_of(result)
    assert "bitwise the original run's" in result.verified[0].why, result.verified[0].why
    # The tool proposes no other candidate here (no wrong one to see rejected).
    assert candidates_of(result) == [("out_of_place", True)]

    torch.manual_seed(0)
    model = nn.Linear(4, 4)
    params = list(model.parameters())
    opt = torch.optim.SGD(params, lr=0.01)
    reference: list[tuple[str, dict[str, Any]]] = []
    for _ in range(3):
        loss = torch.relu(torch.exp(model(torch.randn(8, 4)) - 1)).mean()
        grads = torch.autograd.grad(loss, params)
        reference.append(("opt", named("model", model, grads)))
        step_with(opt, params, grads)
    found = applied_steps(result, path, tmp_path)
    assert_steps(found["steps"], reference, exact=set(reference[0][1]))


# -- one forward, a backward and a step per chunk of it -----------------------------------------

# chunks.py: the author meant, for each chunk, a step of that chunk's gradient taken on the
# weights the forward used (it ran once, before the loop); with plain SGD, one step of their
# sum after the loop leaves the weights where the three steps would.

def test_chunks_one_step_after_the_loop(tmp_path: Path, server: ForkServer) -> None:
    text = (PROGRAMS / "chunks.py").read_text(encoding="utf-8")
    result, path = run_fix(tmp_path, server, "chunks.py", text)
    chosen = result.verified[0]
    assert chosen.family == "step_after_chunks", candidates_of(result)
    assert "leave the parameters as the program's three did" in chosen.why, chosen.why
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(),
                          nn.Linear(16, 1))
    params = list(model.parameters())
    opt = torch.optim.SGD(params, lr=0.05)
    reference: list[tuple[str, dict[str, Any]]] = []
    for _ in range(2):
        x, y = torch.randn(12, 4), torch.randn(12, 1)
        out = model(x)
        total = [torch.zeros_like(p) for p in params]
        for oc, yc in zip(out.split(4), y.split(4)):
            grads = torch.autograd.grad((oc - yc).pow(2).mean(), params, retain_graph=True)
            total = [t + g for t, g in zip(total, grads)]
        reference.append(("opt", named("model", model, total)))
        step_with(opt, params, total)
    found = applied_steps(result, path, tmp_path)
    assert_steps(found["steps"], reference)


def test_chunks_with_a_forward_per_chunk_after_the_step_get_no_merged_step(
        tmp_path: Path, server: ForkServer) -> None:
    """The head runs on each chunk after the step before it: one step after the loop
    would take every chunk's head gradient on the first weights: another training."""
    text = (PROGRAMS / "chunks.py").read_text(encoding="utf-8").replace(
        "model = nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), "
        "nn.Linear(16, 1))",
        "model = nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh())\n"
        "head = nn.Linear(16, 1)").replace(
        "opt = torch.optim.SGD(model.parameters(), lr=0.05)",
        "opt = torch.optim.SGD([*model.parameters(), *head.parameters()], lr=0.05)").replace(
        "loss = (oc - yc).pow(2).mean()", "loss = (head(oc) - yc).pow(2).mean()")
    assert "head(oc)" in text
    result, _ = run_fix(tmp_path, server, "chunks.py", text)
    assert why(result, "step_after_chunks").startswith(
        "it changes the training: one `opt.step()` of the summed gradients instead of three, "
        "and the parameters after it differ from the program's")
    assert not any(c.family == "step_after_chunks" for c in result.verified)
