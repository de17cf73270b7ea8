"""A plain PyTorch loop: ``protect(model)`` and the guarded optimizer step.

    python examples/custom_loop.py --steps 100 --fault-step 40

``guard.optimizer_step(optimizer, closure)`` runs the closure (forward + backward) as one
guarded step and answers a detection before the optimizer sees corrupted gradients:
here a transient bit flip is injected at ``--fault-step``, re-executed, and training
carries on exactly as it would have without the fault.
"""

import argparse

import torch

import sdc_guard
from sdc_guard.toy_gpt import GPT, CharData, GPTConfig, make_corpus


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--fault-step", type=int, default=40, help="-1: no fault")
    args = parser.parse_args()

    torch.manual_seed(0)
    data = CharData(make_corpus())
    model = GPT(GPTConfig(vocab=data.vocab, ctx=64))
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    faults = [sdc_guard.GemmFault(site="blocks.0.fc1", phase="forward", step=args.fault_step)] if args.fault_step >= 0 else []

    with sdc_guard.drill(model, *faults), sdc_guard.protect(model) as guard:
        for step in range(args.steps):
            x, y = data.batch(step, 16, 64)

            def closure() -> torch.Tensor:
                optimizer.zero_grad(set_to_none=True)
                loss = model.loss(x, y)
                loss.backward()
                return loss

            outcome = guard.optimizer_step(optimizer, closure)
            if outcome.flagged_ranks:
                d = outcome.report.detections[0]
                print(f"step {step}: corruption in {d.site} ({d.phase} {d.op}) -> "
                      f"{outcome.classification}, {outcome.action}")
            if step % 20 == 0 or step == args.steps - 1:
                r = outcome.report
                print(f"step {step:4d}  loss {outcome.loss.item():.3f}  GEMMs verified {r.verified}  "
                      f"overhead {100 * r.overhead:.0f} %")


if __name__ == "__main__":
    main()
