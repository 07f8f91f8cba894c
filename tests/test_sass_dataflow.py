"""mxfx.kernels.sass_dataflow: HGMMA descriptor registers not written on every path."""
from mxfx.kernels.sass_dataflow import unwritten_descriptor_reads


def _sass(*instructions: str) -> str:
    """cuobjdump-like SASS, one instruction per 16 bytes (with its encoding line under it)."""
    return "\n".join(f"        /*{16 * i:04x}*/                   {text} ;\n"
                     f"                                                  /* 0x000fe20000000000 */"
                     for i, text in enumerate(instructions))


HGMMA = "HGMMA.64x64x16.F32.BF16 R24, R88, gdesc[UR12], R24"  # B's descriptor: UR14, UR15


def test_written_on_both_branches():
    assert unwritten_descriptor_reads(_sass(
        "@P0 BRA 0x40",
        "UMOV UR14, UR18",
        "UMOV UR15, 0x40000040",
        "BRA 0x60",
        "UIADD3.64 UR14, UR18, 0x2, URZ",  # 0x40: both registers of the pair
        "NOP",
        HGMMA,  # 0x60
        "EXIT",
    )) == []


def test_one_branch_leaves_the_descriptor_stale():
    found = unwritten_descriptor_reads(_sass(
        "UMOV UR15, 0x40000040",
        "@P0 BRA 0x40",
        "UMOV UR14, UR18",
        "BRA 0x50",
        "NOP",  # 0x40: UR14 never written on this path
        HGMMA,  # 0x50
        "EXIT",
    ))
    assert len(found) == 1 and found[0].startswith("0x50 HGMMA") and "UR[14]" in found[0]


def test_a_predicated_write_does_not_count():
    found = unwritten_descriptor_reads(_sass("@UP0 UMOV UR14, UR18", "UMOV UR15, 0x40000040", HGMMA, "EXIT"))
    assert len(found) == 1 and "UR[14]" in found[0]


def test_loop_write_after_the_mma_misses_the_first_iteration():
    loop = ["UMOV UR15, 0x40000040", HGMMA, "UMOV UR14, UR18", "@P0 BRA 0x10", "EXIT"]
    assert len(unwritten_descriptor_reads(_sass(*loop))) == 1
    assert unwritten_descriptor_reads(_sass("UMOV UR14, UR18", *loop)) == []


def test_a_in_shared_memory_needs_all_four_registers():
    mma = "HGMMA.64x64x16.F32.BF16 R24, gdesc[UR12], R24"
    found = unwritten_descriptor_reads(_sass("ULDC.64 UR14, c[0x0][0x210]", mma, "EXIT"))
    assert len(found) == 1 and "UR[12, 13]" in found[0]
    assert unwritten_descriptor_reads(_sass("ULDC.64 UR12, c[0x0][0x208]", "ULDC.64 UR14, c[0x0][0x210]", mma,
                                            "EXIT")) == []
