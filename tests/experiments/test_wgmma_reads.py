"""`experiments/wgmma_reads.py` on hand-written PTX in the shape Mosaic GPU emits: an accumulator read between a
wgmma and the wait that retires it is found, with its line and source; reads after the wait, reads of other
registers, and groups a partial wait leaves in flight are told apart."""

import os
import sys

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
sys.path.insert(0, os.path.join(ROOT, "experiments"))

import wgmma_reads  # noqa: E402


def wgmma(acc, desc_a="%rd1", desc_b="%rd2"):
    regs = ",".join(acc)
    return ("\t{ .reg .pred p; setp.ne.b32 p, 1, 0; wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 "
            f"{{{regs}}}, {desc_a}, {desc_b}, p, 1, 1, 0, 0; }}")


A = [f"%r{i}" for i in range(10, 14)]
B = [f"%r{i}" for i in range(20, 24)]


def ptx(*lines):
    return "\n".join(lines)


def test_a_negation_hoisted_above_the_wait_is_found():
    text = ptx(
        "\tmov.b32 \t%r10, %r99;",  # initialising before the issue is no hazard
        "\twgmma.fence.sync.aligned;",
        "\t.loc\t1 242 16",
        wgmma(A),
        "\t.loc\t1 247 8",
        "\txor.b32 \t%r50, %r11, -2147483648;",
        "\twgmma.commit_group.sync.aligned;",
        "\twgmma.wait_group.sync.aligned 0;",
        "\tadd.f32 \t%r51, %r12, %r13;",
    )
    count, accesses = wgmma_reads.early_accumulator_accesses(text)
    assert count == 1
    assert [(a.line, a.source, a.registers, a.kind) for a in accesses] == [(6, "1:247", ("%r11",), "read")]


def test_reads_after_the_wait_and_of_other_registers_are_not_reported():
    text = ptx(
        wgmma(A),
        "\tmul.f32 \t%r60, %r30, %r31;",  # not an accumulator
        "\t// xor.b32 %r61, %r10, 1;",  # a comment
        "\twgmma.commit_group.sync.aligned;",
        "\twgmma.wait_group.sync.aligned 0;",
        "\txor.b32 \t%r62, %r10, -2147483648;",
    )
    assert wgmma_reads.early_accumulator_accesses(text) == (1, [])


def test_a_partial_wait_retires_only_the_older_groups():
    text = ptx(
        wgmma(A),
        "\twgmma.commit_group.sync.aligned;",
        wgmma(B),
        "\twgmma.commit_group.sync.aligned;",
        "\twgmma.wait_group.sync.aligned 1;",  # A's group is done, B's may still run
        "\tadd.f32 \t%r70, %r10, %r20;",
        "\tst.shared.f32 \t[%r5], %r21;",  # a store reads its register operands
        "\tmov.b32 \t%r22, %r99;",  # overwriting an accumulator in flight
    )
    count, accesses = wgmma_reads.early_accumulator_accesses(text)
    assert count == 2
    assert [(a.line, a.registers, a.kind) for a in accesses] == [
        (6, ("%r20",), "read"), (7, ("%r21",), "read"), (8, ("%r22",), "write")]


def test_uncommitted_wgmmas_stay_in_flight_across_a_wait():
    text = ptx(wgmma(A), "\twgmma.wait_group.sync.aligned 0;", "\tneg.f32 \t%r80, %r13;")
    _, accesses = wgmma_reads.early_accumulator_accesses(text)
    assert [a.registers for a in accesses] == [("%r13",)]


def test_report_names_the_file_and_counts():
    text = ptx(wgmma(A), "\txor.b32 \t%r50, %r11, 1;", "\twgmma.commit_group.sync.aligned;",
               "\twgmma.wait_group.sync.aligned 0;")
    first = wgmma_reads.report("k.ptx", text).splitlines()
    assert first[0] == "k.ptx: 1 wgmma, 1 accesses to accumulators in flight"
    assert "PTX line 2" in first[1] and "read %r11" in first[1]
