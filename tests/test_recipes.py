"""The README's recipes, run as a user pastes them (the real ``ckptkit`` command, from the
repository root, on the committed fixtures): every command succeeds, and what each recipe
ends with is what its framework reads."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

import ckptkit

REPO = Path(__file__).resolve().parents[1]
PLACE = "/tmp/recipes"


def _recipes() -> list[list[str]]:
    """The ``sh`` blocks of the README's recipes section, each a list of commands (a ``\\``
    continues a line; ``#`` starts a comment)."""
    text = (REPO / "README.md").read_text()
    section = text.split("## Recipes", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```sh\n(.*?)```", section, re.S)
    return [[line.split("  #")[0].strip() for line in block.replace("\\\n", " ").splitlines() if line.strip()] for block in blocks]


def test_the_readme_has_a_recipe_per_framework() -> None:
    recipes = _recipes()
    sources = {shlex.split(cmd)[2] for recipe in recipes for cmd in recipe if shlex.split(cmd)[1] == "convert"}
    assert sources == {"fixtures/deepspeed/zero3-bf16-dp3", "fixtures/megatron-lm/gpt-tp2-dp2-distopt-bf16",
                       "fixtures/megatron/gpt-tp2-dp2", "fixtures/dcp-fsdp2-fp32", "fixtures/hf/trainer/checkpoint-4",
                       "fixtures/hf/llama", "fixtures/hf/peft-lora",
                       "fixtures/torchtitan/full/checkpoint/step-2"}


@pytest.mark.parametrize("index", range(len(_recipes())))
def test_a_recipe_runs_as_written(index: int, tmp_path: Path) -> None:
    env = dict(os.environ, PATH=os.path.dirname(sys.executable) + os.pathsep + os.environ["PATH"], PYTHONWARNINGS="ignore")
    for command in _recipes()[index]:
        args = [arg.replace(PLACE, str(tmp_path)) for arg in shlex.split(command)]
        if args[0] == "echo":  # a line of the shell's (Megatron-LM's tracker file)
            done = subprocess.run(command.replace(PLACE, str(tmp_path)), shell=True, cwd=REPO, timeout=10, check=False)
            assert done.returncode == 0, command
            continue
        assert args[0] == "ckptkit", command
        done = subprocess.run(args, capture_output=True, text=True, cwd=REPO, env=env, timeout=300, check=False)
        assert done.returncode == 0, f"{command}: {done.stderr}"
        assert "Traceback" not in done.stderr
        if args[1] in ("export", "convert", "reshard"):
            dst = Path(args[3])
            assert dst.is_dir() and (dst / ("export_report.json" if args[1] == "export" else "manifest.json")).is_file()
            if args[1] != "export":
                assert ckptkit.verify(dst).ok
            else:
                report = json.loads((dst / "export_report.json").read_text())
                assert report["format"] == args[args.index("--format") + 1]


def test_the_library_recipe_runs_as_written(tmp_path: Path) -> None:
    """The trainer author's recipe (the README's python block), run as a script: it saves, loads
    at another sharding, verifies, keeps the last two saves, then saves twice incrementally (the
    second writes no tensor), asserting each."""
    text = (REPO / "README.md").read_text()
    section = text.split("## Saving and loading from your own trainer", 1)[1].split("\n## ", 1)[0]
    (block,) = re.findall(r"```python\n(.*?)```", section, re.S)
    script = tmp_path / "recipe.py"
    script.write_text(block.replace(PLACE, str(tmp_path)))
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, cwd=tmp_path, timeout=300, check=False)
    assert done.returncode == 0, done.stderr
    assert [c.step for c in ckptkit.list_checkpoints(tmp_path / "ckpts").checkpoints] == [200, 300, 400, 500]
    last = ckptkit.read_manifest(str(tmp_path / "ckpts" / "step_00000500"))
    assert all(f.base == "step_00000400" for f in last.files if f.role == "tensors")


def test_the_readme_names_every_command() -> None:
    """The front page's command table has a row for every command (layout's three in one row)."""
    from ckptkit.cli.reference import commands

    table = (REPO / "README.md").read_text().split("## Commands", 1)[1].split("\n## ", 1)[0]
    rows = [line.split("|")[1].strip().strip("`") for line in table.splitlines() if line.startswith("| `ckptkit ")]
    for name, _ in commands():
        group, _, sub = name.partition(" ")  # `ckptkit layout show / builtin / check`
        assert any(row.split()[1] == group and sub in row for row in rows), name
