"""``versionwatch fix`` and the user's files as they are: read as Python reads them, and
written by ``--apply`` with everything the patch does not change kept.

Reading: a coding cookie, a UTF-8 BOM, CRLF line ends, and characters that
``str.splitlines`` takes for line ends but Python does not (a form feed, U+2028):
the seed story written each of those ways still gets its verified patch.

Writing: the patched file keeps its bytes but for the patched lines (its line
endings, its encoding and BOM), its mode, its hard links (written in place) and
its symbolic link (the target written); a read-only file is refused without
``--force``, and a folder ``--apply`` cannot write gets one line, not a traceback.
The printed diff applies, with ``git apply``, to the file as it was.

The fix runs (a few seconds each) share one fork server; ``apply_patch`` is also
called alone, on patches made by hand, where no run is needed.
"""

from __future__ import annotations

import ast
import os
import shutil
import stat
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

import versionwatch
from versionwatch._candidates.shared import Candidate
from versionwatch._candidates.source import Source, keep_endings, unified_diff
from versionwatch._fix.command import apply_patch, fix
from versionwatch._fix.command import main as fix_main
from versionwatch._fix.server import ForkServer

HERE = Path(__file__).resolve().parent
SEED = (HERE / "fix_programs" / "seed_story.py").read_text(encoding="utf-8")


@pytest.fixture(scope="module")
def server() -> Iterator[ForkServer]:
    s = ForkServer()
    yield s
    s.close()


# -- reading: lines as Python numbers them ------------------------------------------

def test_lines_are_numbered_as_python_numbers_them() -> None:
    """A form feed, \\x1c-\\x1e, \\x85, U+2028 and U+2029 end no line for Python: the
    statement after them is found at the line the interpreter says."""
    text = ("a = 1\n\f\n# \x1c\x1d\x1e \x85 \u2028 \u2029\ns = '\u2028'\r\nb = 2\rc = 3\n")
    src = Source("m.py", text)
    (c,) = [n for n in ast.walk(compile(text, "m.py", "exec", ast.PyCF_ONLY_AST))
            if isinstance(n, ast.Name) and n.id == "c"]
    assert c.lineno == 6
    assert src.line_text(6) == "c = 3\n"
    assert [s.lineno for s in src.statements_at(6)] == [6]
    assert src.line_text(4) == "s = '\u2028'\n"  # Python's view: every line ended by \n


@pytest.mark.parametrize(("written", "new", "want"), [
    # CRLF: the kept lines keep theirs, the added one gets its neighbours'.
    ("a\r\nb\r\nc\r\n", "a\nx\nb\nc\n", "a\r\nx\r\nb\r\nc\r\n"),
    # CR only
    ("a\rb\rc\r", "a\nc\n", "a\rc\r"),
    # mixed: a changed line keeps the ending of the line it replaces; an added
    # one takes the line's before it
    ("a\r\nb\nc\r\n", "a\nB\nc\nd\n", "a\r\nB\nc\r\nd\r\n"),
    # the last line unended stays unended; a line added after it gets the file's usual
    ("a\r\nb", "a\nb\nc", "a\r\nb\r\nc"),
])
def test_patched_lines_get_the_line_endings_of_their_neighbours(written: str, new: str,
                                                                 want: str) -> None:
    assert keep_endings(written, new) == want


# -- the seed story, written otherwise ------------------------------------------------

STEP = ("loss1.backward(retain_graph=True)", "    optim.step()",
        "    optim.zero_grad(set_to_none=False)", "    loss2")


def variant(name: str) -> tuple[bytes, bytes]:
    """The seed story written one way: its bytes, and what the first verified patch (one
    step after both backwards) must make of them, byte for byte."""
    eol = b"\n"
    if name == "crlf":
        data, eol = SEED.replace("\n", "\r\n").encode(), b"\r\n"
    elif name == "latin1":  # a latin-1 byte (\xe9) in a comment, named by the cookie
        data = ("# -*- coding: latin-1 -*-\n# learning rate in caf\xe9s\n" + SEED
                ).encode("latin-1")
    elif name == "bom":
        data = b"\xef\xbb\xbf" + SEED.encode()
    elif name == "formfeed":  # a line of a form feed, before the failing lines
        data = SEED.replace("torch.manual_seed(0)\n", "\f\ntorch.manual_seed(0)\n").encode()
    else:  # a U+2028 (a line end for str.splitlines) in a comment
        data = SEED.replace("torch.manual_seed(0)\n",
                            "# seeded\u2028once\ntorch.manual_seed(0)\n").encode()
    old = eol.join(s.encode() for s in STEP)
    assert data.count(old) == 1
    return data, data.replace(old, eol.join(s.encode() for s in (STEP[0], STEP[3])))


