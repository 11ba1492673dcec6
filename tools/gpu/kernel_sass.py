#!/usr/bin/env python3
"""Registers, spills and machine code (SASS) of vt's kernels, here, without a GPU: compiles
kernels/FILE.cu to an sm_90 cubin as vt-cuda does (check_kernels.py), then prints ptxas' resource
lines and an opcode histogram for each kernel, or with KERNEL that kernel's whole disassembly.
What a hot loop spends its issue slots on shows here before any device time is spent: this is how
the 64-bit address arithmetic around every ldmatrix of the prefill kernels was found.

Needs libnvrtc (as check_kernels.py: .ci/run installs it into target/nvrtc) and nvdisasm in a
folder of its own (both wheels unpack into nvidia/):
  pip install --no-deps --target target/nvdisasm nvidia-cuda-nvdisasm

usage: PYTHONPATH=target/nvrtc:target/nvdisasm tools/gpu/kernel_sass.py FILE.cu [KERNEL]
"""
import collections
import ctypes
import os
import re
import subprocess
import sys
import tempfile

from check_kernels import ROOT, compile_kernel_file, find_in_wheels, find_nvrtc, load_nvrtc


def cubin(lib, path):
    rc, log, prog = compile_kernel_file(lib, path, ["--ptxas-options=-v"])
    if rc != 0:
        sys.exit(f"kernel_sass: {path} does not compile:\n{log}")
    size = ctypes.c_size_t()
    lib.nvrtcGetCUBINSize(prog, ctypes.byref(size))
    buf = ctypes.create_string_buffer(size.value)
    lib.nvrtcGetCUBIN(prog, buf)
    lib.nvrtcDestroyProgram(ctypes.byref(prog))
    return buf.raw, log


def main():
    args = sys.argv[1:]
    if not args:
        sys.exit(__doc__)
    path = os.path.join(ROOT, "kernels", os.path.basename(args[0]))
    binary, log = cubin(load_nvrtc(find_nvrtc()), path)
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(binary)
        f.flush()
        nvdisasm = find_in_wheels(os.path.join("bin", "nvdisasm"), "nvidia-cuda-nvdisasm")
        sass = subprocess.run([nvdisasm, "-c", f.name], check=True, capture_output=True, text=True).stdout
    # Sections ".text.<kernel>:" hold each kernel's instructions.
    kernels = collections.OrderedDict()
    name = None
    for line in sass.splitlines():
        m = re.match(r"^\.text\.(\w+):", line)
        if m:
            name = m.group(1)
            kernels[name] = []
        elif name:
            kernels[name].append(line)
    if len(args) > 1:
        if args[1] not in kernels:
            sys.exit(f"kernel_sass: no kernel {args[1]} in {args[0]}")
        print("\n".join(kernels[args[1]]))
        return
    # ptxas -v: "Compiling entry function 'K'", then its spill line, then "Used N registers".
    resources, name = {}, None
    for line in log.splitlines():
        m = re.search(r"entry function '(\w+)'", line)
        if m:
            name = m.group(1)
        m = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", line)
        if m and name:
            resources[name] = f"spills {m.group(1)}/{m.group(2)} B"
        m = re.search(r"Used (\d+) registers", line)
        if m and name:
            resources[name] = f"{m.group(1)} registers, " + resources.get(name, "")
    opcode = re.compile(r"^\s+/\*[0-9a-f]+\*/\s+(?:@!?U?P[0-9T] )?([A-Z][A-Z0-9_]*)")
    for name, lines in kernels.items():
        ops = collections.Counter(m.group(1) for m in map(opcode.match, lines) if m)
        top = ", ".join(f"{op} {n}" for op, n in ops.most_common(12))
        print(f"{name} ({resources.get(name, '?')}): {sum(ops.values())} instructions: {top}")

if __name__ == "__main__":
    main()
