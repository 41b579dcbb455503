"""model=hf + data=hf through the real CLI: a tiny HF Llama on a locally tokenized corpus under DDP, FSDP2 (with
activation checkpointing), Megatron TP=2 x PP=2 on 4 ranks with sequence parallelism (the model's own
base_model_tp_plan inside pipeline stages cut by decoder layer, the RMSNorms on sequence slices, RoPE and the causal
mask over the whole sequence, a vocab-parallel tied embedding split between the first and last stage, the loss on
vocab-sharded logits, the attention kernel recomputed in backward) and ZeRO-3 matches one
process to 1e-4; every run ends with an HF export that ``from_pretrained`` reloads to the trained weights and logits.
The FSDP2 run loads ``model.path``, a directory holding the inline config's initial weights (rank 0 reads it and
broadcasts tensor by tensor), so it starts exactly where the others start; ZeRO-3 builds the inline model
partitioned, one module at a time.

The runs are spawned once per module and shared by the tests; one more resumes the single-process run from its
step-10 checkpoint and must continue exactly (data=hf's loader position included).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from diagnostics.telemetry import telemetry_path
from disttrain.checkpoint.export import checkpoint_state, hf_weights
from disttrain.config.hf import hf_shape
from disttrain.config.schema import HFModelConfig
from disttrain.data.hf import tokenizer_sha256
from disttrain.models.hf import build_hf_model
from tests.conftest import CONF, read_manifest
from tests.dist.test_parity_and_resume import model_weights, run, train_losses
from tests.hf_fixtures import TINY_LLAMA, sentences, train_tokenizer, write_jsonl

pytestmark = [pytest.mark.dist, pytest.mark.slow]

STEPS = 20
LAYOUTS = {
    "single": ["hw.devices_per_node=1", "trainer.micro_batch_size=8", "trainer.ckpt_every_n_steps=10"],
    # With the diagnostics: the start-up parts probe times the HF model's own layers (test below).
    "ddp": ["strategy=ddp", "trainer.micro_batch_size=4", "diagnostics=default"],
    "fsdp": ["strategy=fsdp", "strategy.activation_checkpointing=true", "trainer.micro_batch_size=4"],
    # micro 4 x 2 pipeline micro-batches = the reference's global batch of 8
    # Sequence parallel (the RMSNorms on sequence slices, vocab-parallel embedding and head, loss_parallel) and
    # selective recomputation of the attention kernel.
    "megatron-tp2-pp2-sp": ["strategy=megatron", "strategy.tp=2", "strategy.pp=2", "strategy.sequence_parallel=true",
                            "strategy.activation_checkpointing=selective", "hw.devices_per_node=4",
                            "trainer.micro_batch_size=4"],
    "zero3": ["strategy=deepspeed", "strategy.stage=3", "strategy.param_persistence_threshold=0",
              "trainer.micro_batch_size=4"],
}  # fmt: skip
FROM_PATH = {"fsdp"}  # model.path: the inline config's initial weights, saved


# The preset's shape, made smaller for CI: 2 layers of hidden 64 (its other keys stay).
OVERRIDES = {k: TINY_LLAMA[k] for k in ("hidden_size", "intermediate_size", "num_hidden_layers")}
SEED = 1337  # trainer.seed's default, set explicitly: the saved model.path weights are this seed's init


def preset_config() -> dict:
    preset = OmegaConf.to_container(OmegaConf.load(CONF / "model" / "hf-tiny-llama.yaml"))["config"]
    return {**preset, **OVERRIDES}


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    tmp = tmp_path_factory.mktemp("hf")
    texts = sentences(1500)
    tokenizer = train_tokenizer(tmp / "tokenizer.json", texts)
    corpus = write_jsonl(tmp / "corpus.jsonl", texts)
    inline = ["model=hf-tiny-llama", *(f"model.config.{k}={v}" for k, v in OVERRIDES.items())]
    saved = tmp / "initial-weights"
    build_hf_model(HFModelConfig(config=preset_config(), seq_len=32), seed=SEED).save_pretrained(saved)
    common = [
        "model.seq_len=32",
        f"trainer.seed={SEED}",
        "data=hf",
        f"data.train_files=[{corpus}]",
        f"data.tokenizer={tokenizer}",
        f"data.cache_dir={tmp / 'cache'}",
        f"trainer.max_steps={STEPS}",
        "trainer.log_every_n_steps=1",
        "trainer.val_every_n_steps=1000",
        "trainer.val_batches=1",
        "trainer.ckpt_every_n_steps=100",
        "optimizer.warmup_steps=2",
        "optimizer.lr=1e-3",
        "diagnostics=off",
    ]
    model = {True: ["model=hf", f"model.path={saved}"], False: inline}
    return {name: run(tmp, name, [*model[name in FROM_PATH], *common, *extra]) for name, extra in LAYOUTS.items()}


@pytest.mark.parametrize("layout", ["ddp", "fsdp", "megatron-tp2-pp2-sp", "zero3"])
def test_two_ranks_match_one_process(layout: str, runs: dict[str, Path]) -> None:
    reference, losses = train_losses(runs["single"]), train_losses(runs[layout])
    assert sorted(losses) == sorted(reference) == list(range(STEPS))
    worst = max(abs(losses[s] - reference[s]) for s in range(STEPS))
    assert worst <= 1e-4, f"{layout}: max |loss - reference| = {worst:.2e}"
    assert losses[STEPS - 1] < losses[0] - 0.5  # it learned: parity is not two flat lines


def test_model_path_run_starts_from_exactly_the_saved_weights(runs: dict[str, Path]) -> None:
    """FSDP2 from model.path (read by rank 0, broadcast tensor by tensor) and DDP from the inline init compute the
    first forward on the same micro-batches per rank: the same first loss, bitwise, only if the weights are."""
    assert train_losses(runs["fsdp"])[0] == train_losses(runs["ddp"])[0]


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_export_reloads_with_from_pretrained(layout: str, runs: dict[str, Path]) -> None:
    from transformers import AutoModelForCausalLM

    run_dir = runs[layout]
    exported = Path(read_manifest(run_dir)["hf_export"])
    assert exported == run_dir / "hf_model" and (exported / "model.safetensors").is_file()
    trained = hf_weights(checkpoint_state(run_dir / "checkpoints" / f"step0000{STEPS}.ckpt"))
    reloaded = AutoModelForCausalLM.from_pretrained(str(exported)).eval()
    state = reloaded.state_dict()
    for name, tensor in trained.items():
        assert torch.equal(state[name], tensor), name
    # The same logits as the trained weights in the training wrapper.
    wrapper = build_hf_model(HFModelConfig(config=preset_config(), seq_len=32), seed=0).eval()
    wrapper.hf.load_state_dict(trained, strict=False)
    tokens = torch.randint(0, 300, (2, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(reloaded(input_ids=tokens).logits, wrapper(tokens))
    # The run's tokenizer-sized data never produced an id the model cannot embed.
    assert reloaded.config.vocab_size == 512


def test_resume_continues_the_hf_corpus_exactly(runs: dict[str, Path]) -> None:
    original = runs["single"]
    mid = original / "checkpoints" / "step000010.ckpt"
    resumed = run(original.parent, "single-resumed", [f"resume={mid}"])
    assert read_manifest(resumed)["resumed_from"] == str(mid.resolve())
    assert read_manifest(resumed)["config"]["data"]["name"] == "hf"
    # The tokenizer is recorded (a later resume with another tokenizer of the same size is refused before launch).
    tokenizer = Path(read_manifest(resumed)["config"]["data"]["tokenizer"])
    assert read_manifest(resumed)["tokenizer_sha256"] == tokenizer_sha256(str(tokenizer))
    full, after = train_losses(original), train_losses(resumed)
    assert sorted(after) == list(range(10, STEPS))
    # The same windows of the memory-mapped corpus in the same order: the same losses, then the same weights.
    assert [after[s] for s in range(10, STEPS)] == [full[s] for s in range(10, STEPS)]
    expected = model_weights(original / "checkpoints" / f"step0000{STEPS}.ckpt")
    actual = model_weights(resumed / "checkpoints" / f"step0000{STEPS}.ckpt")
    assert expected and sorted(expected) == sorted(actual)
    for name, tensor in expected.items():
        assert torch.equal(tensor, actual[name]), f"{name} differs after resume"


def test_the_parts_probe_times_the_hf_models_own_layers_and_the_planner_composes_from_them(
    runs: dict[str, Path],
) -> None:
    """The diagnosed DDP run: each rank timed a decoder layer of the model's own config (2 layers, hooks) and the
    edges, and run.json's prediction composes the step from those parts (basis ``measured``, not FLOPs)."""
    import json

    from disttrain.planner.shapes import model_shape

    run_dir = runs["ddp"]
    for rank in (0, 1):
        records = [json.loads(line) for line in telemetry_path(run_dir, rank).read_text().splitlines()]
        (parts,) = [r for r in records if r["kind"] == "parts_calibration"]
        expected = model_shape(hf_shape(HFModelConfig(config=preset_config(), seq_len=32))).block_parameters
        assert parts["block_numel"] == expected and (parts["micro_batch"], parts["seq_len"]) == (4, 32)
        assert all(parts[k] > 0 for k in ("block_forward_s", "block_backward_s", "edges_forward_s", "optimizer_step_s"))
    prediction = read_manifest(run_dir)["prediction"]
    assert prediction["basis"]["block_forward_backward"] == "measured"
    assert prediction["predicted"]["step_time_s"] > 0 and prediction["measured"]["step_time_s"] > 0
