"""Run the demo and the test suite on several torch releases, a fresh venv each.

Usage::

    python tools/torch_matrix.py                 # every release of MATRIX
    python tools/torch_matrix.py 2.4.1 2.13.0    # chosen releases
    python tools/torch_matrix.py 2.4.1 -- tests/test_scenarios.py -x   # pytest args

Venvs live in ``.matrix/torch-<version>/`` and are reused: a release is
installed once (only 2.13.0 has a CPU wheel on these machines' disk; every other
release comes from the package registry as a CUDA build, about 5 GB with its
``nvidia-*`` packages, which runs on the CPU). The machine's pip cap on torch is
lifted for these installs only (``PIP_CONFIG_FILE=/dev/null``). The exit status
is non-zero if any demo or suite failed; the table goes to stdout.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MATRIX = ["2.4.1", "2.6.0", "2.10.0", "2.13.0", "2.15.0"]
FLOOR = MATRIX[0]
# pytest's closing line, with or without its ==== borders (-q drops them).
SUMMARY = re.compile(r"^=*\s*(\d+ (?:passed|failed|error|skipped|xfailed|xpassed|warnings?|"
                     r"deselected|errors)\b.*?) in [\d.]+s", re.M)


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PIP_CONFIG_FILE"] = "/dev/null"  # the machine's cap (torch<=2.14.1) is not ours
    env.pop("PIP_CONSTRAINT", None)
    return env


# transformers needs torch only through its "torch" extra, so pip does not hold it back
# for an old torch; it then turns torch off at import (``is_torch_available()`` is
# False: no Trainer). Read from each release's ``Requires-Dist: torch>=...`` (and the
# matching check in ``transformers/utils/import_utils.py``): 5.0-5.14 need torch>=2.2
# or 2.4, 5.15-5.19 torch>=2.5, 5.20 and later torch>=2.6. 5.14 says 2.4 but imports
# ``DTensor`` from ``torch.distributed.tensor`` (public in 2.5) when the model module
# loads: 5.13.1 is the newest that trains on torch 2.4.1.
# (torch release below which the pin applies, the pin)
_TRANSFORMERS_PINS = (((2, 5), "transformers<5.14"), ((2, 6), "transformers<5.20"))


def _transformers_pin(version: str) -> str:
    """A constraint line that keeps transformers at a release that runs on this torch."""
    release = tuple(int(p) for p in re.findall(r"\d+", version)[:2])
    for below, pin in _TRANSFORMERS_PINS:
        if release < below:
            return pin + "\n"
    return ""


def venv(version: str) -> Path:
    """The venv for ``version``, made and installed once."""
    path = ROOT / ".matrix" / f"torch-{version}"
    python = path / "bin" / "python"
    stamp = path / "installed"
    if stamp.exists():
        return python
    subprocess.run([sys.executable, "-m", "venv", "--clear", str(path)], check=True)
    constraints = path / "constraints.txt"
    # numpy 2.3 dropped the ABI that torch < 2.5 was built against.
    constraints.write_text(f"torch=={version}\nnumpy<2.3\n{_transformers_pin(version)}",
                           encoding="utf-8")
    subprocess.run(
        [str(python), "-m", "pip", "install", "-q", "-c", str(constraints), "-e", f"{ROOT}[dev]"],
        check=True, env=_env(),
    )
    stamp.write_text(version, encoding="utf-8")
    return python


def run(version: str, pytest_args: list[str]) -> tuple[str, str, str, float, bool]:
    start = time.monotonic()
    python = venv(version)
    installed = time.monotonic() - start
    demo = subprocess.run([str(python), "-m", "versionwatch", "demo"], cwd=ROOT,
                          capture_output=True, text=True)
    start = time.monotonic()
    suite = subprocess.run([str(python), "-m", "pytest", "-q", "-p", "no:cacheprovider",
                            *pytest_args], cwd=ROOT, capture_output=True, text=True)
    took = time.monotonic() - start
    log = ROOT / ".matrix" / f"torch-{version}.log"
    log.write_text(suite.stdout + suite.stderr, encoding="utf-8")
    found = SUMMARY.findall(suite.stdout)
    summary = found[-1] if found else f"pytest exit {suite.returncode}"
    ok_demo = "ok" if demo.returncode == 0 and "model.w3" in demo.stdout else "FAILED"
    if suite.returncode != 0:
        summary += f" (exit {suite.returncode}; log: {log.relative_to(ROOT)})"
    print(f"  torch {version}: venv ready in {installed:.0f}s", file=sys.stderr)
    return version, ok_demo, summary, took, ok_demo == "ok" and suite.returncode == 0


def main(argv: list[str]) -> int:
    pytest_args: list[str] = []
    if "--" in argv:
        k = argv.index("--")
        argv, pytest_args = argv[:k], argv[k + 1:]
    versions = argv or MATRIX
    rows = [run(v, pytest_args) for v in versions]
    print("| torch | demo | suite | time |")
    print("|---|---|---|---:|")
    for version, demo, summary, took, _ in rows:
        print(f"| {version} | {demo} | {summary} | {took:.0f} s |")
    return 0 if all(row[-1] for row in rows) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
