"""The Monitor tab's GPU figures against ``nvidia-smi`` on a real NVIDIA driver (not run in CI: no GPU).

KV Valet's GPU code (app.monitor.gpu.GpuMonitor over nvidia-ml-py) is tested in CI against a fake NVML
(tests/doubles); this script reads a real driver with it and with ``nvidia-smi --query-gpu`` at once and
compares, per GPU: name, PCI bus id, UUID and total memory (equal), used memory (within 32 MiB: the two
reads are a moment apart), temperature (±3 °C), power (±15 %) and the driver version; and, for
a process of its own holding ``--hold-gib`` GiB on GPU 0 (CUDA's driver API through ctypes: libcuda.so.1
comes with the driver), the app's per-process memory for that pid (what the Monitor tab shows for a
llama-server) against ``nvidia-smi --query-compute-apps`` (within 16 MiB). Needs only Python, nvidia-ml-py
(``pynvml``) and the driver: no llama-server, no CUDA toolkit.

``--fill`` F instead holds GPU 0 to the fraction F of its memory and checks that the Monitor tab's
warning (app.monitor.warnings: above 95 %) says so, with nvidia-smi's figures, or stays quiet below.

    PYTHONPATH=. python3 tests/bench/nvml_compare.py [--hold-gib 1 | --fill 0.96] [--json PATH]

Exit 0 when every figure agrees, 1 with each disagreement printed.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from app.core.units import is_na  # noqa: E402
from app.monitor.gpu import GpuMonitor  # noqa: E402

MIB = 1 << 20
QUERY = "index,name,pci.bus_id,uuid,memory.total,memory.used,temperature.gpu,power.draw,driver_version"


def smi(args: list[str]) -> list[list[str]]:
    out = subprocess.run(["nvidia-smi", *args, "--format=csv,noheader,nounits"], capture_output=True, text=True,
                         timeout=60, check=True)
    return [[f.strip() for f in line.split(",")] for line in out.stdout.strip().splitlines() if line.strip()]


def norm_bus(bus: str) -> str:
    """nvidia-smi writes 00000000:19:00.0, NVML 0000:19:00.0 (either may pad the domain): the last three parts."""
    return ":".join(bus.lower().split(":")[-2:])


#: a process that holds memory on GPU 0 until its stdin closes (the driver API, no toolkit)
HOLDER = """
import ctypes, sys
cu = ctypes.CDLL("libcuda.so.1")
dev, ctx, ptr = ctypes.c_int(), ctypes.c_void_p(), ctypes.c_uint64()
steps = [cu.cuInit(0), cu.cuDeviceGet(ctypes.byref(dev), 0), cu.cuCtxCreate_v2(ctypes.byref(ctx), 0, dev),
         cu.cuMemAlloc_v2(ctypes.byref(ptr), ctypes.c_size_t(int(sys.argv[1])))]
