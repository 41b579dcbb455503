"""Background device sampler: NVML on NVIDIA GPUs, a labelled CPU fallback elsewhere."""

from __future__ import annotations

import os
import resource
import threading
import time
from collections.abc import Callable

Write = Callable[..., None]

# NVML throttle-reason bits worth reporting (nvml.h: nvmlClocksEventReasons / ThrottleReasons).
THROTTLE_REASONS = {
    0x0000000000000002: "applications_clocks_setting",
    0x0000000000000004: "sw_power_cap",
    0x0000000000000008: "hw_slowdown",
    0x0000000000000020: "sw_thermal_slowdown",
    0x0000000000000040: "hw_thermal_slowdown",
    0x0000000000000080: "hw_power_brake_slowdown",
}


def rss_bytes() -> int:
    """Current resident set size from /proc (Linux), else the peak from getrusage."""
    try:
        with open("/proc/self/statm") as handle:
            return int(handle.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


class NvmlReader:
    """One GPU through pynvml; constructing it raises if NVML or the device is not there."""

    source = "nvml"

    def __init__(self, device_index: int) -> None:
        import pynvml

        pynvml.nvmlInit()
        self.nvml = pynvml
        self.device_index = device_index
        self.handle = pynvml.nvmlDeviceGetHandleByIndex(device_index)

    def _optional(self, fn: Callable[[], float]) -> float | None:
        try:
            return fn()
        except self.nvml.NVMLError:
            return None

    def read(self) -> dict:
        n, h = self.nvml, self.handle
        memory = n.nvmlDeviceGetMemoryInfo(h)
        reasons = int(self._optional(lambda: n.nvmlDeviceGetCurrentClocksThrottleReasons(h)) or 0)
        pcie = {
            "pcie_tx_bytes_per_s": self._optional(lambda: n.nvmlDeviceGetPcieThroughput(h, n.NVML_PCIE_UTIL_TX_BYTES)),
            "pcie_rx_bytes_per_s": self._optional(lambda: n.nvmlDeviceGetPcieThroughput(h, n.NVML_PCIE_UTIL_RX_BYTES)),
        }
        # NVML reports PCIe throughput in KB/s.
        pcie = {k: None if v is None else v * 1024 for k, v in pcie.items()}
        return {
            "source": self.source,
            "device_index": self.device_index,
            "util_pct": n.nvmlDeviceGetUtilizationRates(h).gpu,
            "mem_used_bytes": memory.used,
            "mem_total_bytes": memory.total,
            "power_w": self._optional(lambda: n.nvmlDeviceGetPowerUsage(h) / 1000.0),
            "power_limit_w": self._optional(lambda: n.nvmlDeviceGetEnforcedPowerLimit(h) / 1000.0),
            "default_power_limit_w": self._optional(lambda: n.nvmlDeviceGetPowerManagementDefaultLimit(h) / 1000.0),
            "sm_clock_mhz": self._optional(lambda: n.nvmlDeviceGetClockInfo(h, n.NVML_CLOCK_SM)),
            "temp_c": self._optional(lambda: n.nvmlDeviceGetTemperature(h, n.NVML_TEMPERATURE_GPU)),
            "throttle_reasons": [name for bit, name in THROTTLE_REASONS.items() if reasons & bit],
            **pcie,
            "rss_bytes": rss_bytes(),
        }


class CpuReader:
    """This process's CPU utilisation (percent of one core) and RSS: what a CPU run can honestly report."""

    source = "cpu"

    def __init__(self) -> None:
        self._last = (time.monotonic(), sum(os.times()[:2]))

    def read(self) -> dict:
        now, cpu = time.monotonic(), sum(os.times()[:2])
        wall = max(1e-9, now - self._last[0])
        util = 100.0 * (cpu - self._last[1]) / wall
        self._last = (now, cpu)
        return {"source": self.source, "device_index": None, "cpu_util_pct": util, "rss_bytes": rss_bytes()}


def make_reader(device_index: int | None) -> tuple[object, str | None]:
    """NVML for a GPU rank when it works, else the CPU reader; the second value says why NVML was not used."""
    if device_index is None:
        return CpuReader(), None
    try:
        return NvmlReader(device_index), None
    except Exception as err:  # NVML missing, driver mismatch, no permission: all mean "fall back"
        return CpuReader(), f"NVML unavailable ({type(err).__name__}: {err}); sampling the CPU instead"


class DeviceSampler(threading.Thread):
    """Writes a ``sample`` record every ``interval_s`` until stopped; a failing read is reported once."""

    def __init__(self, reader: object, write: Write, interval_s: float) -> None:
        super().__init__(name="disttrain-sampler", daemon=True)
        self.reader = reader
        self.write = write
        self.interval_s = interval_s
        self._stop_event = threading.Event()
        # The newest reading, for the user's logger on the training thread: one reference swap, no lock needed.
        self.latest: dict | None = None

    def run(self) -> None:
        while not self._stop_event.wait(self.interval_s):
            try:
                self.latest = self.reader.read()  # type: ignore[attr-defined]
                self.write("sample", **self.latest)
            except Exception as err:  # a sampler must never take training down
                self.write("error", source="sampler", message=f"{type(err).__name__}: {err}")
                return

    def stop(self) -> None:
        self._stop_event.set()
        self.join(timeout=5)
