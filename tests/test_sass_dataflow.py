"""mxfx.kernels.sass_dataflow: HGMMA descriptor registers not written on every path."""
import pytest

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


@pytest.mark.parametrize("pred", ["@P0", "@!P0", "@UP0", "@!UP0", "@PT"])
def test_a_conditional_branch_is_seen_under_every_predicate_spelling(pred):
    """A branch guarded by a negated or a uniform predicate still splits the paths: the taken
    path skips the write of UR14, so the HGMMA is reported."""
    found = unwritten_descriptor_reads(_sass(
        "UMOV UR15, 0x40000040",
        f"{pred} BRA 0x30",
        "UMOV UR14, UR18",
        HGMMA,  # 0x30
        "EXIT",
    ))
    assert len(found) == 1 and found[0].startswith("0x30 HGMMA") and "UR[14]" in found[0]


def test_a_path_that_exits_does_not_reach_the_next_block():
    """The block ending in EXIT (nothing written) does not lead to the HGMMA laid out after it:
    the only path to the MMA writes both registers."""
    assert unwritten_descriptor_reads(_sass(
        "@P0 BRA 0x40",
        "UMOV UR14, UR18",
        "UMOV UR15, 0x40000040",
        "BRA 0x60",
        "NOP",  # 0x40: P0 true, nothing written...
        "EXIT",  # ...and the thread leaves
        HGMMA,  # 0x60: only from 0x30
        "EXIT",
    )) == []


def test_a_wide_write_covers_the_register_pair():
    """A ``.WIDE`` instruction writes URn and URn+1 (a 64-bit result); without it UR15 is unwritten."""
    assert unwritten_descriptor_reads(_sass("UIMAD.WIDE.U32 UR14, UR4, UR5, URZ", HGMMA, "EXIT")) == []
    found = unwritten_descriptor_reads(_sass("UIMAD UR14, UR4, UR5, URZ", HGMMA, "EXIT"))
    assert len(found) == 1 and "UR[15]" in found[0]


@pytest.mark.parametrize("a_in_shared,missing", [(False, 14), (False, 15), (True, 12), (True, 13), (True, 14),
                                                 (True, 15)])
def test_each_descriptor_register_is_required(a_in_shared, missing):
    """Every one of the descriptor registers the HGMMA reads (UR12..UR15 with A in shared
    memory, UR14 and UR15 with A in registers) is reported when it alone is unwritten."""
    mma = "HGMMA.64x64x16.F32.BF16 R24, gdesc[UR12], R24" if a_in_shared else HGMMA
    needed = [12, 13, 14, 15] if a_in_shared else [14, 15]
    writes = [f"UMOV UR{r}, 0x{r:x}" for r in needed if r != missing]
    found = unwritten_descriptor_reads(_sass(*writes, mma, "EXIT"))
    assert len(found) == 1 and f"UR[{missing}]" in found[0]


@pytest.mark.parametrize("brx", ["BRX R2 -0x40", "@P0 BRX R2 -0x40"])
def test_targets_of_an_indirect_branch_start_from_the_state_after_it(brx):
    """A block reached only through a BRX (a jump table) starts with what was written before the
    BRX: both registers here, none in the second program."""
    assert unwritten_descriptor_reads(_sass(
        "UMOV UR14, UR18", "UMOV UR15, 0x40000040", brx, "EXIT", HGMMA, "EXIT")) == []
    found = unwritten_descriptor_reads(_sass("NOP", "NOP", brx, "EXIT", HGMMA, "EXIT"))
    assert len(found) == 1 and "UR[14, 15]" in found[0]


def test_a_loop_back_to_the_entry_still_starts_with_nothing_written():
    """The first block starts from nothing written even when a later branch jumps back to it:
    on the first iteration UR14 is not yet written."""
    found = unwritten_descriptor_reads(_sass(
        "UMOV UR15, 0x40000040", HGMMA, "UMOV UR14, UR18", "@P0 BRA 0x0", "EXIT"))
    assert len(found) == 1 and found[0].startswith("0x10 HGMMA") and "UR[14]" in found[0]


def test_blocks_laid_out_before_their_predecessors():
    """ptxas may place a block before the block that branches to it. Here the path runs
    0x00 → 0x60 → 0x40 → 0x20 and never writes UR14: the analysis iterates until that is known."""
    found = unwritten_descriptor_reads(_sass(
        "UMOV UR15, 0x40000040",
        "BRA 0x60",
        HGMMA,  # 0x20
        "EXIT",
        "NOP",  # 0x40
        "BRA 0x20",
        "NOP",  # 0x60
        "BRA 0x40",
    ))
    assert len(found) == 1 and found[0].startswith("0x20 HGMMA") and "UR[14]" in found[0]


def test_a_block_nothing_branches_to_starts_with_nothing_written():
    """Code the analysis sees no way into (after an EXIT, no branch or BRX to it) is checked
    conservatively, as if nothing had been written before it."""
    found = unwritten_descriptor_reads(_sass("EXIT", "UMOV UR15, 0x40000040", HGMMA, "EXIT"))
    assert len(found) == 1 and found[0].startswith("0x20 HGMMA") and "UR[14]" in found[0]
