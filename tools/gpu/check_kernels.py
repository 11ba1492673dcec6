#!/usr/bin/env python3
"""Compiles every kernels/*.cu with NVRTC for sm_90, exactly as vt-cuda does at backend start
(common.cuh prepended, the same options), and prints NVRTC's log: a quick check without cargo or
a GPU, and kernel_sass.py's compile step. (CI compiles through vt-cuda's own code: its unit test
`kernels::tests`.) Needs only libnvrtc (the `nvidia-cuda-nvrtc` wheel); no CUDA headers are used.

usage: check_kernels.py [path/to/libnvrtc.so.13]   (default: found under sys.path's nvidia/)
"""
import ctypes
import glob
import os
import re
import sys

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")
# Keep in step with crates/vt-cuda/src/kernels.rs (`options`); `defines` adds limits.rs's numbers.
OPTIONS = ["--gpu-architecture=sm_90", "--std=c++17", "-default-device"]


def defines():
    """`-DNAME=value` for every number of crates/vt-cuda/src/limits.rs (`NAME: type = value;`
    lines in its `shared!` block, a value a number or an expression of earlier names), as
    vt-cuda passes them."""
    text = open(os.path.join(ROOT, "crates", "vt-cuda", "src", "limits.rs")).read()
    block = text[text.index("shared! {"):]
    values = {}
    for name, expr in re.findall(r"^\s*(\w+): \w+ = (.+);$", block, re.M):
        values[name] = int(eval(re.sub(r"(?<=\d)_(?=\d)", "", expr), {"__builtins__": {}}, dict(values)))
    if not values:
        sys.exit("check_kernels: no numbers found in limits.rs")
    return [f"-D{name}={value}" for name, value in values.items()]


def find_in_wheels(pattern, wheel):
    """The first file matching nvidia/cu*/`pattern` under sys.path (where NVIDIA's PyPI wheels
    unpack), or an exit naming the wheel to install."""
    for base in sys.path:
        hits = sorted(glob.glob(os.path.join(base, "nvidia", "cu*", pattern)))
        if hits:
            return hits[0]
    sys.exit(f"{os.path.basename(sys.argv[0])}: nvidia/cu*/{pattern} not found (pip install {wheel})")


def find_nvrtc(explicit=None):
    return explicit or find_in_wheels(os.path.join("lib", "libnvrtc.so.*"), "nvidia-cuda-nvrtc")


def load_nvrtc(path):
    # NVRTC dlopens its builtins library by soname; load it first from the same folder.
    for builtins in glob.glob(os.path.join(os.path.dirname(path), "libnvrtc-builtins.so.*")):
        ctypes.CDLL(builtins, mode=ctypes.RTLD_GLOBAL)
    return ctypes.CDLL(path)


def source(path):
    """What vt-cuda compiles for kernels/<file>.cu (kernels.rs `source`): common.cuh, then the file
    with each `#include "NAME"` line replaced by kernels/NAME."""
    kernels = os.path.join(ROOT, "kernels")
    lines = [open(os.path.join(kernels, "common.cuh")).read()]
    for line in open(path).read().splitlines():
        m = re.fullmatch(r'#include "(\w+\.cuh)"', line)
        lines.append(open(os.path.join(kernels, m.group(1))).read() if m else line)
    return "\n".join(lines)


def compile_kernel_file(lib, path, extra=()):
    """Compiles kernels/<file>.cu as vt-cuda does (plus `extra` options); returns (status, log,
    program). The caller destroys the program (nvrtcDestroyProgram) when done with it."""
    src = source(path).encode()
    prog = ctypes.c_void_p()
    rc = lib.nvrtcCreateProgram(ctypes.byref(prog), src, os.path.basename(path).encode(), 0, None, None)
    if rc != 0:
        sys.exit(f"nvrtcCreateProgram({path}) = {rc}")
    options = OPTIONS + defines() + list(extra)
    opts = (ctypes.c_char_p * len(options))(*[o.encode() for o in options])
    rc = lib.nvrtcCompileProgram(prog, len(options), opts)
    size = ctypes.c_size_t()
    lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
    log = ctypes.create_string_buffer(size.value)
    lib.nvrtcGetProgramLog(prog, log)
    return rc, log.value.decode(errors="replace").strip(), prog


def main():
    lib = load_nvrtc(find_nvrtc(sys.argv[1] if len(sys.argv) > 1 else None))
    files = sorted(glob.glob(os.path.join(ROOT, "kernels", "*.cu")))
    if not files:
        sys.exit("check_kernels: no kernels/*.cu")
    failed = 0
    for path in files:
        rc, text, prog = compile_kernel_file(lib, path)
        lib.nvrtcDestroyProgram(ctypes.byref(prog))
        status = "ok" if rc == 0 else "FAILED"
        print(f"check_kernels: {os.path.relpath(path, ROOT)}: {status}")
        if text:
            print(text)
        failed += rc != 0
    if failed:
        sys.exit(f"check_kernels: {failed} file(s) failed to compile")


if __name__ == "__main__":
    main()
