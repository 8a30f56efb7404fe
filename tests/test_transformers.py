"""The Hugging Face callback, with a real ``transformers.Trainer`` on CPU.

A 2-layer GPT-2 built from its config (no download), 3 steps of 2 sequences.
"""

from __future__ import annotations

import inspect
import logging
import os
import re
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

# Nothing may reach the hub: the model is built from its config.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
transformers = pytest.importorskip("transformers")

import versionwatch  # noqa: E402
from versionwatch._runtime import installed  # noqa: E402
from versionwatch.integrations.transformers import VersionWatchCallback  # noqa: E402

GPT2Config = transformers.GPT2Config
GPT2LMHeadModel = transformers.GPT2LMHeadModel
Trainer = transformers.Trainer
TrainingArguments = transformers.TrainingArguments
GPT2MLP = transformers.models.gpt2.modeling_gpt2.GPT2MLP
transformers.logging.set_verbosity_error()  # the tiny config's token ids: not our warnings


class SigmoidMLP(GPT2MLP):  # type: ignore[misc]
    """The user's block: sigmoid saves its output, and the next line changes it."""

    buggy = True

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        h = torch.sigmoid(self.c_fc(hidden_states))
        if self.buggy:
            h.mul_(2)                              # the bug: sigmoid saved h
        else:
            h = h * 2
        return self.dropout(self.c_proj(h))


def _model(block: bool = False, buggy: bool = True) -> Any:
    torch.manual_seed(0)
    config = GPT2Config(n_layer=2, n_head=2, n_embd=32, vocab_size=64, n_positions=32,
                        bos_token_id=0, eos_token_id=0)
    model = GPT2LMHeadModel(config)
    if block:
        mlp = SigmoidMLP(4 * 32, config)
        mlp.buggy = buggy
        model.transformer.h[1].mlp = mlp
    return model


def _data() -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [{"input_ids": (ids := torch.randint(0, 64, (16,), generator=g)), "labels": ids}
            for _ in range(6)]


def _args(tmp_path: Path, **kw: Any) -> Any:
    cpu = "use_cpu" if "use_cpu" in inspect.signature(TrainingArguments).parameters else "no_cuda"
    return TrainingArguments(output_dir=str(tmp_path), max_steps=3, per_device_train_batch_size=2,
                             report_to=[], save_strategy="no", logging_strategy="no",
                             disable_tqdm=True, seed=0, **{cpu: True}, **kw)


def _trainer(model: Any, tmp_path: Path, callbacks: list[Any], cls: type = Trainer,
             **kw: Any) -> Any:
    return cls(model=model, args=_args(tmp_path, **kw), train_dataset=_data(),
               callbacks=callbacks)


def _lines(fn: Any) -> dict[str, int]:
    src, start = inspect.getsourcelines(fn)
    return {text.strip(): start + i for i, text in enumerate(src)}


def _checkpointing(model: Any, reentrant: bool) -> None:
    kwargs = {"use_reentrant": reentrant}
    enable = getattr(model, "activation_checkpointing_enable", None)
    if enable is not None:  # transformers 5: gradient_checkpointing_enable is deprecated
        enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)


def _fused_adamw_on_cpu() -> bool:
    """Whether this torch has a fused AdamW kernel for CPU tensors."""
    p = nn.Parameter(torch.ones(2))
    p.grad = torch.ones(2)
    try:
        torch.optim.AdamW([p], fused=True).step()
    except (RuntimeError, ValueError, TypeError):
        return False
    return True


def test_a_bug_in_the_users_block_names_its_lines(tmp_path: Path) -> None:
    model = _model(block=True)
    callback = VersionWatchCallback(strict=True)
    trainer = _trainer(model, tmp_path, [callback])
    with callback, pytest.raises(versionwatch.InplaceModificationError) as e:
        trainer.train()                            # the user's line for what transformers runs
    assert not callback.is_open and not installed()
    here = _lines(test_a_bug_in_the_users_block_names_its_lines)
    block = _lines(SigmoidMLP.forward)
    train = here["trainer.train()                            # the user's line for what transformers runs"]
    report = e.value.report
    h = report.first
    assert h.kind == "inplace" and h.module == "model.transformer.h.1.mlp"
    assert h.saved_at is not None and h.saved_at.file.endswith("test_transformers.py")
    assert h.saved_at.line == block["h = torch.sigmoid(self.c_fc(hidden_states))"]
    assert h.modified_by[0].site is not None
    assert h.modified_by[0].site.line == block["h.mul_(2)                              # the bug: sigmoid saved h"]
    assert report.backward_site is not None and report.backward_site.line == train
    assert report.backward_site.file.endswith("test_transformers.py")
    # transformers' own line comes after the user's, never instead of it.
    via = report.backward_site.via
    assert via is not None and via.file == "transformers/trainer.py", via
    assert str(report.backward_site) == (
        f"{report.backward_site.file}:{train} (via transformers/trainer.py:{via.line})")
    assert all(line.split(" (via ")[0].count("transformers/") == 0
               for line in str(report).splitlines() if "transformers/" in line
               and not line.lstrip().startswith("pytorch")), str(report)


