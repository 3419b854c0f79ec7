"""What stays allocated after the E8 layer's steps, once the layer and the host cache are gone.

Run under the ``held_allocations.so`` shim (``run.sh`` builds it and sets ``LD_PRELOAD``):
``python held_after_step.py DTYPE OUT.txt`` primes the process with a tiny layer (as
``moe_gmm.bench.memory`` does), builds the E8 layer of the ``experts`` set, runs 3 fwd+bwd steps,
drops the layer, clears :mod:`moe_gmm.ops.host_cache`, collects and trims the heap, then writes the
allocations of 64 KiB or more made since the baseline that are still live, with their backtraces,
and prints them grouped by owner: the native kernels (by function, from the library's own
symbols) or torch's library (MKL or oneDNN, by the nearest exported symbol; approximate).
"""

from __future__ import annotations

import bisect
import collections
import ctypes
import gc
import re
import subprocess
import sys
from pathlib import Path

import torch

from moe_gmm.bench import memory
from moe_gmm.bench.harness import _timed_callable
from moe_gmm.bench.moe_layer import case_set
from moe_gmm.ops import host_cache, native

FRAME = re.compile(r"(?P<lib>[^/\s(]+\.so[.\d]*)\((?P<sym>[^)+]*)\+0x(?P<off>[0-9a-f]+)\)")


def symbols(path: str, dynamic: bool) -> tuple[list[int], list[str]]:
    args = ["nm", "-C", "--defined-only"] + (["-D"] if dynamic else []) + [path]
    rows = []
    for line in subprocess.run(args, capture_output=True, text=True, check=False).stdout.splitlines():
        parts = line.split(None, 2)
        if len(parts) == 3 and parts[1] in "tTwW":
            rows.append((int(parts[0], 16), parts[2]))
    rows.sort()
    return [a for a, _ in rows], [n for _, n in rows]


def owner(frames: list[str], tables: dict[str, tuple[list[int], list[str]]]) -> str:
    for frame in frames:
        m = FRAME.search(frame)
        if not m:
            continue
        lib, off = m.group("lib"), int(m.group("off"), 16)
        if m.group("sym"):  # an exported symbol's offset: std::vector's growth, operator new, MKL's entry points
            if lib.startswith("libtorch_cpu") and "mkl" in m.group("sym").lower():
                return "torch: MKL"
            continue
        if lib.startswith("moe_gmm_native"):
            addrs, names = tables["native"]
            name = names[bisect.bisect_right(addrs, off) - 1]
            if "run_tasks" in name or "invoke_parallel" in name:
                continue  # the allocating kernel is further up
            name = name.replace("(anonymous namespace)::", "").removeprefix("void ")
            return "moe-gmm native: " + re.split(r"[<(]", name, maxsplit=1)[0]
        if lib.startswith("libtorch_cpu"):
            addrs, names = tables["torch"]
            name = names[bisect.bisect_right(addrs, off) - 1].lower()
            if "mkl" in name:
                return "torch: MKL"
            if "dnnl" in name:
                return "torch: oneDNN"
    return "other"


def main() -> None:
    dtype, out = sys.argv[1], Path(sys.argv[2])
    shim = ctypes.CDLL(None)
    torch.set_num_threads(2)
    (e8,) = [case for case in case_set("experts") if case.num_experts == 8]
    spec = {"case": e8.params(), "dtype": dtype, "impl": "moe_gmm"}
    memory._prime(memory._moe_layer_workload(memory._tiny_moe_layer(spec)))
    build, grad_out = memory._moe_layer_workload(spec)
    gc.collect()
    memory._trim_heap()
    shim.held_start()
    workload = build()
    step = _timed_callable(workload, "fwdbwd", grad_out)
    memory._run_steps(step, 3)
    del step, workload
    gc.collect()
    host_cache.clear()
    gc.collect()
    memory._trim_heap()
    shim.held_dump(str(out).encode())

    tables = {
        "native": symbols(str(native.library_path()), dynamic=False),
        "torch": symbols(str(Path(torch.__file__).parent / "lib" / "libtorch_cpu.so"), dynamic=True),
    }
    by_owner: collections.Counter[str] = collections.Counter()
    for block in out.read_text().split("== ")[1:]:
        lines = block.strip().splitlines()
        by_owner[owner(lines[1:], tables)] += int(lines[0].split()[0])
    print(f"{dtype}: held after the layer is gone, {sum(by_owner.values()) / 2**20:.2f} MiB in allocations >= 64 KiB")
    for name, nbytes in by_owner.most_common():
        print(f"  {nbytes / 2**20:6.2f} MiB  {name}")


if __name__ == "__main__":
    main()
