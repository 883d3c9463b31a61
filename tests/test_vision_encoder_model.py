"""benchmarks/vision_encoder_model.py, the vision encoder's time model: its work per stage counted
by hand from the real tower's dims (docs/vision.md), and its report's lines."""

from __future__ import annotations

import re
import sys
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))
import vision_encoder_model as model  # noqa: E402


def test_images_take_the_preprocessor_grids() -> None:
    assert model.grid(448, 448) == (1, 28, 28)
    assert model.grid(1024, 768) == (1, 48, 64)
    assert model.grid(1920, 1080) == (1, 68, 120)  # 1080 rounds to 1088 pixels


def test_work_per_stage_by_hand() -> None:
    work = {s.name: s for s in model.stages(model.REAL_TOWER, (1, 48, 64))}
    n = 3072
    # q k^T and p v: 2 x 2 x N^2 x 1152 per block, 27 blocks.
    assert work["attention"].flops == 27 * 4 * n * n * 1152
    # fc1: 4304 x 1152 bf16 weights and bias, N x 1152 read, N x 4304 written, 27 blocks.
    assert work["MLP fc1"].flops == 27 * 2 * n * 4304 * 1152
    assert work["MLP fc1"].bytes == 27 * (2 * (4304 * 1152 + 4304) + 4 * n * (1152 + 4304))
    # The merger's fc2 on N / 4 tokens of 4608 values into 2048.
    assert work["merger fc2"].flops == 2 * (n // 4) * 2048 * 4608
    # The residual adds read the output before writing it: proj reads N x 1152 twice.
    assert work["attention proj"].bytes == 27 * (
        2 * (1152 * 1152 + 1152) + 4 * n * (1152 + 2 * 1152)
    )
    # Attention streams K and V (fp32, 72 dims) of all N keys per 32-row block and head.
    kv = 4 * 2 * (n // 32) * 16 * n * 72
    assert work["attention"].bytes == 27 * (kv + 4 * n * 1152 * 2)


def test_report_lines(capsys, monkeypatch) -> None:
    monkeypatch.setattr(sys, "argv", ["vision_encoder_model.py"])
    model.main()
    out = capsys.readouterr().out
    assert "not a measurement" in out
    lines = re.findall(
        r"vision encoder estimate, (\d+)x(\d+) \((\d+) patches, (\d+) tokens\): (M\S+ \S+) "
        r"(\d+) ms \(range (\d+)-(\d+) ms\)",
        out,
    )
    assert len(lines) == len(model.IMAGES) * len(model.GPUS)
    for _, _, patches, tokens, _, central, fast, slow in lines:
        assert int(tokens) * 4 == int(patches)
        assert int(fast) <= int(central) <= int(slow)
