"""Which cells `make test-portability` runs (tests/portability.py): every level the CPU offers below its own, its own
only where it differs from `native`, at 1 thread; the lowest at 2 threads too."""

from portability import cells, offered_levels

AVX2_EPYC = {"avx", "avx2", "fma", "f16c"}
AVX512_XEON = AVX2_EPYC | {"avx512f", "avx512bw", "avx512_vnni", "avx512_bf16", "amx_bf16", "amx_tile"}
AVX512_PLAIN = AVX2_EPYC | {"avx512f", "avx512bw"}


def test_a_cap_at_the_cpus_own_level_is_native_unless_an_extension_lies_above_it():
    assert offered_levels("AVX2", AVX2_EPYC) == ["default", "native"]  # avx2 cell == native on this CPU
    assert offered_levels("AVX512", AVX512_XEON) == ["default", "avx2", "avx512", "native"]  # AMX/bf16 above the cap
    assert offered_levels("AVX512", AVX512_PLAIN) == ["default", "avx2", "native"]
    assert offered_levels("AVX2", set()) == ["default", "avx2", "native"]  # flags unknown: keep every level
    assert offered_levels("DEFAULT", AVX2_EPYC) == ["default", "native"]


def test_cells_leave_out_make_tests_own():
    # make test runs native at one thread per worker (the Makefile's TEST_THREADS): the lowest level at 1 and 2 left
    assert cells(["default", "native"], [1, 2], 1, every=False) == [("default", 1), ("default", 2)]
    assert cells(["default", "avx2", "native"], [1, 2], 1, every=True) == [
        ("default", 1), ("avx2", 1), ("default", 2), ("avx2", 2), ("native", 2)]
    # a make test at two threads (TEST_THREADS=2) leaves its own cell out, and native at 1 comes back
    assert cells(["default", "native"], [1, 2], 2, every=False) == [("default", 1), ("native", 1), ("default", 2)]


def test_make_test_threads_is_the_makefiles(monkeypatch):
    import re
    from pathlib import Path

    from portability import make_test_threads

    makefile = (Path(__file__).resolve().parents[1] / "Makefile").read_text()
    default = re.search(r"^export TEST_THREADS \?= (\d+)$", makefile, re.M)
    assert default and "OMP_NUM_THREADS=$(TEST_THREADS)" in makefile  # make test's workers run at it
    monkeypatch.delenv("TEST_THREADS", raising=False)
    assert make_test_threads() == int(default.group(1))
    monkeypatch.setenv("TEST_THREADS", "2")
    assert make_test_threads() == 2
