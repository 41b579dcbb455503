"""Every trainer config key diagnostics/ names is one the trainer has: the contract between a report's overrides and
the config groups, read from diagnostics' source.

diagnostics/ cannot import disttrain (a run dir is diagnosed on a laptop without it), so it names the trainer's keys
as strings: in the overrides it recommends (``lever("strategy.bucket_cap_mb", ...)``) and in what it reads from
run.json (``ctx.get("trainer.micro_batch_size")``). A key renamed or removed in the schema would leave a report
recommending an override Hydra refuses; here every such string must be a field of a config class of its group.
"""

from __future__ import annotations

import ast
import dataclasses
import re

from disttrain.config import schema, strategy_schema
from disttrain.config.hardware import HardwareProfile
from tests.conftest import REPO

GROUP_CLASSES: dict[str, tuple[type, ...]] = {
    "data": (
        schema.SyntheticDataConfig,
        schema.TextDataConfig,
        schema.TokensDataConfig,
        schema.HFDataConfig,
        schema.CustomDataConfig,
    ),
    "strategy": (
        strategy_schema.DDPConfig,
        strategy_schema.FSDPConfig,
        strategy_schema.MegatronConfig,
        strategy_schema.DeepSpeedConfig,
        strategy_schema.AutoStrategyConfig,
    ),
    "trainer": (schema.TrainerConfig,),
    "model": (schema.ModelConfig, schema.HFModelConfig, schema.CustomModelConfig, schema.LightningModuleConfig),
    "optimizer": (schema.OptimizerConfig,),
    "precision": (schema.PrecisionConfig,),
    "diagnostics": (schema.DiagnosticsConfig,),
    "logger": (schema.LoggerConfig,),
    "hw": (HardwareProfile,),
}
GROUPS = "|".join(GROUP_CLASSES)
WHOLE = re.compile(rf"^\+?({GROUPS})\.([a-z_][a-z0-9_]*)$")  # a string that is one key
INSIDE = re.compile(rf"(?<![\w./])\+?({GROUPS})\.([a-z_][a-z0-9_]*)")  # keys inside an f-string's text


def named_keys(source: str) -> set[tuple[str, str]]:
    found: set[tuple[str, str]] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and (m := WHOLE.match(node.value)):
            found.add((m.group(1), m.group(2)))
        elif isinstance(node, ast.JoinedStr):
            for part in node.values:
                if isinstance(part, ast.Constant) and isinstance(part.value, str):
                    found.update((m.group(1), m.group(2)) for m in INSIDE.finditer(part.value))
    return found


def test_every_key_diagnostics_names_is_a_field_of_its_group() -> None:
    named: dict[tuple[str, str], list[str]] = {}
    for path in sorted((REPO / "diagnostics").rglob("*.py")):
        for key in named_keys(path.read_text(encoding="utf-8")):
            named.setdefault(key, []).append(path.relative_to(REPO).as_posix())
    assert len(named) >= 40  # the scan sees the recommenders' keys (49 when written)
    missing = {
        f"{group}.{name}": files
        for (group, name), files in named.items()
        if not any(name in {f.name for f in dataclasses.fields(cls)} for cls in GROUP_CLASSES[group])
    }
    assert not missing, f"diagnostics names config keys the trainer does not have: {missing}"


def test_the_scan_sees_keys_in_each_form() -> None:
    source = 'lever("strategy.bucket_cap_mb", 4)\nctx.get("+data.num_workers")\nwhy = f"set trainer.grad_clip={x}"'
    assert named_keys(source) == {("strategy", "bucket_cap_mb"), ("data", "num_workers"), ("trainer", "grad_clip")}
    assert named_keys('x = "torch.float32"\ny = f"see docs/strategy.md"') == set()  # not a group, not a key
