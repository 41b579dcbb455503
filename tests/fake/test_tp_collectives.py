"""The collectives strategy=megatron's tensor parallelism issues per micro-batch are the ones the planner prices.

The real engine runs one forward + backward on a fake 2-rank process group (collectives return at once), under
``CommDebugMode``, which counts every functional collective DTensor issues. The planner's per-micro-batch
communication must hold the same number of calls per kind: the blocks' activation all-reduces, the embedding's
and the head's, and the loss's (vocab-parallel: three per-token reductions; otherwise one all-gather of the
logits). A kind the engine issues that the planner does not price is time the prediction leaves out.
"""

from __future__ import annotations

import dataclasses
from collections import Counter

import pytest
import torch
from torch.distributed.tensor.debug import CommDebugMode

from disttrain.config.degrees import megatron_degrees
from disttrain.config.strategy_schema import MegatronConfig
from disttrain.planner import Layout, Workload, comm_plan, model_shape
from disttrain.strategies.megatron.engine import EngineSettings, MegatronEngine, build_mesh
from tests.conftest import hw_profile, model_preset
from tests.fake.test_planner_shards import fake_world

TINY = {"n_layers": 3, "d_model": 32, "n_heads": 4, "ffn_hidden": 64, "seq_len": 16}
MODELS = {
    "gpt": dataclasses.replace(model_preset("gpt-nano"), **TINY),
    "llama": dataclasses.replace(model_preset("llama-1b"), **TINY, n_kv_heads=2, vocab_size=96),
}
# What CommDebugMode names each functional collective, and the planner's op for it.
ENGINE_TO_PLANNER = {"all_reduce": "functional_all_reduce", "all_gather_into_tensor": "all_gather"}
# What torch says about the engine's hooks (token ids into hooked modules, FSDP2's root returning a view); a run's
# console drops them too.
pytestmark = [
    pytest.mark.filterwarnings("ignore:Full backward hook is firing"),
    pytest.mark.filterwarnings("ignore:FSDP2-wrapped module"),
]


def engine_collectives(model: str, loss_parallel: bool, micro_batch: int) -> Counter[str]:
    cfg = MODELS[model]
    strategy = MegatronConfig(tp=2, loss_parallel=loss_parallel)
    degrees = megatron_degrees(strategy, 2)
    with fake_world(2, 0):
        settings = EngineSettings(cfg, strategy, degrees, torch.float32, seed=0)
        engine = MegatronEngine(settings, build_mesh(degrees, "cpu"), torch.device("cpu"))
        assert engine.microbatches == 1
        tokens = torch.randint(0, cfg.vocab_size, (micro_batch, cfg.seq_len + 1))
        with CommDebugMode() as comm:
            engine.forward_backward(tokens[:, :-1], tokens[:, 1:], lambda loss: loss.backward())
    counts: Counter[str] = Counter()
    for op, calls in comm.get_comm_counts().items():
        name = str(op).rsplit(".", 1)[-1]
        counts[ENGINE_TO_PLANNER.get(name, name)] += calls
    return counts


def planned_collectives(model: str, loss_parallel: bool, micro_batch: int) -> Counter[str]:
    shape = model_shape(MODELS[model])
    layout = Layout("megatron", dp=1, tp=2, loss_parallel=loss_parallel)
    workload = Workload(micro_batch, micro_batch, shape.seq_len, "fp32")
    comm = comm_plan(shape, layout, workload, hw_profile("cpu"))
    counts: Counter[str] = Counter()
    for traffic in (comm.mb_fwd, comm.mb_bwd, comm.mb_exposed):
        for op in traffic.ops:
            counts[op.op] += round(op.intra_calls + op.inter_calls)
    return counts


@pytest.mark.parametrize("loss_parallel", [True, False], ids=["loss_parallel", "gathered_logits"])
@pytest.mark.parametrize("model", sorted(MODELS))
def test_the_planner_prices_every_collective_the_engine_issues(model: str, loss_parallel: bool) -> None:
    issued = engine_collectives(model, loss_parallel, micro_batch=2)
    assert issued == planned_collectives(model, loss_parallel, micro_batch=2)
    # The loss's own share: three reductions on the sharded logits, or one gather of them.
    assert issued["all_gather"] == (0 if loss_parallel else 1)
