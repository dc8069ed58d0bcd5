"""How many kernels a GPU decode step launches, counted on the CPU (issue 20): the table step
(experts through the pager's table, attention through the Triton decode kernel: what a GPU
decode step runs and a CUDA graph records) of a demo model, its torch ops at the dispatcher
that would launch a kernel on a GPU (views and metadata ops excluded) and its Triton launches,
per layer and in all, by op.

    TRITON_INTERPRET=1 python -m mox.bench.micro.step_ops [--arch olmoe] [--seqs 8]
        [--dtype bfloat16]

A graph replay still runs every one of these kernels back to back; each costs ~2-4 us on a
GPU however small, so at batch 1 their number, not the bytes read, bounds a replayed step.
"""

from __future__ import annotations

import argparse
import collections
import os
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes

# ops that change only a tensor's metadata (no kernel on a GPU)
NO_KERNEL = {"view", "_unsafe_view", "reshape", "split", "split_with_sizes", "slice", "select",
             "as_strided", "detach", "t", "transpose", "unsqueeze", "squeeze", "expand",
             "permute", "alias", "unbind", "lift_fresh", "empty", "empty_strided",
             "_reshape_alias", "unflatten", "flatten", "contiguous", "view_as", "empty_like",
             "new_empty", "new_empty_strided", "_to_copy_meta"}


# on_launch(name, args, out): a torch op at the dispatcher, or a Triton launch (out None)
OnLaunch = Callable[[str, tuple, object], None]


@contextmanager
def kernel_launches(on_launch: OnLaunch) -> Iterator[None]:
    """Within the block, `on_launch` sees every torch op at the dispatcher and every Triton
    launch of mox's kernel modules (named `triton:<kernel>`), not the interpreter's own torch
    calls inside a launch: what a GPU would run, and what it would read."""
    from mox.kernels import attention_triton, moe_align, moe_triton, triton_ops

    class Mode(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            on_launch(func.overloadpacket.__name__, args, out)
            return out

    class Launches:
        def __init__(self, kernel, name: str) -> None:
            self.kernel, self.name = kernel, name

        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                on_launch("triton:" + self.name, args, None)
                with _disable_current_modes():
                    return self.kernel[grid](*args, **kwargs)
            return launch

    kernels = [(module, name) for module in (attention_triton, moe_align, moe_triton, triton_ops)
               for name in dir(module) if name.startswith("_") and name.endswith("_kernel")]
    saved = [getattr(module, name) for module, name in kernels]
    for (module, name), kernel in zip(kernels, saved):
        setattr(module, name, Launches(kernel, name))
    try:
        with Mode():
            yield
    finally:
        for (module, name), kernel in zip(kernels, saved):
            setattr(module, name, kernel)


def launches_kernel(name: str, args: tuple, out: object) -> bool:
    """Whether an op `kernel_launches` saw would launch a kernel on a GPU (not a metadata
    op, nor an out-of-place op that hands back its input, as `.to` to the same dtype)."""
    return name not in NO_KERNEL and not (args and out is args[0] and not name.endswith("_"))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--arch", default="olmoe")
    parser.add_argument("--seqs", type=int, default=1)
    parser.add_argument("--dtype", default="bfloat16")
    args = parser.parse_args()
    assert os.environ.get("TRITON_INTERPRET") == "1", "run with TRITON_INTERPRET=1"
    os.environ["MOX_NATIVE_KERNELS"] = "0"      # (bf16 on a CPU would decode natively)
    from mox import LLM
    from mox.demo import demo_name, ensure_demo_models
    from mox.kernels import triton_ops

    triton_ops.takes = lambda x: True                      # the GPU's paths
    with tempfile.TemporaryDirectory() as home:
        path = ensure_demo_models(home, architectures=(args.arch,))[demo_name(args.arch)]
        llm = LLM(path, dtype=args.dtype)
        model = llm.model
        model.experts.maps_host_experts = True
        prompts = [[1 + i, 2, 3] for i in range(args.seqs)]
        llm.generate(prompt_token_ids=prompts, max_tokens=2, temperature=0.0, ignore_eos=True)
        original, steps, counted_steps = model._table_stream, collections.Counter(), []

        def count(name: str, op_args: tuple, out: object) -> None:
            if launches_kernel(name, op_args, out):
                steps[name] += 1

        def counted(x, batch, hold, used):
            if batch.key_ranges is None:                      # (a prefill: not counted)
                return original(x, batch, hold, used)
            counted_steps.append(1)
            with kernel_launches(count):
                return original(x, batch, hold, used)
        model._table_stream = counted
        # one prefill, then one decode step: its layers counted
        llm.generate(prompt_token_ids=prompts, max_tokens=2, temperature=0.0, ignore_eos=True)
    assert len(counted_steps) == 1, counted_steps
    layers = model.spec.num_layers
    total = sum(steps.values())
    print(f"{args.arch}, {args.dtype}, {args.seqs} sequences: {total} kernels in the step's "
          f"layers, {total / layers:.1f} a layer ({layers} layers)")
    for name, times in steps.most_common():
        print(f"  {times / layers:6.2f} / layer  {name}")


if __name__ == "__main__":
    main()