def test_default_mode_gives_the_train_line_for_transformers_frames(tmp_path: Path) -> None:
    """A write made by a hook on a transformers module: transformers' own frames are
    skipped, so "during", the save and "backward at" read the user's train() line."""
    model = _model()
    model.config.activation_function = "relu"
    model.transformer.h[0].mlp.act = nn.ReLU()     # saves its output

    def double(module: nn.Module, args: Any, out: torch.Tensor) -> None:
        out.mul_(2)                                # the write: relu saved out

    model.transformer.h[0].mlp.act.register_forward_hook(double)
    callback = VersionWatchCallback(on_hazard="raise")
    trainer = _trainer(model, tmp_path, [callback])
    with callback, pytest.raises(versionwatch.InplaceModificationError) as e:
        trainer.train()                            # the line every report names
    here = _lines(test_default_mode_gives_the_train_line_for_transformers_frames)
    train = here["trainer.train()                            # the line every report names"]
    report = e.value.report
    text = str(report)
    assert report.backward_site is not None and report.backward_site.line == train
    # The user's train() line first, then the line of transformers' Trainer that called
    # the model (and that ran the backward).
    assert re.search(rf"during forward #1 at \S*test_transformers\.py:{train} "
                     rf"\(via transformers/trainer\.py:\d+\)\n", text), text
    assert re.search(rf"backward at +\S*test_transformers\.py:{train} "
                     rf"\(via transformers/trainer\.py:\d+\)", text), text
    assert report.to_json().count('"via": {"file": "transformers/trainer.py"') >= 2


