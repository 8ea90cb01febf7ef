"""The commit-msg hook `deploy/dev.sh setup` installs: one-line subjects of at most
72 characters, a blank line before the body."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

HOOK = Path(__file__).resolve().parent.parent / "deploy" / "git-hooks" / "commit-msg"


@pytest.mark.parametrize(("message", "accepted"), [
    ("look-ahead: fetch width follows the readers\n\nWhy, in the body.\n", True),
    ("x" * 72 + "\n", True),
    ("x" * 73 + "\n", False),
    ("a subject\nthat goes on\n", False),
    ("# a comment line git strips\na subject\n\nbody\n", True),
])
def test_the_commit_msg_hook_keeps_subjects_to_one_short_line(tmp_path, message, accepted):
    path = tmp_path / "COMMIT_EDITMSG"
    path.write_text(message)
    result = subprocess.run([str(HOOK), str(path)], capture_output=True, text=True)
    assert (result.returncode == 0) == accepted, result.stderr
    if not accepted:
        assert result.stderr.startswith("commit-msg: ") and result.stderr.count("\n") == 1
