"""How mtprobe._C is linked: against the process's shared libstdc++, with no copy of its own.

On the lent H200's image the compiler's search path held libstdc++.a ahead of any libstdc++.so, and
`-lstdc++` pulled 30 of its stream and locale symbols into _C.so: a second copy whose locale facets are
numbered apart from the process's libstdc++.so.6, so formatting a number into an error message read the
wrong facet and crashed (benchmarks/results/gpu/h200-2026-11-30-night/). CMakeLists.txt links the shared
library by its path first; this checks the built module, and that a message with numbers comes out whole.
"""

from __future__ import annotations

import shutil
import subprocess

import pytest
import torch

from mtprobe import _C

NM = shutil.which("nm")

# std::ostream::_M_insert<long> and std::codecvt<char16_t, char, mbstate_t>::do_unshift: defined by
# libstdc++.so.6, only referenced from a module linked against it.
LIBSTDCXX_SYMBOLS = ("_ZNSo9_M_insertIlEERSoT_", "_ZNKSt7codecvtIDsc11__mbstate_tE10do_unshiftERS0_PcS3_RS3_")


@pytest.mark.skipif(NM is None, reason="nm (binutils) is not on PATH")
def test_the_module_defines_no_libstdcxx_stream_code():
    out = subprocess.run(
        [NM, "-D", "--defined-only", _C.__file__], capture_output=True, text=True, check=True
    ).stdout
    defined = [s for s in LIBSTDCXX_SYMBOLS if s in out]
    assert not defined, f"{_C.__file__} defines libstdc++'s {defined}: it was linked against libstdc++.a"


def test_an_error_message_with_numbers_comes_out_whole():
    x = torch.zeros(3, 64)
    codes = torch.zeros(6, 32, dtype=torch.uint8)
    scale = torch.zeros(6, 1)  # must be [6, 2]
    with pytest.raises(ValueError, match=r"= \[6, 2\], got Float \[6, 1\]"):
        torch.ops.mtprobe.quantized_linear(x, codes, scale, torch.zeros(6, 2), None)
