"""experiments/benchmarks/sass.py: opcode counting on real disassembler lines, and the PTX -> SASS path on a tiny
hand-written kernel where this machine has ptxas and cuobjdump/nvdisasm (the GPU image has them; CI may not)."""

import importlib.util
from pathlib import Path

import pytest

_spec = importlib.util.spec_from_file_location("sass_tool", Path(__file__).parents[1] / "experiments/benchmarks/sass.py")
sass = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(sass)

LINES = """
        /*2610*/                   QGMMA.64x128x32.F32.E4M3.E4M3 R88, gdesc[UR12], RZ, !UPT ;   /* 0x01e000000c5879f3 */
                                                                                                /* 0x000ff60008000858 */
        /*2620*/              @!P1 FFMA R53, -R53, R70, R120 ;                                  /* 0x0000004635357223 */
        /*2630*/                   SGXT.U32 R3, R3, 0x1 ;                                       /* 0x000000010303781a */
        /*2640*/              @UP0 UTMALDG.3D [UR8], [UR22] ;                                   /* 0x00000008160005b4 */
"""

PTX = """.version 8.0
.target sm_90a
.address_size 64
.visible .entry k(.param .u64 p){
 .reg .f32 %f<4>; .reg .b64 %rd<3>;
 ld.param.u64 %rd1, [p]; cvta.to.global.u64 %rd2, %rd1;
 ld.global.f32 %f1, [%rd2]; fma.rn.f32 %f2, %f1, %f1, %f1; st.global.f32 [%rd2], %f2; ret; }
"""


def test_count_opcodes_reads_predicated_and_shaped_instructions():
    c = sass.count_opcodes(LINES)
    assert c["total"] == 4  # the encoding-only line is not an instruction
    assert c["by_base"] == {"QGMMA": 1, "FFMA": 1, "SGXT": 1, "UTMALDG": 1}
    assert c["mma"] == {"QGMMA.64x128x32.F32.E4M3.E4M3": 1}


def test_ptx_to_sass_on_a_tiny_kernel(tmp_path):
    tools = sass.find_tools()
    if not tools["ptxas"] or not (tools["cuobjdump"] or tools["nvdisasm"]):
        pytest.skip(f"no ptxas / cuobjdump here: {tools}")
    ptx = tmp_path / "k.ptx"
    ptx.write_text(PTX)
    text, info = sass.disassemble(ptx, tools, tmp_path)
    counts = sass.count_opcodes(text)
    assert counts["by_base"].get("FFMA") == 1 and "registers" in info


def test_unknown_variant_is_a_clear_error(capsys):
    with pytest.raises(SystemExit):
        sass.main(["--variants", "dense_k3"])
    assert "unknown ['dense_k3']" in capsys.readouterr().err
