#!/usr/bin/env python3
"""Compares the kernels of two cubins (ELF) instruction word by instruction word, with no disassembler.

    bench/cubin_diff.py BASE.cubin NEW.cubin [--rename REGEX=REPLACEMENT ...]

Each kernel's code is the ELF section .text.<mangled name>. A kernel is paired with the kernel of the same name in
the other cubin, after the --rename substitutions on NEW's names (for a template parameter that was added, say).
Prints per kernel the instruction counts (16 bytes each on sm_70+), how many words differ, and for differing words the
bit range of their XOR; exits 1 when a paired kernel differs. Used to show that a change leaves a kernel's machine code
as it was: build a control (the base with only the data layout change) and the change, and compare the two.
"""
import argparse
import re
import struct
import sys


def kernel_sections(path):
    data = open(path, "rb").read()
    if data[:4] != b"\x7fELF" or data[4] != 2:
        sys.exit(f"{path}: not a 64-bit ELF cubin")
    shoff = struct.unpack_from("<Q", data, 0x28)[0]
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", data, 0x3A)
    headers = [struct.unpack_from("<IIQQQQIIQQ", data, shoff + i * shentsize) for i in range(shnum)]
    names_at = headers[shstrndx][4]
    sections = {}
    for h in headers:
        name = data[names_at + h[0]:data.index(b"\0", names_at + h[0])].decode()
        if name.startswith(".text."):
            sections[name[len(".text."):]] = data[h[4]:h[4] + h[5]]
    return sections


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("base")
    parser.add_argument("new")
    parser.add_argument("--rename", action="append", default=[], metavar="REGEX=REPLACEMENT")
    args = parser.parse_args()
    base = kernel_sections(args.base)
    new = {}
    for name, code in kernel_sections(args.new).items():
        for rule in args.rename:
            pattern, replacement = rule.split("=", 1)
            name = re.sub(pattern, replacement, name)
        new[name] = code
    differ = 0
    for name in sorted(set(base) | set(new)):
        if name not in new or name not in base:
            print(f"only in {'base' if name in base else 'new'}: {name}")
            continue
        a, b = base[name], new[name]
        words = min(len(a), len(b)) // 16
        diff = [i for i in range(words) if a[16 * i:16 * i + 16] != b[16 * i:16 * i + 16]]
        bits = set()
        for i in diff:
            x = int.from_bytes(a[16 * i:16 * i + 16], "little") ^ int.from_bytes(b[16 * i:16 * i + 16], "little")
            bits.add(((x & -x).bit_length() - 1, x.bit_length()))
        same = len(a) == len(b) and not diff
        differ += not same
        detail = "identical" if same else f"{len(diff)} words differ, xor bits {sorted(bits)[:4]}"
        print(f"{len(a) // 16:6d} {len(b) // 16:6d} instructions, {detail}: {name}")
    return 1 if differ else 0


if __name__ == "__main__":
    sys.exit(main())
