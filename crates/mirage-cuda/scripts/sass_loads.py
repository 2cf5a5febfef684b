#!/usr/bin/env python3
"""How many global loads a kernel has in flight before it uses one, read from
its SASS (no GPU needed).

The decode kernels here are latency chains, so what matters is how many loads
ptxas actually issues before the first instruction that waits on one of them,
not how many the source meant to batch: in the twelfth session this showed the
router's projection and the f16 decode attention's key loads going out one to
eight at a time where the source asked for 16-32 (crates/mirage-cuda/NOTES.md).

usage: sass_loads.py MODULE KERNEL [KERNEL ...] [-D NAME=VALUE ...]
       sass_loads.py MODULE --diff OTHER_TREE [-D NAME=VALUE ...]
  MODULE: dense | sparse | vk_interop — the sources concatenated as the crate
  does (module.rs DENSE_SOURCE, sparse_backend.rs SOURCE, vk_interop.rs
  SOURCE; the file lists are read from those Rust files), compiled for sm_90
  with the crate's NVRTC options; -D puts `#define NAME VALUE` in front, as
  module::with_env_defines does for the MIRAGE_CUDA_* switches.

--diff compiles the module from this tree and from OTHER_TREE (another
checkout, e.g. `git worktree add /tmp/head HEAD`) and lists the kernels whose
SASS differs: a refactor that should not change the code is checked that way
(the same SASS, so the same bits on the GPU).

Prints per kernel its registers and spills (ptxas -v) and a signature of its
instruction stream: `L<n>` = n global loads in a row, `u` = an instruction
that reads a register an outstanding load writes (it waits for that load),
`|W|` warp sync, `|B|` block barrier. `L29 u` means 29 loads in flight before
the first wait; `LuLuLu` means one at a time.

Needs NVRTC 13 and nvdisasm (no GPU): pip install --user "nvidia-cuda-nvrtc>=13,<14"
"nvidia-cuda-nvdisasm>=13,<14", or set NVRTC_LIB / NVDISASM to a CUDA toolkit's.
"""
import ctypes
import glob
import os
import re
import subprocess
import sys
import tempfile

ROOT = os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", ".."))
MODULES = {
    "dense": ("crates/mirage-cuda/src/module.rs", "DENSE_SOURCE"),
    "sparse": ("crates/mirage-cuda/src/sparse_backend.rs", "SOURCE"),
    "vk_interop": ("crates/mirage-cuda/src/vk_interop.rs", "SOURCE"),
}
OPTIONS = ["--std=c++17", "-default-device", "--gpu-architecture=sm_90"]  # module.rs OPTIONS + the H200's arch


def find(env, pattern):
    if os.environ.get(env):
        return os.environ[env]
    hits = sorted(glob.glob(os.path.expanduser(pattern)))
    if not hits:
        sys.exit(f"sass_loads.py: {env} not set and nothing matches {pattern} (see the install line in --help)")
    return hits[-1]


def module_source(name, defines):
    rust, const = MODULES[name]
    text = open(os.path.join(ROOT, rust)).read()
    m = re.search(r"const %s: &str = concat!\((.*?)\);" % const, text, re.S)
    if not m:
        sys.exit(f"sass_loads.py: no `const {const}: &str = concat!(...)` in {rust}")
    files = re.findall(r'include_str!\("\.\./\.\./\.\./(cuda/[\w.]+)"\)', m.group(1))
    src = "".join(f"#define {k} {v}\n" for k, v in defines)
    return src + "\n".join(open(os.path.join(ROOT, f)).read() for f in files)


def compile_cubin(lib, src):
    prog = ctypes.c_void_p()
    if lib.nvrtcCreateProgram(ctypes.byref(prog), src.encode(), b"module.cu", 0, None, None):
        sys.exit("nvrtcCreateProgram failed")
    opts = OPTIONS + ["--ptxas-options=-v"]
    arr = (ctypes.c_char_p * len(opts))(*[o.encode() for o in opts])
    rc = lib.nvrtcCompileProgram(prog, len(opts), arr)
    n = ctypes.c_size_t()
    lib.nvrtcGetProgramLogSize(prog, ctypes.byref(n))
    log = ctypes.create_string_buffer(n.value)
    lib.nvrtcGetProgramLog(prog, log)
    if rc:
        sys.exit(log.value.decode())
    lib.nvrtcGetCUBINSize(prog, ctypes.byref(n))
    cubin = ctypes.create_string_buffer(n.value)
    lib.nvrtcGetCUBIN(prog, cubin)
    return cubin.raw, log.value.decode()


def registers(log, kernel):
    m = re.search(r"Compiling entry function '%s'.*?Used (\d+) registers" % re.escape(kernel), log, re.S)
    s = re.search(r"Compiling entry function '%s'.*?(\d+) bytes spill stores" % re.escape(kernel), log, re.S)
    return (m.group(1) if m else "?"), (s.group(1) if s else "?")


