"""``low_mfu``: the model FLOPs reached are a small share of the device's peak and no other finding explains it.
Its levers give the device more work per launch.
"""

from __future__ import annotations

from diagnostics.analysis.context import RunContext
from diagnostics.analysis.finding import Finding, costed
from diagnostics.analysis.load import RunTelemetry
from diagnostics.analysis.stats import rounded
from diagnostics.analysis.summary import RankPhases, Summary
from diagnostics.kinds.levers import Recommendation, compile_levers, larger_micro, lever

# low_mfu: well-tuned dense transformer training reaches 35-55% MFU on current GPUs (PaLM 46%, Megatron
# 40-50%); below 20% something fixable (precision, batch size, host overhead) is usually in the way. Its cost is
# the step time that would go at 20% MFU, 1 - MFU/20%. Against a calibrated (measured matmul) peak the figure
# is less certain: reported as info.
LOW_MFU = 0.20
# The thresholds above, by name, for the report (report.json's ``thresholds``).
THRESHOLDS = {"LOW_MFU": LOW_MFU}


def detect(run: RunTelemetry, summary: Summary, phases: list[RankPhases]) -> list[Finding]:
    if summary.mfu is not None:
        value, peak, source = summary.mfu, summary.peak_flops, summary.peak_flops_source or "datasheet"
        trusted = True
    elif summary.calibrated_mfu is not None:
        # A measured matmul peak is a moving target (threads, clocks): worth knowing, not worth alarming.
        value, peak, source = summary.calibrated_mfu, summary.calibrated_peak_flops, "calibrated matmul"
        trusted = False
    else:
        return []
    if value >= LOW_MFU:
        return []
    evidence = {
        "mfu": rounded(value),
        "hfu": rounded(summary.hfu if summary.mfu is not None else summary.calibrated_hfu),
        "peak_flops_per_device": peak,
        "peak_source": source,
        "tokens_per_s": rounded(summary.tokens_per_s),
        "flops_per_token": summary.flops_per_token,
        "num_devices": summary.world_size,
        "precision": run.meta("precision") or (run.manifest.config.get("precision") if run.manifest else None),
        "threshold": LOW_MFU,
    }
    per_device = f"{(peak or 0) / 1e12:.1f} TFLOP/s" if (peak or 0) >= 1e12 else f"{(peak or 0) / 1e9:.1f} GFLOP/s"
    message = f"MFU is {100 * value:.1f}% of the {source} peak ({per_device} per device)"
    basis = f"step time that would go at {100 * LOW_MFU:.0f}% MFU: 1 - MFU / {LOW_MFU}"
    ranks = list(range(summary.world_size))
    fraction = 1.0 - value / LOW_MFU
    if not trusted:  # a tiny model on a CPU is far from any matmul peak and no faster for knowing it
        fraction, basis = 0.0, "not estimated: against a calibrated matmul peak MFU is a hint, not a measured loss"
    return [costed("low_mfu", ranks, evidence, message, fraction, basis, corroborated=trusted, metric=value)]


def recommend(finding: Finding, ctx: RunContext) -> list[Recommendation]:
    recs: list[Recommendation] = []
    if ctx.on_gpu and ctx.get("precision.name") == "fp32":
        why = "fp32 matmuls run far below the tensor-core bf16 peak that MFU is measured against"
        recs.append(lever("precision", "bf16-mixed", why, "several times the matmul throughput"))
    return recs + compile_levers(ctx) + larger_micro(ctx)
