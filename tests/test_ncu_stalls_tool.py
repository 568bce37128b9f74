"""experiments/benchmarks/ncu_stalls.py on a made-up Nsight Compute source-page CSV (the export's shape: a kernel-name
row, then the header, numbers with thousands separators): the ranking, the mbarrier wait loops it recognises (a
try-wait then a branch back on its predicate, and not an unrelated branch), the JSON, and a clear error for a CSV
without the sampling columns."""

import importlib.util
import json
from pathlib import Path

import pytest

_spec = importlib.util.spec_from_file_location("ncu_stalls", Path(__file__).parents[1] / "experiments/benchmarks/ncu_stalls.py")
ncu_stalls = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(ncu_stalls)

HEADER = '"Address","Source","Warp Stall Sampling (All Samples)","Warp Stall Sampling (Not-issued Samples)","# Samples","Instructions Executed"'
ROWS = [
    ("0x10", "SHF.L.U32 R5, R4, 0x1f, RZ", 5, 48768),
    ("0x20", "SYNCS.PHASECHK.TRANS64.TRYWAIT P1, [UR6], R5", 7, 48768),
    ("0x30", "@!P1  BRA 0x500", "1,964", 48768),
    ("0x40", "QGMMA.64x128x32.F32.E4M3.E4M3 R88, gdesc[UR16], R88, gsb0", 28, 48768),
    ("0x50", "ISETP.GE.AND P2, PT, R6, 0x1, PT", 3, 48768),
    ("0x60", "@!P2  BRA 0x700", 300, 48768),
    ("0x70", "WARPGROUP.DEPBAR.LE gsb0, 0x0", 209, 48768),
]


def _csv(tmp_path, header=HEADER):
    lines = ['"Kernel Name","gemm_grouped_fp8_mosaic_gpu_kernel",', header]
    lines += [f'"{a}","      {s}","{n}","0","{n}","{e}"' for a, s, n, e in ROWS]
    p = tmp_path / "rep.csv"
    p.write_text("\n".join(lines) + "\n")
    return p


def test_ranks_instructions_and_finds_barrier_waits(tmp_path, capsys):
    instrs = ncu_stalls.read_source_csv(str(_csv(tmp_path)))
    assert [i["samples"] for i in instrs] == [5, 7, 1964, 28, 3, 300, 209]
    assert ncu_stalls.barrier_wait_branches(instrs) == {2}  # the branch on P2 follows no try-wait
    s = ncu_stalls.summarize(instrs, top=3)
    assert s["total_samples"] == 2516 and s["barrier_wait_samples"] == 1964
    assert [t["index"] for t in s["top"]] == [2, 5, 6] and s["top"][0]["barrier_wait"] and not s["top"][1]["barrier_wait"]
    out = tmp_path / "s.json"
    assert ncu_stalls.main([str(_csv(tmp_path)), "--top", "2", "--context", "1", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "78.1 % in mbarrier wait loops" in text and "<- mbarrier wait" in text
    assert json.loads(out.read_text())["top"][1]["sass"] == "@!P2  BRA 0x700"


def test_csv_without_sampling_columns_names_itself(tmp_path):
    bad = _csv(tmp_path, header='"Address","Source","# Samples","Instructions Executed"')
    with pytest.raises(ValueError, match="Warp Stall Sampling.*SourceCounters"):
        ncu_stalls.read_source_csv(str(bad))
    other = tmp_path / "other.csv"
    other.write_text("a,b\n1,2\n")
    with pytest.raises(ValueError, match="not an ncu --page source --csv export"):
        ncu_stalls.read_source_csv(str(other))