def signature(sass):
    out, pending = [], set()
    for line in sass.splitlines():
        m = re.search(r"/\*[0-9a-f]{4,}\*/\s+(.*?);", line)
        if not m:
            continue
        ins = re.sub(r"^@!?U?P\w+\s+", "", m.group(1))
        op, _, args = ins.partition(" ")
        regs = [[int(r) for r in re.findall(r"\bR(\d+)\b", a)] for a in args.split(",")]
        if op.startswith("BAR"):
            out.append("|B|")
        elif op.startswith("WARPSYNC"):
            out.append("|W|")
        sources = [r for part in (regs[1:] if not op.startswith(("ST", "RED", "ATOM")) else regs) for r in part]
        if pending and any(r in pending for r in sources):
            out.append("u")
            pending.clear()
        if op.startswith("LDG"):
            out.append("L")
            width = 4 if ".128" in op else 2 if ".64" in op else 1
            if regs and regs[0]:
                pending.update(range(regs[0][0], regs[0][0] + width))
    text = "".join(out)
    return re.sub(r"L{2,}", lambda m: "L%d " % len(m.group()), text)


def disassemble(lib, nvdisasm, module, defines):
    """(nvdisasm's SASS text, ptxas's log) of MODULE compiled from ROOT."""
    cubin, log = compile_cubin(lib, module_source(module, defines))
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        r = subprocess.run([nvdisasm, f.name], capture_output=True, text=True)
    if r.returncode:
        sys.exit(f"nvdisasm failed: {r.stderr.strip()[:300]}")
    return r.stdout, log


def sections(sass):
    """{kernel: its text section of nvdisasm's output, as printed}."""
    return {m.group(1): m.group(2) for m in re.finditer(r"\.text\.(\w+):\n(.*?)(?=\n\s*\.section|\Z)", sass, re.S)}


def kernel_sass(lib, nvdisasm, module, defines):
    """{kernel: SASS text without its addresses} of MODULE compiled from ROOT."""
    sass, _ = disassemble(lib, nvdisasm, module, defines)
    out = {}
    for kernel, text in sections(sass).items():
        text = re.sub(r"/\*[0-9a-f]{4,}\*/", "", text)
        text = re.sub(r"(?m)^\s*//-+ \.text\..*$", "", text)  # the next section's banner
        # Labels and helper names are numbered module-wide: renumber per kernel.
        names = {}
        text = re.sub(r"\.L_x_\d+", lambda l: names.setdefault(l.group(), ".L%d" % len(names)), text)
        out[kernel] = re.sub(r"__internal_\d+_", "__internal_", text)
    return out


def diff(lib, nvdisasm, module, defines, other):
    global ROOT
    here = kernel_sass(lib, nvdisasm, module, defines)
    ROOT = os.path.abspath(other)
    there = kernel_sass(lib, nvdisasm, module, defines)
    for k in sorted(set(here) | set(there)):
        if k not in there:
            print(f"{k}: only in this tree")
        elif k not in here:
            print(f"{k}: only in {other}")
        elif here[k] != there[k]:
            print(f"{k}: SASS differs")
    same = sum(1 for k in here if here[k] == there.get(k))
    print(f"{same} of {len(here)} kernels of the {module} module have the same SASS in both trees")


def main():
    args = sys.argv[1:]
    if len(args) < 2 or args[0] in ("-h", "--help") or args[0] not in MODULES:
        sys.exit(__doc__)
    defines, names, other, i = [], [], None, 1
    while i < len(args):
        if args[i] == "-D" and i + 1 < len(args):
            k, _, v = args[i + 1].partition("=")
            defines.append((k, v or "1"))
            i += 2
        elif args[i] == "--diff" and i + 1 < len(args):
            other = args[i + 1]
            i += 2
        else:
            names.append(args[i])
            i += 1
    lib = ctypes.CDLL(find("NVRTC_LIB", "~/.local/lib/python3*/site-packages/nvidia/cu13/lib/libnvrtc.so.13"))
    nvdisasm = find("NVDISASM", "~/.local/lib/python3*/site-packages/nvidia/cu13/bin/nvdisasm")
    if other is not None:
        diff(lib, nvdisasm, args[0], defines, other)
        return
    sass, log = disassemble(lib, nvdisasm, args[0], defines)
    texts = sections(sass)
    for k in names:
        if k not in texts:
            print(f"{k}: not in the {args[0]} module")
            continue
        regs, spill = registers(log, k)
        print(f"{k}: {regs} registers, {spill} bytes spilled")
        print("  " + signature(texts[k]))


if __name__ == "__main__":
    main()
