"""Every code block of README.md runs as written.

The harness is generic: new blocks are picked up without touching this file.

* ```` ```python ```` blocks run in README order in one Python session (later blocks
  use the names earlier ones defined), in a fresh interpreter.
* A python block whose first line is a comment naming a launch command
  (``# torchrun --standalone --nproc-per-node 4 train.py      (or: mpiexec -n 4 python train.py)``)
  is written to that file and started with every command the comment gives.
* ```` ```bash ```` / ``sh`` / ``shell`` / ``console`` blocks: each ``&&``-separated
  command that runs ``shardckpt`` (``shardckpt ...``, ``.venv/bin/shardckpt ...``) runs
  with this checkout's CLI; installs, exports and the test suite itself are not run.
  A block whose first line is ``cd "$(mktemp -d)"`` is a self-contained script and runs
  whole under ``bash -e``, with ``shardckpt`` and ``python`` resolving to this checkout's.
* Other blocks (```` ```text ````, no language) are not code.

Placeholders are mapped, not edited in the README: absolute paths (``/ckpt/...``,
``/train/...``, ``/tmp/...``; not device names such as ``/job:...``) go under a
temporary folder; ``s3://bucket/`` goes to the moto server's bucket, whose endpoint
replaces ``http://minio.local:9000`` and whose credentials replace ``"..."``.
Checkpoints a block only reads (TensorFlow models the README names) are created
first by :data:`INPUTS`.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Dict, List

import numpy as np
from helpers.launchers import clean_env, tool

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
TIMEOUT = 600

FENCE = re.compile(r"^```([\w+-]*)[^\n]*\n(.*?)^```\s*$", re.S | re.M)
PATH_LITERAL = re.compile(r"""(?P<q>["'])(?P<path>/[^"':\s]*)(?P=q)""")
SHELL_PATH = re.compile(r"(?<![\w.:/-])(/[\w.-]+(?:/[\w.-]*)*)")
LAUNCH = re.compile(r"^#\s*((?:torchrun|mpiexec|python)\b.*?\.py)\s*(?:\(or:\s*(.*?\.py)\s*\))?\s*$")
SHELL_LANGS = {"bash", "sh", "shell", "console"}


@dataclass
class Block:
    lang: str
    code: str
    line: int  # README line of the opening fence

    @property
    def launches(self) -> List[str]:
        """The launch commands of a multi-process block (empty for a session block)."""
        first = self.code.lstrip("\n").splitlines()[0] if self.code.strip() else ""
        m = LAUNCH.match(first.strip()) if self.lang == "python" else None
        return [c for c in (m.group(1), m.group(2)) if c] if m else []

    def shardckpt_commands(self) -> List[List[str]]:
        """The shardckpt commands of a shell block, as argument lists."""
        out = []
        for raw in self.code.splitlines():
            line = raw.split(" #", 1)[0].strip()
            if line.startswith("#"):
                continue
            for part in line.split("&&"):
                words = shlex.split(part.strip()) if part.strip() else []
                if words and os.path.basename(words[0]) == "shardckpt":
                    out.append(words[1:])
        return out


def readme_blocks(text: str) -> List[Block]:
    """Every fenced block of ``text``, in order."""
    return [Block(m.group(1).lower(), m.group(2), text.count("\n", 0, m.start()) + 1) for m in FENCE.finditer(text)]


class Mapper:
    """Maps the README's placeholders to this run's folders and servers."""

    def __init__(self, root: Path, s3: object = None, s3_prefix: str = "") -> None:
        self.root = root
        self.s3 = s3
        self.s3_prefix = s3_prefix

    def path(self, path: str) -> str:
        return str(self.root) + path

    def python(self, code: str) -> str:
        code = PATH_LITERAL.sub(lambda m: m.group("q") + self.path(m.group("path")) + m.group("q"), code)
        return self._s3(code)

    def shell(self, words: List[str]) -> List[str]:
        return [SHELL_PATH.sub(lambda m: self.path(m.group(1)), self._s3(w)) for w in words]

    def _s3(self, code: str) -> str:
        if self.s3 is None:
            return code
        code = code.replace("s3://bucket/", f"s3://{self.s3.bucket}/{self.s3_prefix}/")  # type: ignore[attr-defined]
        code = code.replace("http://minio.local:9000", self.s3.endpoint)  # type: ignore[attr-defined]
        return re.sub(r'\b(key|secret)="\.\.\."', r'\1="testing"', code)


# -- checkpoints the README reads but does not write (stand-ins for the models it names) ---------------


def _bert(path: Path) -> None:
    import shardckpt

    shardckpt.io.save_v2(str(path), ["bert/embeddings/word_embeddings", "bert/pooler/dense/bias"], ["", ""],
                         [np.zeros((30522, 768), np.float32), np.zeros(768, np.float32)])


def _t5(path: Path) -> None:
    import shardckpt

    shardckpt.Checkpoint(shared=shardckpt.Variable(np.ones((32, 8), np.float32))).save(str(path / "model.ckpt"))


def _train_dir(path: Path) -> None:
    path.mkdir(parents=True, exist_ok=True)


INPUTS: Dict[str, Callable[[Path], None]] = {
    "/models/bert/bert_model.ckpt": _bert,
    "/models/t5": _t5,
    "/train/dir": _train_dir,
}

# Runs the steps of the README in order; one JSON step list in argv[1]. A failure names the README line.
RUNNER = r'''
import json, os, subprocess, sys, traceback
steps = json.load(open(sys.argv[1]))
namespace = {"__name__": "__readme__"}
for step in steps:
    print(f"== README line {step['line']}: {step['kind']}", flush=True)
    try:
        if step["kind"] == "python":
            exec(compile(step["code"], f"README.md:{step['line']}", "exec"), namespace)
        else:
            env = dict(os.environ, **step.get("env", {}))
            done = subprocess.run(step["argv"], cwd=step["cwd"], env=env, timeout=step["timeout"])
            if done.returncode != 0:
                raise SystemExit(f"{step['argv']} exited with {done.returncode}")
    except BaseException:
        traceback.print_exc()
        print(f"FAILED: the README block at line {step['line']}", flush=True)
        sys.exit(1)
print("ALL README STEPS PASSED", flush=True)
'''

# Open MPI refuses root and more ranks than cores unless told; the README's command line stays as written.
MPI_ENV = {"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1",
           "OMPI_MCA_rmaps_base_oversubscribe": "1", "PRTE_MCA_rmaps_default_mapping_policy": ":oversubscribe"}


def _launch_argv(command: str, script: Path) -> List[str]:
    words = shlex.split(command)
    words = [str(script) if w == script.name else w for w in words]
    first = {"torchrun": str(tool("torchrun")), "mpiexec": str(tool("mpiexec")), "python": sys.executable}
    words[0] = first[words[0]]
    return [sys.executable if w in ("python", "python3") else w for w in words]


def build_steps(blocks: List[Block], mapper: Mapper, work: Path) -> List[dict]:
    """The README as a list of runner steps (session code, launched scripts, shell commands)."""
    steps: List[dict] = []
    for block in blocks:
        if block.lang == "python" and block.launches:
            for i, command in enumerate(block.launches):
                name = shlex.split(command)[-1]
                folder = work / f"launch-{block.line}-{i}"
                folder.mkdir(parents=True, exist_ok=True)
                script = folder / name
                script.write_text(mapper.python(block.code))
                steps.append({"kind": "launch", "line": block.line, "argv": _launch_argv(command, script),
                              "cwd": str(folder), "env": MPI_ENV, "timeout": TIMEOUT})
        elif block.lang == "python":
            steps.append({"kind": "python", "line": block.line, "code": mapper.python(block.code)})
        elif block.lang in SHELL_LANGS and block.code.lstrip().startswith('cd "$(mktemp -d)"'):
            script = work / f"block-{block.line}.sh"
            script.write_text("set -euo pipefail\n" + block.code)
            bin_dir = work / "bin"
            bin_dir.mkdir(exist_ok=True)
            (bin_dir / "shardckpt").write_text(f'#!/bin/sh\nexec "{sys.executable}" -m shardckpt.cli.main "$@"\n')
            (bin_dir / "shardckpt").chmod(0o755)
            for name in ("python", "python3"):  # scripts, not symlinks: a venv is found from the real path
                (bin_dir / name).write_text(f'#!/bin/sh\nexec "{sys.executable}" "$@"\n')
                (bin_dir / name).chmod(0o755)
            steps.append({"kind": "shell", "line": block.line, "cwd": str(work), "timeout": TIMEOUT,
                          "argv": ["bash", str(script)],
                          "env": {"PATH": f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}"}})
        elif block.lang in SHELL_LANGS:
            for words in block.shardckpt_commands():
                steps.append({"kind": "shell", "line": block.line, "cwd": str(work), "timeout": TIMEOUT,
                              "argv": [sys.executable, "-m", "shardckpt.cli.main"] + mapper.shell(words)})
    return steps


def test_readme_blocks_are_found() -> None:
    blocks = readme_blocks(README.read_text())
    python = [b for b in blocks if b.lang == "python"]
    assert len(python) >= 6 and any(b.launches for b in python)
    launched = next(b for b in python if b.launches)
    assert [shlex.split(c)[0] for c in launched.launches] == ["torchrun", "mpiexec"]
    assert any(["demo"] == c for b in blocks for c in b.shardckpt_commands())
    assert not [b.line for b in blocks if b.lang not in SHELL_LANGS | {"python", "text"}], \
        "a README block without a language: say python, bash or text"


def test_mapper_maps_placeholders_only(tmp_path: Path) -> None:
    mapper = Mapper(tmp_path)
    code = 'f("/ckpt/model-10", io_device="/job:worker/task:0/device:CPU:0", x="rel/path")'
    assert mapper.python(code) == f'f("{tmp_path}/ckpt/model-10", io_device="/job:worker/task:0/device:CPU:0", ' \
                                  'x="rel/path")'
    assert mapper.shell(["inspect", "/ckpt/model-10", "--key", "step"]) == \
        ["inspect", f"{tmp_path}/ckpt/model-10", "--key", "step"]


def test_readme_runs_as_written(tmp_path: Path, s3_server: object) -> None:
    root = tmp_path / "fs"
    for placeholder, make in INPUTS.items():
        target = Path(str(root) + placeholder)
        target.parent.mkdir(parents=True, exist_ok=True)
        make(target)
    mapper = Mapper(root, s3_server, s3_prefix=f"readme-{os.getpid()}")
    steps = build_steps(readme_blocks(README.read_text()), mapper, tmp_path)
    (tmp_path / "steps.json").write_text(json.dumps(steps))
    (tmp_path / "runner.py").write_text(RUNNER)
    env = clean_env()
    env.update(s3_server.env)  # type: ignore[attr-defined]
    done = subprocess.run([sys.executable, str(tmp_path / "runner.py"), str(tmp_path / "steps.json")],
                          cwd=str(tmp_path), env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          timeout=TIMEOUT * 2)
    out = done.stdout.decode(errors="replace")
    assert done.returncode == 0 and "ALL README STEPS PASSED" in out, out[-8000:]
    assert out.count("== README line") == len(steps)
    ran = {s["kind"] for s in steps}
    assert ran == {"python", "launch", "shell"}, ran


def test_readme_install_commands_name_the_checkout_and_real_extras() -> None:
    """The install lines are not run (they would take minutes); what they ask for must exist as written.

    shardckpt is installed from its checkout, so ``pip install`` names ``.`` (with extras that
    ``pyproject.toml`` defines), never a package index name; the environment a block activates
    is the one the two set-up commands create.
    """
    import tomllib

    extras = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"])
    text = README.read_text()
    installs = re.findall(r"pip install\s+(?:-q\s+)?(\S+)", text)
    assert installs, "the README shows no install command"
    for target in installs:
        target = target.strip("'\"`")
        m = re.fullmatch(r"\.(?:\[([\w,]+)\])?", target)
        assert m, f"README installs {target!r}: shardckpt is installed from its checkout ('.' or '.[extra]')"
        for extra in (m.group(1) or "").split(","):
            assert not extra or extra in extras, f"README names the extra [{extra}], pyproject has {sorted(extras)}"
    for activate in re.findall(r"source\s+(\S+)", text):
        assert activate == ".venv/bin/activate", activate
    assert "python3 -m venv .venv" in text and "bash scripts/test.sh" in text
