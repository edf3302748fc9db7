#!/usr/bin/env python3
"""How long a GPU's page gather takes after the GPU sat idle (bench/RESULTS.md, issue #13).

A push between daemons runs two device ops (the sender's gather, the receiver's scatter) after
milliseconds of gRPC with the GPU idle. This times the same shape of op with torch: a gather
of 1985 pages of 33792 B (64 MiB of V41 pages of 64 tokens) by index_select, timed by CUDA
events, back to back and after 1-100 ms of idle; and a contiguous copy of the same bytes.
With --wake it also tries waking the GPU ahead of the gather (a small memset or a sleep
kernel, then some host time, as a daemon could while its gRPC runs).

Usage (on a GPU machine with torch): python3 bench/gpu_idle_probe.py [--wake] [--device cuda:0]
"""
import argparse
import subprocess
import time

import torch

PAGES, PAGE_BYTES = 1985, 33792


def smi(fields):
    out = subprocess.run(["nvidia-smi", f"--query-gpu={fields}", "--format=csv,noheader"],
                         capture_output=True, text=True)
    return out.stdout.strip()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda:0")
    ap.add_argument("--wake", action="store_true")
    args = ap.parse_args()
    dev = torch.device(args.device)
    src = torch.empty(PAGES * PAGE_BYTES, dtype=torch.uint8, device=dev).view(PAGES, PAGE_BYTES)
    dst = torch.empty_like(src)
    small = torch.empty(1 << 20, dtype=torch.uint8, device=dev)
    idx = torch.randperm(PAGES, device=dev)
    print("before:", smi("name,clocks.sm,clocks.mem,clocks.max.sm,pstate"))

    def timed(op):
        s = torch.cuda.Event(enable_timing=True)
        e = torch.cuda.Event(enable_timing=True)
        s.record()
        op()
        e.record()
        e.synchronize()
        return s.elapsed_time(e) * 1000  # µs

    def gather():
        return timed(lambda: torch.index_select(src, 0, idx, out=dst))

    def copy():
        return timed(lambda: dst.copy_(src))

    def spin_host(us):
        end = time.perf_counter() + us * 1e-6
        while time.perf_counter() < end:
            pass

    def series(name, op, idle, before=lambda: None, n=20):
        r = []
        for _ in range(n):
            if idle:
                time.sleep(idle)
            before()
            r.append(op())
        r.sort()
        print(f"{name:52s} after {idle * 1e3:5.0f} ms idle: median {r[n // 2]:6.1f} µs, "
              f"min {r[0]:6.1f}, max {r[-1]:6.1f}", flush=True)

    for _ in range(20):
        gather()
    for idle in (0, 0.001, 0.002, 0.005, 0.02, 0.1):
        series("gather", gather, idle)
    for idle in (0, 0.005, 0.1):
        series("contiguous copy", copy, idle)
    if args.wake:
        for idle in (0.002, 0.02):
            series("gather, sleep kernel 20k cycles just before", gather, idle,
                   lambda: torch.cuda._sleep(20000))
            series("gather, sleep kernel 200k cycles, 300 µs host", gather, idle,
                   lambda: (torch.cuda._sleep(200000), spin_host(300)))
            series("gather, memset 1 MiB, 300 µs host", gather, idle,
                   lambda: (small.zero_(), spin_host(300)))
            series("gather, memset 1 MiB, 100 µs host", gather, idle,
                   lambda: (small.zero_(), spin_host(100)))
            series("gather, 300 µs host only", gather, idle, lambda: spin_host(300))
    print("after:", smi("clocks.sm,clocks.mem,pstate"))


if __name__ == "__main__":
    main()
