"""The repository's documentation stands on its own: no file refers to material outside the
repository, every relative Markdown link resolves, and the README opens with the two commands
that work on a fresh machine."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[1]
# Spelled in pieces so that this file does not contain what it looks for.
OUTSIDE = ("../" + "shared", "shared" + "/data", "DESIGN" + ".md")
TEXT_SUFFIXES = {".md", ".py", ".sh", ".toml", ".txt", ".cfg", ""}


def tracked_files() -> list[Path]:
    try:
        out = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout")
    return [ROOT / line for line in out.splitlines() if (ROOT / line).is_file()]


def test_no_tracked_text_file_refers_to_files_outside_the_repository():
    offenders = []
    for path in tracked_files():
        if path.suffix not in TEXT_SUFFIXES:
            continue
        text = path.read_text(encoding="utf-8", errors="replace")
        offenders += [f"{path.relative_to(ROOT)}: {needle}" for needle in OUTSIDE if needle in text]
    assert offenders == []


def test_every_relative_markdown_link_resolves():
    broken = []
    for path in tracked_files():
        if path.suffix != ".md":
            continue
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", path.read_text(encoding="utf-8")):
            if "://" not in target and not (path.parent / target).exists():
                broken.append(f"{path.relative_to(ROOT)} -> {target}")
    assert broken == []


def test_readme_opens_with_make_run_and_make_test_and_links_the_docs_index():
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    first_block = readme.split("```bash\n", 1)[1].split("```", 1)[0].splitlines()
    assert [line.split()[:2] for line in first_block] == [["make", "run"], ["make", "test"]]
    assert "](docs/README.md)" in readme
