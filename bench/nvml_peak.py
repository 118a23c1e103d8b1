"""The GPU memory every process of a run held, from the driver (NVML), sampled until stopped: what
`--gpu_memory_gib G` promises to keep under G, the engine, the compiling helper and each CUDA
context included, which torch's own counters (`perf/max_memory_allocated_gb/*`) do not see.

    python bench/nvml_peak.py --out PEAK.json [--gpu 0] [--interval 0.05] &  sampler=$!
    ... the run ...
    kill -INT $sampler; wait $sampler

On SIGINT or SIGTERM it writes PEAK.json: the device's memory in use before the run
(`baseline_gib`), the largest in use during it less that baseline (`peak_gib`), the largest sum
over the run's processes (`peak_processes_gib`, each process's own count, as nvidia-smi shows it),
each process's largest (`peak_by_pid_gib`) and a timeline of at most 2,000 points. Through the
driver's own library (libnvidia-ml.so.1), so no package is needed.
"""

import argparse
import ctypes
import json
import signal
import time

GiB = 2**30


class Memory(ctypes.Structure):
    _fields_ = [("total", ctypes.c_ulonglong), ("free", ctypes.c_ulonglong),
                ("used", ctypes.c_ulonglong)]  # fmt: skip


class Process(ctypes.Structure):  # nvmlProcessInfo_t (v2 and v3)
    _fields_ = [("pid", ctypes.c_uint), ("usedGpuMemory", ctypes.c_ulonglong),
                ("gpuInstanceId", ctypes.c_uint), ("computeInstanceId", ctypes.c_uint)]  # fmt: skip


def reader(gpu):
    """A function returning (bytes in use on GPU `gpu`, {pid: bytes})."""
    nvml = ctypes.CDLL("libnvidia-ml.so.1")
    handle = ctypes.c_void_p()
    assert nvml.nvmlInit_v2() == 0, "NVML did not start"
    assert nvml.nvmlDeviceGetHandleByIndex_v2(gpu, ctypes.byref(handle)) == 0, f"no GPU {gpu}"
    procs = (Process * 64)()

    def read():
        m = Memory()
        nvml.nvmlDeviceGetMemoryInfo(handle, ctypes.byref(m))
        n = ctypes.c_uint(len(procs))
        if nvml.nvmlDeviceGetComputeRunningProcesses_v3(handle, ctypes.byref(n), procs) != 0:
            n.value = 0
        # a count the driver cannot give (in some containers) reads as 2**64 - 1: left out
        procs_used = {procs[i].pid: procs[i].usedGpuMemory for i in range(n.value)}
        return m.used, {pid: used for pid, used in procs_used.items() if used < 2**63}

    return read


def summarize(baseline, samples):
    """The summary of `samples` [(seconds, bytes in use, {pid: bytes}), ...] taken after
    `baseline` bytes were in use, in GiB."""
    peak_by_pid = {}
    for _, _, procs in samples:
        for pid, used in procs.items():
            peak_by_pid[pid] = max(peak_by_pid.get(pid, 0), used)
    step = max(1, len(samples) // 2000)
    return {
        "baseline_gib": baseline / GiB,
        "peak_gib": max((used - baseline for _, used, _ in samples), default=0) / GiB,
        "peak_processes_gib": max((sum(p.values()) for _, _, p in samples), default=0) / GiB,
        "peak_by_pid_gib": {str(pid): used / GiB for pid, used in sorted(peak_by_pid.items())},
        "samples": len(samples),
        "timeline": [
            [round(t, 2), round((used - baseline) / GiB, 2)] for t, used, _ in samples[::step]
        ],
    }


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--gpu", type=int, default=0, help="NVML's index of the GPU")
    p.add_argument("--interval", type=float, default=0.05, help="seconds between samples")
    a = p.parse_args()
    read = reader(a.gpu)
    baseline, _ = read()
    samples, stop = [], []
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.append(True))
    t0 = time.time()
    while not stop:
        used, procs = read()
        samples.append((time.time() - t0, used, procs))
        time.sleep(a.interval)
    summary = summarize(baseline, samples)
    with open(a.out, "w") as f:
        json.dump(summary, f)
    print(
        f"GPU memory in use during the run (NVML): peak {summary['peak_gib']:.1f} GiB above the "
        f"{summary['baseline_gib']:.1f} GiB before it; its processes together at most "
        f"{summary['peak_processes_gib']:.1f} GiB",
        flush=True,
    )


if __name__ == "__main__":
    main()
