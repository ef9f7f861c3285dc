"""``shardckpt inspect PREFIX --map FILE.svg|.html``: the picture of where every stored slice lies.

The SVG is parsed and its rectangles counted and placed; holes and overlaps are checked on
real checkpoints (a DTensor save over a 2 x 4 mesh, a sliced save that leaves a hole) and on
the coverage function directly.
"""

from __future__ import annotations

import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Dict, List

import numpy as np
import pytest

import shardckpt
from shardckpt import dtensor
from shardckpt.cli.shard_map import coverage

SVG = "{http://www.w3.org/2000/svg}"


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "shardckpt.cli.main", *args], capture_output=True, text=True,
                          timeout=120)


def _pieces(svg_path: Path, key: str) -> List[Dict[str, str]]:
    root = ET.parse(svg_path).getroot()
    assert root.tag == SVG + "svg"
    return [r.attrib for r in root.iter(SVG + "rect") if r.get("class") == "piece" and r.get("data-key") == key]


@pytest.fixture(scope="module")
def mesh_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> str:
    folder = tmp_path_factory.mktemp("map")
    mesh = dtensor.create_mesh([("x", 2), ("y", 4)], devices=[f"CPU:{i}" for i in range(8)])
    model = shardckpt.Module()
    model.w = dtensor.DVariable.from_global(np.arange(64 * 96, dtype=np.float32).reshape(64, 96),
                                            dtensor.Layout(["x", "y"], mesh), name="w")
    model.b = dtensor.DVariable.from_global(np.zeros(96, np.float32), dtensor.Layout(["y"], mesh), name="b")
    model.t = dtensor.DVariable.from_global(np.zeros((4, 6, 8), np.float32),
                                            dtensor.Layout(["unsharded", "unsharded", "y"], mesh), name="t")
    return dtensor.DTensorCheckpoint(mesh, model=model).save(str(folder / "ckpt"))


def test_a_two_by_four_mesh_draws_eight_rectangles_at_their_places(mesh_checkpoint: str, tmp_path: Path) -> None:
    out = tmp_path / "map.svg"
    done = _cli("inspect", mesh_checkpoint, "--map", str(out))
    assert done.returncode == 0, done.stderr
    assert "written to" in done.stdout and "holes" not in done.stdout
    pieces = _pieces(out, "model/w/.ATTRIBUTES/VARIABLE_VALUE")
    assert len(pieces) == 8
    assert len({p["data-shard"] for p in pieces}) == 8 and len({p["fill"] for p in pieces}) == 8
    frame_w, frame_h = 480.0, 480.0 * 64 / 96  # wider than tall: 480 across, to scale down
    for p in pieces:  # [x, y] layout: rows split in 2 (mesh x), columns in 4 (mesh y)
        (r0, r1), (c0, c1) = (tuple(int(v) for v in span.split(":")) for span in p["data-box"].split(","))
        assert (r1 - r0, c1 - c0) == (32, 24)
        assert float(p["x"]) == pytest.approx(frame_w * c0 / 96, abs=0.01)
        assert float(p["y"]) == pytest.approx(frame_h * r0 / 64, abs=0.01)
        assert float(p["width"]) == pytest.approx(frame_w * 24 / 96, abs=0.01)
    boxes = sorted(p["data-box"] for p in pieces)
    assert boxes == sorted(f"{r}:{r + 32},{c}:{c + 24}" for r in (0, 32) for c in (0, 24, 48, 72))
    bar = _pieces(out, "model/b/.ATTRIBUTES/VARIABLE_VALUE")  # 1-D: a bar in four parts
    assert len(bar) == 4 and {float(p["height"]) for p in bar} == {18.0}
    rank3 = _pieces(out, "model/t/.ATTRIBUTES/VARIABLE_VALUE")  # cut along axis 2: that axis is drawn
    assert len(rank3) == 4
    root = ET.parse(out).getroot()
    assert len([g for g in root.iter(SVG + "g") if g.get("class") == "legend"]) == 8
    assert not [r for r in root.iter(SVG + "rect") if r.get("class") in ("hole", "overlap")]


def test_keys_choose_the_tensors_and_html_is_one_offline_page(mesh_checkpoint: str, tmp_path: Path) -> None:
    out = tmp_path / "map.html"
    done = _cli("inspect", mesh_checkpoint, "--map", str(out), "--keys", "^model/b/")
    assert done.returncode == 0, done.stderr
    page = out.read_text()
    assert page.startswith("<!DOCTYPE html>") and "<script" not in page and "http://" not in page.replace(
        'xmlns="http://www.w3.org/2000/svg"', "")
    svg = page[page.index("<svg"):page.index("</svg>") + 6]
    root = ET.fromstring(svg)
    keys = {g.get("data-key") for g in root.iter(SVG + "g") if g.get("class") == "tensor"}
    assert keys == {"model/b/.ATTRIBUTES/VARIABLE_VALUE"}


def test_a_hole_is_drawn_in_red_and_reported(tmp_path: Path) -> None:
    prefix = str(tmp_path / "holey")
    # rows 0..2 and 4..6 of a 6 x 4 tensor: rows 2..4 were never stored
    shardckpt.io.save_v2(prefix, ["v", "v"], ["6 4 0,2:-", "6 4 4,2:-"],
                         [np.ones((2, 4), np.float32), np.ones((2, 4), np.float32)])
    out = tmp_path / "map.svg"
    done = _cli("inspect", prefix, "--map", str(out))
    assert done.returncode == 0, done.stderr
    assert "1 with holes or overlaps" in done.stdout
    root = ET.parse(out).getroot()
    holes = [r.attrib for r in root.iter(SVG + "rect") if r.get("class") == "hole"]
    assert [h["data-box"] for h in holes] == ["2:4,0:4"]
    tensor = next(g for g in root.iter(SVG + "g") if g.get("class") == "tensor")
    assert tensor.get("data-ok") == "false" and "HOLES" in "".join(tensor.itertext())


def test_bad_arguments_are_one_error_line(mesh_checkpoint: str, tmp_path: Path) -> None:
    done = _cli("inspect", mesh_checkpoint, "--map", str(tmp_path / "map.png"))
    assert done.returncode == 1 and "must end in .svg or .html" in done.stderr and "Traceback" not in done.stderr
    done = _cli("inspect", mesh_checkpoint, "--map", str(tmp_path / "m.svg"), "--keys", "(")
    assert done.returncode == 1 and "not a regular expression" in done.stderr and "Traceback" not in done.stderr


def test_coverage_finds_holes_and_overlaps_exactly() -> None:
    assert coverage((4, 4), [((0, 4), (0, 4))]).ok
    split = coverage((4, 4), [((0, 2), (0, 4)), ((2, 4), (0, 4))])
    assert split.ok and split.exact
    over = coverage((4, 4), [((0, 3), (0, 4)), ((2, 4), (0, 4))])
    assert over.overlaps == [((2, 3), (0, 4))] and not over.holes
    hole = coverage((4, 4, 2), [((0, 4), (0, 4), (0, 1))])
    assert hole.holes == [((0, 4), (0, 4), (1, 2))]
    assert coverage((), []).holes == [()] and coverage((), [(), ()]).overlaps == [()]
    assert coverage((0, 3), []).ok  # an empty tensor has nothing to cover