def test_clean_training_is_bitwise_the_same_and_reports_nothing(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    def final(callbacks: list[Any]) -> list[torch.Tensor]:
        model = _model(block=True, buggy=False)
        _trainer(model, tmp_path, callbacks).train()
        return [p.detach().clone() for p in model.parameters()]

    plain = final([])
    callback = VersionWatchCallback()
    with caplog.at_level(logging.INFO, logger="versionwatch"), warnings.catch_warnings():
        warnings.simplefilter("error", versionwatch.InplaceHazardWarning)
        watched = final([callback])
    assert all(torch.equal(a, b) for a, b in zip(plain, watched))
    assert callback.watcher is not None and not callback.watcher.reports
    assert callback.watcher.backward_count == 3 and not installed()
    assert "AdamW.step() #3" in str(callback.watcher.timeline())
    assert "3 backward(s) predicted, no hazard" in caplog.text


@pytest.mark.parametrize("reentrant", [False, True])
def test_gradient_checkpointing_raises_no_false_alarm(
        tmp_path: Path, reentrant: bool, caplog: pytest.LogCaptureFixture) -> None:
    model = _model(block=True, buggy=False)
    _checkpointing(model, reentrant)
    callback = VersionWatchCallback()
    with caplog.at_level(logging.INFO, logger="versionwatch"):
        _trainer(model, tmp_path, [callback]).train()
    assert callback.watcher is not None and not callback.watcher.reports
    assert callback.watcher.backward_count == 3
    if not reentrant:  # the default mode says what it did not verify
        assert "inside checkpoint(use_reentrant=False) not verified" in caplog.text


class CarryTrainer(Trainer):  # type: ignore[misc]
    """Adds the previous step's auxiliary loss: its graph was saved before the step."""

    carry = True
    kept: torch.Tensor | None = None

    def compute_loss(self, model: Any, inputs: Any, *args: Any, **kwargs: Any) -> Any:
        loss = super().compute_loss(model, inputs, *args, **kwargs)
        if self.carry:
            if self.kept is not None:
                loss = loss + 0.1 * self.kept      # the bug: a graph from before the step
            self.kept = model(**inputs).loss
        return loss


@pytest.mark.skipif(not _fused_adamw_on_cpu(), reason="this torch has no fused AdamW for CPU")
@pytest.mark.parametrize("carry", [True, False])
def test_fused_adamw_silent_hazard_is_reported_only_when_real(tmp_path: Path, carry: bool) -> None:
    model = _model()
    callback = VersionWatchCallback(on_hazard="warn")
    trainer = _trainer(model, tmp_path, [callback], cls=CarryTrainer, optim="adamw_torch_fused")
    trainer.carry = carry
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", versionwatch.InplaceHazardWarning)
        trainer.train()                            # PyTorch raises nothing: fused bumps no version
    hazards = [w for w in caught if issubclass(w.category, versionwatch.InplaceHazardWarning)]
    assert callback.watcher is not None and not installed()
    if not carry:
        assert not hazards and not callback.watcher.reports
        return
    report = callback.watcher.reports[0]
    assert report.first.kind == "silent"
    assert "(fused: no version bump)" in str(report)
    assert hazards and Path(hazards[0].filename).name == "test_transformers.py"
    # The write (the fused step) runs inside transformers' training loop: the user's
    # train() line, then the Trainer's line that stepped.
    [step] = [m for m in report.first.modified_by if "step()" in m.description]
    assert step.site is not None and step.site.via is not None
    assert step.site.via.file == "transformers/trainer.py"
    assert re.search(r"modified by +\S+\.step\(\) #\d+ (\(fused: no version bump\) )?at \S*test_transformers\.py:\d+ "
                     r"\(via transformers/trainer\.py:\d+\)", str(report)), str(report)


def test_a_failed_train_is_closed_by_the_next_one(tmp_path: Path) -> None:
    callback = VersionWatchCallback()
    with pytest.raises(versionwatch.InplaceModificationError):
        _trainer(_model(block=True), tmp_path, [callback]).train()
    first = callback.watcher
    assert first is not None and not first.closed  # Trainer has no on_exception
    again = VersionWatchCallback()  # another callback's train() on this thread closes it
    _trainer(_model(block=True, buggy=False), tmp_path, [again]).train()
    assert first.closed and again.watcher is not None and again.watcher.closed
    assert not again.watcher.reports and not installed()


def test_bad_policy_is_refused_at_construction() -> None:
    with pytest.raises(ValueError, match="not a valid policy"):
        VersionWatchCallback(on_hazard="explode")  # type: ignore[arg-type]


REPLAYED = '''\
import torch
import transformers
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments
from transformers.models.gpt2.modeling_gpt2 import GPT2MLP
from versionwatch.integrations.transformers import VersionWatchCallback

transformers.logging.set_verbosity_error()


class SigmoidMLP(GPT2MLP):
    def forward(self, hidden_states):
        h = torch.sigmoid(self.c_fc(hidden_states))
        h.mul_(2)  # the bug: sigmoid saved h
        return self.dropout(self.c_proj(h))


torch.manual_seed(0)
config = GPT2Config(n_layer=2, n_head=2, n_embd=32, vocab_size=64, n_positions=32,
                    bos_token_id=0, eos_token_id=0)
model = GPT2LMHeadModel(config)
model.transformer.h[1].mlp = SigmoidMLP(4 * 32, config)
data = [{"input_ids": torch.arange(16) % 64, "labels": torch.arange(16) % 64}] * 4
args = TrainingArguments(output_dir="out", max_steps=2, per_device_train_batch_size=2,
                         report_to=[], save_strategy="no", logging_strategy="no",
                         disable_tqdm=True, seed=0, {cpu}=True)
Trainer(model=model, args=args, train_dataset=data, callbacks=[VersionWatchCallback()]).train()
'''


def test_replay_reproduces_with_the_callback_and_names_the_write(tmp_path: Path) -> None:
    """The callback's watcher, opened inside `--replay`'s strict child, stops at the
    replayed backward as the child's own watcher would: the write's line is named."""
    import subprocess
    import sys

    cpu = "use_cpu" if "use_cpu" in inspect.signature(TrainingArguments).parameters else "no_cuda"
    (tmp_path / "train.py").write_text(REPLAYED.replace("{cpu}", cpu), encoding="utf-8")
    src = str(Path(versionwatch.__file__).resolve().parents[1])
    env = {**os.environ, "PYTHONPATH": src, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    env.pop("PYTEST_CURRENT_TEST", None)
    out = subprocess.run([sys.executable, "-m", "versionwatch", "run", "--replay", "train.py"],
                         cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert "the strict replay met the same hazard at backward #1" in out.stderr, out.stderr
    assert "modified by  mul_() at train.py:13: h.mul_(2)" in out.stderr, out.stderr
    assert out.stderr.count("backward will fail") == 1, out.stderr