print("ready" if not any(steps) else f"failed {steps}", flush=True)
sys.stdin.readline()
"""


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", default=None)
    ap.add_argument("--hold-gib", type=float, default=1.0, help="a process of its own holding this much (0: none)")
    ap.add_argument("--fill", type=float, default=None, help="hold GPU 0 to this fraction of its memory")
    args = ap.parse_args()
    if args.fill is not None:
        snap = GpuMonitor().sample(set())
        g = snap.gpus[0]
        args.hold_gib = max(0.0, (args.fill * g.mem_total - g.mem_used) / (1 << 30))
    if shutil.which("nvidia-smi") is None:
        print("nvidia-smi not found")
        return 1
    holder = None
    if args.hold_gib > 0:
        holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(int(args.hold_gib * (1 << 30)))],
                                  stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        said = holder.stdout.readline().strip()
        print(f"holder pid {holder.pid}: {said}")
        if said != "ready":
            holder.kill()
            return 1
    try:
        return compare(args, holder)
    finally:
        if holder is not None:
            holder.stdin.close()
            holder.wait(timeout=60)


def compare(args, holder) -> int:
    apps = smi(["--query-compute-apps=pid,gpu_bus_id,used_memory"])
    pids = {holder.pid} if holder is not None else set()
    snap = GpuMonitor().sample(pids)
    rows = smi([f"--query-gpu={QUERY}"])
    problems: list[str] = []
    report = {"kv_valet": {"message": snap.message, "driver": snap.driver_version, "gpus": []},
              "nvidia_smi": {"gpus": rows, "apps": apps}}
    print(f"KV Valet: {snap.message or 'NVML ok'}; driver {snap.driver_version}; {len(snap.gpus)} GPU(s); "
          f"nvidia-smi: {len(rows)} GPU(s), {len(apps)} compute process(es)")
    if not snap.available or len(snap.gpus) != len(rows):
        problems.append(f"GPU count: KV Valet {len(snap.gpus)} ({snap.message}), nvidia-smi {len(rows)}")
    for g, r in zip(snap.gpus, rows):
        idx, name, bus, uuid, total, used, temp, power, driver = r
        mine = {"index": g.index, "name": g.name, "bus_id": g.bus_id, "uuid": g.uuid, "mem_total": g.mem_total,
                "mem_used": g.mem_used, "temperature_c": g.temperature_c, "power_w": g.power_w,
                "server_mem": g.server_mem}
        report["kv_valet"]["gpus"].append({k: (None if is_na(v) else v) for k, v in mine.items()})
        print(f"  GPU {idx}: {name} {bus} {uuid}")
        print(f"    memory total  KV Valet {g.mem_total / MIB:,.0f} MiB   nvidia-smi {float(total):,.0f} MiB")
        print(f"    memory used   KV Valet {g.mem_used / MIB:,.0f} MiB   nvidia-smi {float(used):,.0f} MiB")
        print(f"    temperature   KV Valet {g.temperature_c} C   nvidia-smi {temp} C; "
              f"power KV Valet {g.power_w} W   nvidia-smi {power} W")

        def differs(what: str, a, b) -> None:
            problems.append(f"GPU {idx} {what}: KV Valet {a!r}, nvidia-smi {b!r}")

        if g.index != int(idx):
            differs("index", g.index, idx)
        if str(g.name) != name:
            differs("name", g.name, name)
        if is_na(g.bus_id) or norm_bus(str(g.bus_id)) != norm_bus(bus):
            differs("bus id", g.bus_id, bus)
        if str(g.uuid) != uuid:
            differs("uuid", g.uuid, uuid)
        if is_na(g.mem_total) or round(g.mem_total / MIB) != round(float(total)):
            differs("memory total (MiB)", g.mem_total, total)
        if is_na(g.mem_used) or abs(g.mem_used / MIB - float(used)) > 32:
            differs("memory used (MiB)", g.mem_used, used)
        if temp not in ("[N/A]", "N/A") and (is_na(g.temperature_c) or abs(g.temperature_c - float(temp)) > 3):
            differs("temperature", g.temperature_c, temp)
        if power not in ("[N/A]", "N/A") and (is_na(g.power_w)
                                               or abs(g.power_w - float(power)) > 0.15 * max(float(power), 1.0)):
            differs("power", g.power_w, power)
        if snap.driver_version != driver:
            differs("driver", snap.driver_version, driver)
    by_bus = {norm_bus(str(g.bus_id)): g for g in snap.gpus if not is_na(g.bus_id)}
    for pid, bus, used in apps:
        g = by_bus.get(norm_bus(bus))
        print(f"  process {pid} on {bus}: nvidia-smi {used} MiB; KV Valet counts "
              f"{None if g is None or g.server_mem is None else g.server_mem / MIB} MiB for the pids asked")
    if holder is not None:
        listed = [a for a in apps if a[0] == str(holder.pid)]
        g = snap.gpus[0] if snap.gpus else None
        mine = None if g is None or g.server_mem is None else g.server_mem / MIB
        print(f"  the holder (pid {holder.pid}, {args.hold_gib:g} GiB asked): KV Valet {mine} MiB; nvidia-smi "
              f"{listed[0][2] if listed else 'does not list this pid'} MiB")
        report["holder"] = {"pid": holder.pid, "kv_valet_mib": mine, "nvidia_smi": listed}
        if not listed or mine is None or abs(mine - float(listed[0][2])) > 16:
            problems.append(f"the holder's memory: KV Valet {mine} MiB, nvidia-smi {listed}")
    if args.fill is not None:
        from app.monitor.warnings import GPU_MEM_THRESHOLD, compute_warnings

        g = snap.gpus[0]
        said = [w.text for w in compute_warnings(type("Snap", (), {"gpu": snap})()) if "memory" in w.text]
        frac = g.mem_used / g.mem_total
        print(f"  filled to {frac:.1%} (nvidia-smi {float(rows[0][5]) / float(rows[0][4]):.1%}): the Monitor tab "
              f"warns: {said or 'nothing'}")
        report["fill"] = {"fraction": frac, "warnings": said}
        if (frac > GPU_MEM_THRESHOLD) != bool(said):
            problems.append(f"the 95 % warning at {frac:.1%}: {said}")
    report["problems"] = problems
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1, default=str), encoding="utf-8")
    for p in problems:
        print("DIFFERS: " + p)
    print("every figure agrees" if not problems else f"{len(problems)} figure(s) differ")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
