"""``shardckpt convert`` as a user runs it (a real process): what it prints on stderr and in its summary.

Issue 29: every warning was printed twice (the library logged it and the CLI printed it again);
``--strings metadata`` reported the string tensors it kept as "left out"; ``--preset`` on names it
does not recognise (transformers names given to ``bert``) did nothing, silently.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np

from shardckpt.convert import convert

FIXTURES = Path(__file__).parent / "data" / "tf_fixtures"

HF_NAMES = {"bert.embeddings.word_embeddings.weight": (10, 4),
            "bert.encoder.layer.0.attention.self.query.weight": (4, 4), "bert.pooler.dense.bias": (4,),
            "cls.predictions.bias": (10,), "cls.seq_relationship.weight": (2, 4)}


def cli(*argv: str) -> "subprocess.CompletedProcess[str]":
    return subprocess.run([sys.executable, "-m", "shardckpt.cli.main", *argv], capture_output=True, text=True,
                          timeout=120)


def hf_named(tmp_path: Path) -> str:
    """A safetensors file with transformers' BERT names."""
    rng = np.random.default_rng(0)
    npz = str(tmp_path / "hf.npz")
    np.savez(npz, **{k: rng.standard_normal(s).astype(np.float32) for k, s in HF_NAMES.items()})
    out = str(tmp_path / "hf.safetensors")
    convert(npz, out)
    return out


def test_each_warning_is_printed_once(tmp_path: Path) -> None:
    src = str(FIXTURES / "03_string_tensors" / "ckpt")
    out = cli("convert", src, str(tmp_path / "o.npz"))
    assert out.returncode == 0, out.stderr
    lines = [line for line in out.stderr.splitlines() if "_CHECKPOINTABLE_OBJECT_GRAPH: npz cannot hold" in line]
    assert lines == ["warning: _CHECKPOINTABLE_OBJECT_GRAPH: npz cannot hold string tensors; left out"], out.stderr


def test_strings_kept_in_metadata_are_not_reported_left_out(tmp_path: Path) -> None:
    src = str(FIXTURES / "03_string_tensors" / "ckpt")
    result = convert(src, str(tmp_path / "a.safetensors"), strings="metadata")
    assert result.left_out == [] and "_CHECKPOINTABLE_OBJECT_GRAPH" in result.in_metadata
    out = cli("convert", src, str(tmp_path / "b.safetensors"), "--strings", "metadata")
    assert out.returncode == 0, out.stderr
    assert f"; {len(result.in_metadata)} string tensors kept in __metadata__" in out.stdout, out.stdout
    assert "left out" not in out.stdout + out.stderr, out.stdout + out.stderr


def test_preset_warns_on_names_it_does_not_recognise(tmp_path: Path) -> None:
    """transformers names given to ``--preset bert``: a warning with the count, examples, and the preset that
    goes the other way, printed once; ``--preset bert-tf`` recognises them all and warns of nothing."""
    src = hf_named(tmp_path)
    out = cli("convert", src, str(tmp_path / "o.npz"), "--preset", "bert")
    assert out.returncode == 0, out.stderr
    warned = [line for line in out.stderr.splitlines() if "does not recognise" in line]
    assert warned == ["warning: --preset bert does not recognise 5 of 5 tensor names, kept as they are "
                      "('bert.embeddings.word_embeddings.weight', 'bert.encoder.layer.0.attention.self.query.weight',"
                      " 'bert.pooler.dense.bias', ...); --preset bert-tf goes the other way"], out.stderr

    result = convert(src, str(tmp_path / "tf" / "ckpt"), dst_format="tf", preset="bert-tf")
    assert result.warnings == []
    back = convert(str(tmp_path / "tf" / "ckpt"), str(tmp_path / "x.npz"), preset="bert-tf")
    assert len(back.warnings) == 1 and "--preset bert-tf does not recognise 5 of 5" in back.warnings[0]
    assert back.warnings[0].endswith("--preset bert goes the other way")


def test_preset_counts_only_the_names_it_misses(tmp_path: Path) -> None:
    npz = str(tmp_path / "mixed.npz")
    np.savez(npz, **{"bert/pooler/dense/kernel": np.ones((2, 2), np.float32), "step": np.int64(3),
                     "my_head/w": np.ones(2, np.float32), "global_step": np.int64(1)})
    result = convert(npz, str(tmp_path / "o.npz"), preset="bert")
    assert result.warnings == ["--preset bert does not recognise 1 of 3 tensor names, kept as they are ('step')"]