def first_diff(out: str) -> str:
    """The first verified patch's diff, as the command printed it."""
    at = out.index("diff --git a/train.py b/train.py")
    return out[at:out.index("\n\n", at)] + "\n"


@pytest.mark.parametrize("name", ["crlf", "latin1", "bom", "formfeed", "u2028"])
def test_seed_story_written_otherwise_is_fixed_and_applied_byte_for_byte(
        name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str], server: ForkServer) -> None:
    data, want = variant(name)
    work, fresh = tmp_path / "work", tmp_path / "fresh"
    work.mkdir()
    fresh.mkdir()
    (work / "train.py").write_bytes(data)
    # Two of them also as the output must say it: read-only (--force), and hard linked.
    mode, args, said = 0o750, ["--apply"], ""
    if name == "crlf":
        mode, args = 0o444, ["--apply", "--force"]
        said = "train.py is read-only: written anyway (--force); it stays read-only"
    if name == "latin1":
        os.link(work / "train.py", work / "linked.py")
        said = "train.py has 2 hard links: written in place, so that each of them has the patch"
    os.chmod(work / "train.py", mode)
    monkeypatch.chdir(work)
    code = fix_main([*args, "train.py"], server=server)
    out, err = capsys.readouterr()
    assert code == 0, out + err
    assert "3 verified" in out
    assert out.index("verified: one `optim.step()` after both backwards") < out.index(
        "diff --git")
    assert "applied the first verified patch to train.py" in out
    assert not said or f"\nversionwatch fix: {said}\n" in out + "\n"
    assert (work / "train.py").read_bytes() == want
    assert stat.S_IMODE(os.stat(work / "train.py").st_mode) == mode
    if name == "latin1":
        assert (work / "linked.py").read_bytes() == want
    assert sorted(p.name for p in work.iterdir() if p.name != "linked.py") == ["train.py"]
    # The diff printed applies to the file as it was, CRLF included.
    (fresh / "train.py").write_bytes(data)
    (fresh / "fix.patch").write_bytes(first_diff(out).encode())
    subprocess.run(["git", "apply", "fix.patch"], cwd=fresh, check=True, capture_output=True)
    assert (fresh / "train.py").read_bytes() == want


def test_module_of_a_package_run_with_dash_m_gets_a_verified_patch(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, server: ForkServer) -> None:
    """``fix -m pkg.train``: the patched module itself is what runpy runs (its loader's
    ``get_code``), so its patch can be verified."""
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("", encoding="utf-8")
    (pkg / "train.py").write_text(SEED, encoding="utf-8")
    monkeypatch.chdir(tmp_path)
    result = fix(["-m", "pkg.train"], server=server)
    assert result.status == "checked", (result.status, result.original)
    assert [c.family for c in result.verified] == ["move_step", "sum_losses", "refresh"], [
        (c.family, c.why) for c in result.candidates]
    assert result.verified[0].file == str(pkg / "train.py")
    assert "the program ran to its end" in result.verified[0].why
    assert (pkg / "train.py").read_text(encoding="utf-8") == SEED  # nothing written


# -- writing: apply_patch on patches made by hand -------------------------------------

def patch_of(path: Path, old: str, new: str) -> Candidate:
    return Candidate("out_of_place", "", {str(path): (old, new)})


def test_apply_writes_a_symbolic_links_target_and_keeps_the_link(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "lib").mkdir()
    target = tmp_path / "lib" / "train.py"
    target.write_bytes(b"y.mul_(2)\r\n")
    link = tmp_path / "train.py"
    link.symlink_to(Path("lib") / "train.py")
    notes: list[str] = []
    assert apply_patch(patch_of(link, "y.mul_(2)\r\n", "y = y.mul(2)\r\n"), notes=notes) is None
    assert link.is_symlink() and os.readlink(link) == os.path.join("lib", "train.py")
    assert target.read_bytes() == b"y = y.mul(2)\r\n"
    assert notes == [f"train.py is a symbolic link: wrote its target {Path('lib', 'train.py')}"]
    assert sorted(p.name for p in (tmp_path / "lib").iterdir()) == ["train.py"]


