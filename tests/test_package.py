"""The package as PyPI shows it: metadata, README links, the sdist, and the demo's first line.

The repository and the docs site are defined once, in pyproject.toml's
``[project.urls]``; README.md (which PyPI renders, where relative links break) and
mkdocs.yml use exactly those addresses. ``.ci/run`` builds the sdist and wheel and runs
``test_sdist_holds_the_project`` on the built sdist (``VERSIONWATCH_SDIST``).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tarfile
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parent.parent

try:
    import tomllib
except ImportError:  # Python < 3.11: tomli, where installed
    try:
        import tomli as tomllib  # type: ignore[no-redef]
    except ImportError:
        tomllib = None  # type: ignore[assignment]

needs_toml = pytest.mark.skipif(
    tomllib is None, reason="reading pyproject.toml needs tomllib (Python 3.11+) or tomli")


def _pyproject() -> dict[str, Any]:
    with open(ROOT / "pyproject.toml", "rb") as f:
        return tomllib.load(f)  # type: ignore[no-any-return]


def _urls() -> tuple[str, str]:
    """(the docs site, the repository), as pyproject.toml defines them."""
    urls = _pyproject()["project"]["urls"]
    return urls["Documentation"], urls["Source"]


_LINK = re.compile(r"\]\(([^)\s]+)\)")
_BARE = re.compile(r"https?://[^\s)>`\"']+")


def _readme_links() -> list[str]:
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    return _LINK.findall(text) + [u for u in _BARE.findall(text)
                                  if f"]({u})" not in text]


@needs_toml
def test_project_urls_are_defined_once() -> None:
    docs, source = _urls()
    urls = _pyproject()["project"]["urls"]
    assert set(urls) == {"Homepage", "Documentation", "Source", "Issues", "Changelog"}
    assert docs.startswith("https://") and docs.endswith("/")
    assert source.startswith("https://github.com/") and not source.endswith("/")
    assert urls["Homepage"] == source
    assert urls["Issues"] == f"{source}/issues"
    assert urls["Changelog"] == f"{source}/blob/main/CHANGELOG.md"
    assert (ROOT / "CHANGELOG.md").is_file()


@needs_toml
def test_readme_links_are_absolute_and_use_the_project_urls() -> None:
    """Every README link works on PyPI: absolute, and to the docs site or repository that
    pyproject.toml names, at a page or file that exists here."""
    docs, source = _urls()
    links = _readme_links()
    assert links
    problems = []
    ours = 0
    for link in links:
        if not link.startswith("https://"):
            problems.append(f"{link}: not absolute (PyPI renders the README alone)")
            continue
        host = link.split("/")[2]
        if host in ("github.com", "www.github.com") or host.endswith(".readthedocs.io") \
                or "versionwatch" in host:
            if link.startswith(docs):
                page = link[len(docs):].split("#")[0].rstrip("/")
                md = ROOT / "docs" / (f"{page}.md" if page else "index.md")
                if not md.is_file():
                    problems.append(f"{link}: no docs/{md.name}")
            elif link.startswith(source + "/blob/main/") or link.startswith(
                    source + "/tree/main/"):
                path = link.split("/main/", 1)[1].split("#")[0]
                if not (ROOT / path).exists():
                    problems.append(f"{link}: no {path} in the repository")
            elif link not in (source, f"{source}/issues"):
                problems.append(f"{link}: neither {docs} nor {source}")
            ours += 1
    assert not problems, "\n".join(problems)
    assert ours >= 10, links  # the docs pages are linked, not dropped


@needs_toml
def test_mkdocs_names_the_same_site_and_repository() -> None:
    docs, source = _urls()
    text = (ROOT / "mkdocs.yml").read_text(encoding="utf-8")
    assert re.search(rf"^site_url: {re.escape(docs)}$", text, re.MULTILINE), text[:400]
    assert re.search(rf"^repo_url: {re.escape(source)}$", text, re.MULTILINE), text[:400]


@needs_toml
def test_classifiers_match_requires_python_and_extras() -> None:
    project = _pyproject()["project"]
    classifiers = project["classifiers"]
    floor = int(project["requires-python"].removeprefix(">=3."))
    versions = sorted(int(c.rsplit(".", 1)[1]) for c in classifiers
                      if re.fullmatch(r"Programming Language :: Python :: 3\.\d+", c))
    assert versions[0] == floor and versions == list(range(floor, versions[-1] + 1)), versions
    for wanted in ("Framework :: Pytest", "Intended Audience :: Developers",
                   "Intended Audience :: Science/Research", "Operating System :: OS Independent",
                   "Typing :: Typed"):
        assert wanted in classifiers
    assert any(c.startswith("Development Status :: ") for c in classifiers)
    extras = project["optional-dependencies"]
    # One extra per integration, and the pytest plugin the classifier names is registered.
    assert {"lightning", "transformers", "notebook", "dev", "test", "docs"} <= set(extras)
    assert "versionwatch" in project["entry-points"]["pytest11"]
    assert {"build>=1", "twine>=5"} <= set(extras["dev"])


# What the sdist must hold, and must not: the package and what tests and documents it.
_SDIST_HOLDS = ["src/versionwatch/__init__.py", "src/versionwatch/py.typed", "tests/conftest.py",
                "tests/test_package.py", "conftest.py", "examples/seed_story.py",
                "benchmarks/overhead.py", "docs/index.md", "docs/cli.md", "README.md",
                "LICENSE", "CHANGELOG.md", "pyproject.toml", "mkdocs.yml"]
_SDIST_LACKS = (".ci/", "tools/", ".venv/", ".matrix/", ".git/")


@pytest.mark.skipif(not os.environ.get("VERSIONWATCH_SDIST"),
                    reason="needs a built sdist: .ci/run builds one and sets VERSIONWATCH_SDIST")
def test_sdist_holds_the_project() -> None:
    with tarfile.open(os.environ["VERSIONWATCH_SDIST"]) as tar:
        names = {n.split("/", 1)[1] for n in tar.getnames() if "/" in n}
    missing = [n for n in _SDIST_HOLDS if n not in names]
    assert not missing, missing
    extra = sorted(n for n in names if n.startswith(_SDIST_LACKS) or "__pycache__" in n)
    assert not extra, extra
    # Every file of the folders it holds that git tracks is there.
    tracked = subprocess.run(["git", "ls-files", "src", "tests", "docs", "examples",
                              "benchmarks"], cwd=ROOT, capture_output=True, text=True)
    if tracked.returncode == 0:
        lost = [n for n in tracked.stdout.split() if n not in names]
        assert not lost, lost


def test_demo_output_starts_with_its_own_text(tmp_path: Path, no_process_left: None) -> None:
    """Without numpy, torch warns "Failed to initialize NumPy" as it loads; the demo (our
    own program) starts with its own line, while a plain import still shows the warning.

    The demo imports torch before it prints anything, so its first step is enough: the
    rest of it is tests/test_cli.py's (test_demo_runs_in_four_steps).
    """
    block_numpy = "import sys; sys.modules['numpy'] = None; "  # as a base install: no numpy
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(ROOT / "src"), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep),
        "VERSIONWATCH_NATIVE": "0"}
    plain = subprocess.run([sys.executable, "-c", block_numpy + "import torch"],
                           cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert "Failed to initialize NumPy" in plain.stderr  # what a user's program sees
    demo = subprocess.Popen(
        [sys.executable, "-c", block_numpy + "from versionwatch._cli.command import main; "
         "sys.exit(main(['demo']))"],
        cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines: list[str] = []
    try:
        assert demo.stdout is not None
        for line in demo.stdout:
            lines.append(line)
            if line.startswith("It names no parameter"):  # the end of step 1
                break
    finally:
        demo.terminate()  # its fork server dies with it (no_process_left checks)
        demo.communicate(timeout=60)
    text = "".join(lines)
    assert lines and lines[0].startswith("versionwatch demo: the seed story"), text[:1000]
    assert "NumPy" not in text, text[:1000]
    assert "=== step 1/4" in text and "RuntimeError: one of the variables" in text, text
