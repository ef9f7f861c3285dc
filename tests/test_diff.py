"""``shardckpt diff`` (and the ``convert``/``inspect --tree`` command lines, progress output)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import shardckpt
from shardckpt.cli.main import main
from shardckpt.cli.progress import progress_bar
from shardckpt.convert import convert, diff

FIXTURES = Path(__file__).parent / "data" / "tf_fixtures"


def test_diff_across_formats_equal_and_different(tmp_path: Path) -> None:
    src = str(FIXTURES / "08_tf1_saver_partitioned" / "model.ckpt-100")
    st = str(tmp_path / "m.safetensors")
    convert(src, st)
    assert diff(src, st).equal
    values = {k: v for k, v in np.load(str(FIXTURES / "08_tf1_saver_partitioned" / "expected.npz")).items()}
    key = sorted(k for k, v in values.items() if v.dtype == np.float32 and v.size > 1)[0]
    values[key] = values[key].copy()
    values[key].reshape(-1)[0] += 1e-3
    values["extra"] = np.zeros(2)
    changed = str(tmp_path / "changed.npz")
    np.savez(changed, **values)
    result = diff(src, changed)
    assert not result.equal and result.only_b == ["extra"] and result.only_a == []
    bad = [t for t in result.tensors if not t.equal]
    assert [t.name for t in bad] == [key] and bad[0].mismatched == 1
    assert bad[0].max_abs == pytest.approx(1e-3, rel=1e-2)
    assert diff(src, changed, atol=2e-3, keys="^(?!extra)").equal
    assert not diff(src, changed, atol=1e-4, keys="^(?!extra)").equal


def test_diff_dtype_shape_nan_and_strings(tmp_path: Path) -> None:
    a, b = str(tmp_path / "a" / "ckpt"), str(tmp_path / "b" / "ckpt")
    shardckpt.save_tensors(a, {"x": np.array([1.0, np.nan, np.inf], np.float32), "s": np.array([b"p", b"q"], object),
                               "d": np.ones(2, np.float32), "sh": np.ones((2, 3))})
    shardckpt.save_tensors(b, {"x": np.array([1.0, np.nan, np.inf], np.float32), "s": np.array([b"p", b"r"], object),
                               "d": np.ones(2, np.float64), "sh": np.ones((3, 2))})
    result = diff(a, b)
    status = {t.name: (t.equal, t.problem) for t in result.tensors}
    assert status["x"] == (True, "")
    assert status["s"][0] is False
    assert status["d"] == (False, "float32[2] vs float64[2]")
    assert status["sh"] == (False, "float64[2, 3] vs float64[3, 2]")


def run_cli(*args: str) -> "subprocess.CompletedProcess[str]":
    return subprocess.run([sys.executable, "-m", "shardckpt.cli.main", *args], capture_output=True, text=True,
                          timeout=120)


def test_cli_convert_and_diff_exit_codes_and_json(tmp_path: Path) -> None:
    src = str(FIXTURES / "01_basic_float32_int64" / "ckpt")
    out = str(tmp_path / "o.safetensors")
    done = run_cli("convert", src, out, "--json")
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert report["dest_format"] == "safetensors" and report["tensors"] == 7
    assert report["left_out"] == ["_CHECKPOINTABLE_OBJECT_GRAPH"]
    same = run_cli("diff", src, out, "--keys", "VARIABLE_VALUE")
    assert same.returncode == 0 and "EQUAL" in same.stdout
    differ = run_cli("diff", src, out, "--json")
    assert differ.returncode == 1
    assert json.loads(differ.stdout)["only_a"] == ["_CHECKPOINTABLE_OBJECT_GRAPH"]
    assert differ.stderr == ""  # not a terminal: no progress output


def test_cli_refusals_are_errors_not_tracebacks(tmp_path: Path) -> None:
    src = str(FIXTURES / "02_all_numeric_dtypes" / "ckpt")
    done = run_cli("convert", src, str(tmp_path / "o.safetensors"))
    assert done.returncode == 1 and "Traceback" not in done.stderr
    assert "complex" in done.stderr and "--dtype" in done.stderr
    assert os.listdir(tmp_path) == []
    done = run_cli("convert", src, str(tmp_path / "o"))
    assert done.returncode == 1 and "--to" in done.stderr


def test_cli_options_reach_the_conversion(tmp_path: Path) -> None:
    src = str(tmp_path / "s.npz")
    np.savez(src, **{"a/kernel": np.arange(6, dtype=np.float32).reshape(2, 3), "a/slot_m": np.ones(2)})
    mapping = tmp_path / "map.json"
    mapping.write_text(json.dumps({"a/kernel": "dense.weight"}))
    out = str(tmp_path / "o.npz")
    assert main(["convert", src, out, "--drop", "slot", "--map", str(mapping), "--transpose", "kernel",
                 "--rename", "^dense=layer", "--dtype", "float64"]) == 0
    got = dict(np.load(out))
    assert list(got) == ["layer.weight"] and got["layer.weight"].dtype == np.float64
    assert np.array_equal(got["layer.weight"], np.arange(6, dtype=np.float64).reshape(2, 3).T)


def test_inspect_tree(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["inspect", "--tree", str(FIXTURES / "04_nested_object_graph_save")]) == 0
    text = capsys.readouterr().out
    assert text.splitlines()[0].startswith("15 tensors")
    assert "├── model/  12 tensors" in text and "shared_kernel/.ATTRIBUTES/VARIABLE_VALUE  float32[4, 3]  48 B" in text
    assert main(["inspect", "--tree", "--json", str(FIXTURES / "04_nested_object_graph_save")]) == 0
    tree = json.loads(capsys.readouterr().out)
    assert tree["tensors"] == 15 and {c["name"] for c in tree["children"]} >= {"model", "step", "save_counter"}


def test_progress_is_silent_or_line_oriented_off_a_terminal(tmp_path: Path) -> None:
    import io

    quiet = io.StringIO()
    with progress_bar("convert", 10, stream=quiet) as advance:
        advance("a", 5)
    assert quiet.getvalue() == ""
    lines = io.StringIO()
    with progress_bar("convert", 10, stream=lines, lines=True) as advance:
        advance("a", 5)
        advance("b", 5)
    assert lines.getvalue().splitlines() == ["convert: a: 5 bytes", "convert: b: 5 bytes"]


def test_progress_draws_a_rich_bar_on_a_terminal() -> None:
    import pty

    leader, follower = pty.openpty()
    try:
        with open(follower, "w", closefd=False) as tty:
            with progress_bar("convert", None, stream=tty) as advance:
                advance.set_total(100)  # type: ignore[attr-defined]
                advance("layer/kernel", 50)
                advance("layer/bias", 50)
            tty.flush()
        os.set_blocking(leader, False)
        data = b""
        try:
            while True:
                chunk = os.read(leader, 65536)
                if not chunk:
                    break
                data += chunk
        except (BlockingIOError, OSError):
            pass
    finally:
        os.close(leader)
        os.close(follower)
    assert b"convert" in data and b"\x1b[" in data  # drawn with terminal control sequences


def test_inspect_tree_of_an_hf_folder(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    src = str(tmp_path / "s.npz")
    np.savez(src, **{"bert.encoder.layer.0.weight": np.ones((4, 4), np.float32),
                     "bert.encoder.layer.1.weight": np.ones((4, 4), np.float32), "cls.bias": np.ones(3)})
    convert(src, str(tmp_path / "hf"), dst_format="hf")
    assert main(["inspect", "--tree", str(tmp_path / "hf")]) == 0
    text = capsys.readouterr().out
    assert text.splitlines()[0] == "3 tensors, 152 bytes (152 B)"
    assert "bert.encoder.layer.  2 tensors  128 B" in text and "cls.bias  float64[3]  24 B" in text


def test_diff_is_bit_for_bit_by_default_and_by_value_on_request(tmp_path: Path) -> None:
    quiet_nan = np.array([np.nan], np.float32)
    other_nan = quiet_nan.view(np.uint32) | np.uint32(1)  # the same NaN, another payload
    a, b = str(tmp_path / "a" / "ckpt"), str(tmp_path / "b" / "ckpt")
    shardckpt.save_tensors(a, {"z": np.array([0.0, 1.0], np.float32), "n": quiet_nan, "same": np.arange(3)})
    shardckpt.save_tensors(b, {"z": np.array([-0.0, 1.0], np.float32), "n": other_nan.view(np.float32),
                               "same": np.arange(3)})
    bits = {t.name: t for t in diff(a, b).tensors}
    assert not bits["z"].equal and bits["z"].mismatched == 1 and bits["z"].bits_only and bits["z"].max_abs == 0
    assert not bits["n"].equal and bits["n"].bits_only
    assert bits["same"].equal
    assert diff(a, b, numeric=True).equal
    assert diff(a, b, atol=1e-9).equal  # a tolerance compares values


def test_cli_diff_exit_status_is_diffs_0_same_1_different_2_trouble(tmp_path: Path) -> None:
    a, b, c = (str(tmp_path / n / "ckpt") for n in "abc")
    shardckpt.save_tensors(a, {"z": np.array([0.0, 1.0], np.float32)})
    shardckpt.save_tensors(b, {"z": np.array([-0.0, 1.0], np.float32)})
    shardckpt.save_tensors(c, {"z": np.array([0.0, 1.0], np.float32)})
    assert run_cli("diff", a, c).returncode == 0
    different = run_cli("diff", a, b)
    assert different.returncode == 1 and "bits only" in different.stdout and "bit for bit" in different.stdout
    assert run_cli("diff", a, b, "--numeric").returncode == 0
    assert run_cli("diff", a, b, "--tolerance", "0").returncode == 1  # a zero tolerance is still bits
    missing = run_cli("diff", a, str(tmp_path / "nowhere" / "ckpt"))
    assert missing.returncode == 2 and missing.stderr.startswith("error: ") and "Traceback" not in missing.stderr
    bad_regex = run_cli("diff", a, c, "--keys", "(")
    assert bad_regex.returncode == 2 and "not a regular expression" in bad_regex.stderr
    assert "Traceback" not in bad_regex.stderr
    garbage = tmp_path / "garbage.index"
    garbage.write_bytes(b"\x00" * 100)
    assert run_cli("diff", a, str(tmp_path / "garbage")).returncode == 2
