"""The torch-free C++ core (csrc/core) through its own unit-test programs, tests/core/test_*.cpp.

Each program is compiled with no torch include paths at all, which is what proves the core is torch-free.
Every program runs under AddressSanitizer (with LeakSanitizer) and UndefinedBehaviorSanitizer, where the
compiler has their runtimes: any report fails the test (-fno-sanitize-recover=all). That build has the
plain one's flags (-O1 -Wall -Wextra -Werror; the programs' own code at -O0, see TEST_PROGRAMS_AT_O1)
plus the sanitizers', so the plain build runs only where the sanitizers do not work (with a warning):
building both doubled the cost for no check.
A session fixture compiles the core and links every program on one pool of CPU-count workers before the
first test; each parametrized test checks its own program's build and runs it.
"""

from __future__ import annotations

import functools
import os
import re
import shutil
import subprocess
import tempfile
import warnings
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parent.parent
CORE_SOURCES = sorted((REPO_ROOT / "csrc" / "core").glob("*.cpp"))
TEST_SOURCES = sorted((REPO_ROOT / "tests" / "core").glob("test_*.cpp"))
CXX = shutil.which("g++") or shutil.which("c++")
CXXFLAGS = ["-std=c++17", "-O1", "-Wall", "-Wextra", "-Werror", "-pthread"]
SANITIZE = "address,undefined"
# -O1, line tables (-g1: file:line in every report frame, without -g's variable info, which costs
# about an eighth of the compile) and frame pointers; no recovery: the first report aborts.
SANITIZER_FLAGS = [f"-fsanitize={SANITIZE}", "-fno-omit-frame-pointer", "-fno-sanitize-recover=all", "-g1"]
# The test programs' own code compiles at -O0, which halves their sanitized compile (about 50 s of CPU to
# 21 s); the core they exercise stays at -O1. Not the programs whose own code does heavy work, where
# -O0 would cost more time than it saves: test_draft_tree_expand's reference trees over millions of
# candidates run 30 s at -O1 and 54 s at -O0.
TEST_PROGRAMS_AT_O1 = frozenset({"test_draft_tree_expand"})
ASAN_OPTIONS = (
    "detect_leaks=1:detect_stack_use_after_return=1:check_initialization_order=1:strict_init_order=1"
)
UBSAN_OPTIONS = "print_stacktrace=1:halt_on_error=1"


def _flags(sanitize: str | None) -> tuple[str, ...]:
    return tuple(CXXFLAGS + (SANITIZER_FLAGS if sanitize else []))


def _program_flags(flags: tuple[str, ...], test_source: Path) -> tuple[str, ...]:
    """flags for a tests/core program's own source: -O0 in place of -O1, but for TEST_PROGRAMS_AT_O1."""
    if test_source.stem in TEST_PROGRAMS_AT_O1:
        return flags
    return tuple("-O0" if f == "-O1" else f for f in flags)


@functools.cache
def sanitizer_env() -> tuple[dict[str, str] | None, str]:
    """(environment for sanitized programs, "") where the sanitizers work here, else (None, why not).

    Probes with a trivial program: the runtimes may be missing (no libasan / libubsan), and LeakSanitizer
    needs ptrace, which some containers forbid; then leaks go unchecked (detect_leaks=0, with a warning)
    and the rest still runs.
    """
    if CXX is None:
        return None, "no C++ compiler found"
    with tempfile.TemporaryDirectory(prefix="mtprobe_sanitizer_probe_") as tmp:
        src, exe = Path(tmp) / "probe.cpp", Path(tmp) / "probe"
        src.write_text("#include <vector>\nint main() { std::vector<int> v(4, 1); return v[3] - 1; }\n")
        cmd = [CXX, *_flags(SANITIZE), str(src), "-o", str(exe)]
        built = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
        if built.returncode != 0:
            return (
                None,
                f"{CXX} cannot build with -fsanitize={SANITIZE}: {(built.stderr or built.stdout)[:300]}",
            )
        env = {**os.environ, "ASAN_OPTIONS": ASAN_OPTIONS, "UBSAN_OPTIONS": UBSAN_OPTIONS}
        ran = subprocess.run([str(exe)], capture_output=True, text=True, timeout=60, env=env)
        if ran.returncode != 0 and "LeakSanitizer" in ran.stderr:
            env["ASAN_OPTIONS"] = ASAN_OPTIONS.replace("detect_leaks=1", "detect_leaks=0")
            ran = subprocess.run([str(exe)], capture_output=True, text=True, timeout=60, env=env)
            if ran.returncode == 0:
                warnings.warn(
                    f"LeakSanitizer does not work here, leaks go unchecked: {ran.stderr[:200]}", stacklevel=2
                )
        if ran.returncode != 0:
            return None, f"a sanitized trivial program fails here ({ran.returncode}): {ran.stderr[:300]}"
    return env, ""