def test_apply_writes_a_hard_linked_file_in_place_so_every_name_has_the_patch(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    path = tmp_path / "train.py"
    path.write_bytes(b"# -*- coding: latin-1 -*-\n# caf\xe9\ny.mul_(2)\n")
    os.link(path, tmp_path / "other.py")
    inode = os.stat(path).st_ino
    notes: list[str] = []
    old = "# -*- coding: latin-1 -*-\n# caf\xe9\ny.mul_(2)\n"
    assert apply_patch(patch_of(path, old, old.replace("y.mul_(2)", "y = y.mul(2)")),
                       notes=notes) is None
    assert (tmp_path / "other.py").read_bytes() == \
        b"# -*- coding: latin-1 -*-\n# caf\xe9\ny = y.mul(2)\n"
    assert os.stat(path).st_ino == inode
    assert notes == ["train.py has 2 hard links: written in place, so that each of them has "
                     "the patch"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["other.py", "train.py"]  # no backup


def test_apply_refuses_a_read_only_file_unless_forced(tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    path = tmp_path / "train.py"
    path.write_text("y.mul_(2)\n", encoding="utf-8")
    os.chmod(path, 0o444)
    c = patch_of(path, "y.mul_(2)\n", "y = y.mul(2)\n")
    assert apply_patch(c) == "train.py is read-only; --force writes it anyway"
    assert path.read_text(encoding="utf-8") == "y.mul_(2)\n"
    notes: list[str] = []
    assert apply_patch(c, force=True, notes=notes) is None
    assert path.read_text(encoding="utf-8") == "y = y.mul(2)\n"
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o444
    assert notes == ["train.py is read-only: written anyway (--force); it stays read-only"]


def test_force_without_apply_is_a_usage_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "a.py").write_text("x = 1\n", encoding="utf-8")
    assert fix_main(["--force", "a.py"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err == ("versionwatch fix: error: --force goes with --apply (it writes "
                                 "a read-only file) (versionwatch fix --help)\n")


def _interpreter_for(uid: int) -> str | None:
    """A Python that ``uid`` can run (this one may sit in root's home)."""
    for exe in (sys.executable, shutil.which("python3"), "/usr/bin/python3"):
        try:
            if exe and subprocess.run([exe, "-c", "pass"], user=uid, group=uid,
                                      capture_output=True, cwd="/").returncode == 0:
                return exe
        except OSError:  # not executable by it
            continue
    return None


def test_apply_in_a_folder_it_cannot_write_says_so_in_one_line(tmp_path: Path) -> None:
    """As a user (not root): a read-only folder, where the new file would be made before
    it replaces the old one, is one line and nothing written, not a PermissionError."""
    nobody = 65534
    if os.geteuid() != 0:
        pytest.skip("needs root, to run the check as another user")
    exe = _interpreter_for(nobody)
    if exe is None:
        pytest.skip(f"no Python interpreter that uid {nobody} can run")
    # A world-readable place: pytest's tmp_path is root's only.
    place = Path(tempfile.mkdtemp(prefix="vw-files-"))
    try:
        os.chmod(place, 0o755)
        # The package this test imports (where PYTHONPATH put it), for the other user.
        package = Path(versionwatch.__file__).parent
        shutil.copytree(package, place / "src" / "versionwatch",
                        ignore=shutil.ignore_patterns("__pycache__", "*.so"))
        work = place / "work"
        work.mkdir()
        (work / "train.py").write_text("y.mul_(2)\n", encoding="utf-8")
        os.chown(work / "train.py", nobody, nobody)
        os.chmod(work, 0o555)  # root's folder, nobody's file: the file is writable, not its folder
        script = (
            "import sys\n"
            f"sys.path.insert(0, {str(place / 'src')!r})\n"
            "from versionwatch._candidates.shared import Candidate\n"
            "from versionwatch._fix.command import apply_patch\n"
            f"c = Candidate('out_of_place', '', {{{str(work / 'train.py')!r}: "
            "('y.mul_(2)\\n', 'y = y.mul(2)\\n')})\n"
            "print(apply_patch(c))\n")
        done = subprocess.run([exe, "-c", script], user=nobody, group=nobody, cwd=work,
                              capture_output=True, text=True, timeout=60)
        assert done.returncode == 0 and done.stderr == "", done.stderr
        assert done.stdout == ("cannot write train.py: cannot make a file in its folder . "
                               "(Permission denied), where the new file is written before it "
                               "replaces the old one\n")
        assert (work / "train.py").read_text(encoding="utf-8") == "y.mul_(2)\n"
        assert sorted(p.name for p in work.iterdir()) == ["train.py"]
    finally:
        if (place / "work").exists():
            os.chmod(place / "work", 0o755)
        shutil.rmtree(place, ignore_errors=True)


def test_a_crlf_diff_applies_to_the_crlf_file(tmp_path: Path) -> None:
    """The diff keeps each line's \\r\\n: ``git apply`` takes it on the file as it is."""
    old = "a = 1\r\nb = 2\r\nc = 3\r\n"
    new = keep_endings(old, "a = 1\nb = 20\nc = 3\n")
    (tmp_path / "m.py").write_bytes(old.encode())
    (tmp_path / "fix.patch").write_bytes(unified_diff("m.py", old, new).encode())
    subprocess.run(["git", "apply", "fix.patch"], cwd=tmp_path, check=True, capture_output=True)
    assert (tmp_path / "m.py").read_bytes() == b"a = 1\r\nb = 20\r\nc = 3\r\n"

