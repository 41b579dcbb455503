"""Does torch.compile (inductor) give the eager gradients for the test projects' networks on this machine?

``model.compile`` compiles a LightningModule's submodules' forwards; on this CPU build inductor once computed the
conv classifier's conv / max-pool backward wrong at 8 rows (RESULTS.md). Rerun after a torch upgrade, before
trusting a compiled CPU run:

    python benchmarks/compile_grad_check.py                   # classifier's ConvNet and the regressor, 8 and 16 rows
    python benchmarks/compile_grad_check.py --backend aot_eager

Prints, per network and row count, the largest |compiled - eager| over the parameters' gradients and the loss.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.lightning_projects.classifier import ConvNet
from tests.lightning_projects.regressor import LitRegressor


def networks() -> dict[str, tuple]:
    """name -> (build, inputs, loss of (output, targets)) on a fixed batch of 16 rows."""
    torch.manual_seed(1)
    images, labels = torch.randn(16, 1, 12, 12), torch.randint(0, 10, (16,))
    waves, targets = torch.randn(16, 16), torch.randn(16)  # LitRegressor's default 16 features, one output
    return {
        "classifier ConvNet": (ConvNet, images, labels, F.cross_entropy),
        "regressor MLP": (LitRegressor, waves, targets, F.mse_loss),
    }


def gap(build: object, x: torch.Tensor, y: torch.Tensor, loss_fn: object, backend: str) -> tuple[float, float]:
    torch.manual_seed(0)
    eager = build()  # type: ignore[operator]
    eager_loss = loss_fn(eager(x).float(), y)  # type: ignore[operator]
    eager_loss.backward()
    torch.manual_seed(0)
    compiled = build()  # type: ignore[operator]
    compiled.forward = torch.compile(compiled.forward, backend=backend)
    compiled_loss = loss_fn(compiled(x).float(), y)  # type: ignore[operator]
    compiled_loss.backward()
    pairs = zip(eager.parameters(), compiled.parameters(), strict=True)
    grads = max((a.grad - b.grad).abs().max().item() for a, b in pairs)
    return grads, abs(eager_loss.item() - compiled_loss.item())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--backend", default="inductor")
    parser.add_argument("--rows", type=int, nargs="*", default=[8, 16])
    args = parser.parse_args()
    torch.set_num_threads(1)
    print(f"torch {torch.__version__}, backend {args.backend}")
    for name, (build, x, y, loss_fn) in networks().items():
        for rows in args.rows:
            torch._dynamo.reset()  # each row count compiled on its own, as a run of that micro-batch compiles it
            grads, loss = gap(build, x[:rows], y[:rows], loss_fn, args.backend)
            print(f"{name:20s} {rows:3d} rows: max |grad gap| {grads:.2e}, |loss gap| {loss:.2e}")


if __name__ == "__main__":
    main()