def _compile_object(flags: tuple[str, ...], src: Path, obj: Path) -> subprocess.CompletedProcess:
    """Compiles one csrc/core source to obj."""
    cmd = [CXX, *flags, "-I", str(REPO_ROOT / "csrc"), "-c", str(src), "-o", str(obj)]
    return subprocess.run(cmd, cwd=REPO_ROOT, capture_output=True, text=True, timeout=300)


def _link_program(
    flags: tuple[str, ...], objects: list[Path], test_source: Path, exe: Path
) -> subprocess.CompletedProcess:
    """Compiles one tests/core program (at :func:`_program_flags`) and links it with the core objects."""
    cmd = [
        CXX,
        *_program_flags(flags, test_source),
        "-I",
        str(REPO_ROOT / "csrc"),
        *map(str, objects),
        str(test_source),
        "-o",
        str(exe),
    ]
    return subprocess.run(cmd, cwd=REPO_ROOT, capture_output=True, text=True, timeout=300)


@pytest.fixture(scope="session")
def programs(tmp_path_factory: pytest.TempPathFactory) -> Callable[[Path], Path]:
    """Builds every tests/core program with the sanitizer flags where the sanitizers work here, else with
    the plain flags, all compiles and links at once on CPU-count workers; returns a lookup
    test program -> executable that fails with the compiler's output if its build failed.

    csrc/core/*.cpp compiles once; the programs link as soon as its objects are done.
    """
    flags = _flags(SANITIZE if sanitizer_env()[0] is not None else None)
    links: dict[Path, tuple[Path, Future[subprocess.CompletedProcess]]] = {}
    with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
        out = tmp_path_factory.mktemp("core_objects")
        objects = [out / f"{src.stem}.o" for src in CORE_SOURCES]
        compiles = [
            pool.submit(_compile_object, flags, src, obj)
            for src, obj in zip(CORE_SOURCES, objects, strict=True)
        ]
        results = [future.result() for future in compiles]
        core_errors = "\n".join(
            f"$ {' '.join(r.args)}\n{r.stdout}{r.stderr}" for r in results if r.returncode != 0
        )
        if not core_errors:
            out = tmp_path_factory.mktemp("programs")
            for test_source in TEST_SOURCES:
                exe = out / test_source.stem
                links[test_source] = (exe, pool.submit(_link_program, flags, objects, test_source, exe))

    def program(test_source: Path) -> Path:
        assert not core_errors, f"compiling csrc/core failed:\n{core_errors}"
        exe, future = links[test_source]
        built = future.result()
        assert built.returncode == 0, (
            f"compiling the core tests failed ({built.returncode}):\n$ {' '.join(built.args)}\n"
            f"{built.stdout}{built.stderr}"
        )
        return exe

    return program


@pytest.mark.skipif(CXX is None, reason="no C++ compiler found (neither g++ nor c++ is on PATH)")
@pytest.mark.parametrize("test_source", TEST_SOURCES, ids=lambda p: p.stem)
def test_core_cpp(
    test_source: Path,
    tmp_path: Path,
    programs: Callable[[Path], Path],
) -> None:
    assert CORE_SOURCES, f"no C++ sources under {REPO_ROOT / 'csrc' / 'core'}"
    env, why_not = sanitizer_env()
    if env is None:
        warnings.warn(f"the core tests run without sanitizers: {why_not}", stacklevel=1)
    exe = programs(test_source)

    ran = subprocess.run([str(exe)], cwd=tmp_path, capture_output=True, text=True, timeout=300, env=env)
    output = ran.stdout + ran.stderr
    lines = output.strip().splitlines()
    assert ran.returncode == 0, f"{test_source.name} exited with {ran.returncode}:\n{output}"
    # Sanitizer reports go to stderr; with halt_on_error they also fail the exit code, but a report
    # from a runtime that recovers anyway must not pass silently.
    assert re.search(r"ERROR: \w*Sanitizer|runtime error:", output) is None, output
    last = lines[-1] if lines else ""
    summary = re.fullmatch(r"(\d+) passed, (\d+) failed", last)
    assert summary is not None, f"last line is not `N passed, M failed`: {last!r}\n{output}"
    assert summary.group(2) == "0", f"{last}:\n{output}"


def test_programs_at_o1_are_programs() -> None:
    # A renamed program would silently drop to -O0 and slow the suite down.
    missing = TEST_PROGRAMS_AT_O1 - {p.stem for p in TEST_SOURCES}
    assert not missing, f"TEST_PROGRAMS_AT_O1 names no tests/core program: {sorted(missing)}"
