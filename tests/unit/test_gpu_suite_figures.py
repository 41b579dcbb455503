"""benchmarks/gpu_suite.py's figures read from a finished run (pure Python over its files)."""

from __future__ import annotations

import json
from pathlib import Path

from benchmarks.gpu_suite import kernel_label, slowest_steps


def test_the_slowest_steps_come_with_their_phases_in_ms(tmp_path: Path) -> None:
    telemetry = tmp_path / "rank0000.jsonl"
    rows = [{"kind": "meta"}]
    rows += [{"kind": "step", "step": s, "step_s": 0.037, "optimizer_s": 0.001, "other_s": 0.026} for s in range(2, 30)]
    rows[19] = {"kind": "step", "step": 20, "step_s": 0.3957, "optimizer_s": 0.3493, "other_s": 0.0366}
    telemetry.write_text("\n".join(json.dumps(r) for r in rows))
    slow = slowest_steps(telemetry, count=2)
    assert slow[0] == {"step": 20, "ms": 395.7, "optimizer": 349.3, "other": 36.6}
    assert len(slow) == 2 and slow[1]["ms"] == 37.0
    assert slowest_steps(tmp_path / "absent.jsonl") == []


def test_a_kernel_label_keeps_the_functor_that_tells_atens_elementwise_kernels_apart() -> None:
    name = (
        "void at::native::elementwise_kernel<128, 4, at::native::gpu_kernel_impl_nocast<at::native::"
        "direct_copy_kernel_cuda(at::TensorIteratorBase&)::{lambda()#3}>"
    )
    assert "direct_copy_kernel_cuda" in kernel_label(name) and not kernel_label(name).startswith("void")
