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

from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes

# ops that change only a tensor's metadata (no kernel on a GPU)
NO_KERNEL = {"view", "_unsafe_view", "reshape", "split", "split_with_sizes", "slice", "select",
             "as_strided", "detach", "t", "transpose", "unsqueeze", "squeeze", "expand",
             "permute", "alias", "unbind", "lift_fresh", "empty", "empty_strided",
             "_reshape_alias", "unflatten", "flatten", "contiguous", "view_as", "empty_like",
             "new_empty", "new_empty_strided", "_to_copy_meta"}


class OpCounter(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: collections.Counter[str] = collections.Counter()
        self.steps = 0
        self.active = False                # inside a counted step (Triton launches count)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        out = func(*args, **(kwargs or {}))
        # (an out-of-place op that hands back its input, as `.to` to the same dtype: no kernel)
        if name not in NO_KERNEL and not (args and out is args[0] and not name.endswith("_")):
            self.ops[name] += 1
        return out


def _count_triton(counter: OpCounter) -> None:
    """Count each Triton kernel launch of mox's kernel modules as one op."""
    from mox.kernels import attention_triton, moe_align, moe_triton, triton_ops
    for module in (attention_triton, moe_align, moe_triton, triton_ops):
        for name in dir(module):
            fn = getattr(module, name)
            if name.startswith("_") and name.endswith("_kernel") and hasattr(fn, "__getitem__"):
                setattr(module, name, _Counted(fn, name, counter))


class _Counted:
    def __init__(self, fn, name: str, counter: OpCounter) -> None:
        self.fn, self.name, self.counter = fn, name, counter

    def __getitem__(self, grid):
        launch = self.fn[grid]

        def run(*args, **kwargs):
            if self.counter.active:
                self.counter.ops["triton:" + self.name] += 1
            with _disable_current_modes():          # (the interpreter's own torch calls)
                return launch(*args, **kwargs)
        return run


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
        counter = OpCounter()
        _count_triton(counter)
        prompts = [[1 + i, 2, 3] for i in range(args.seqs)]
        llm.generate(prompt_token_ids=prompts, max_tokens=2, temperature=0.0, ignore_eos=True)
        original = model._table_stream

        def counted(x, batch, hold, used):
            if batch.key_ranges is None:                      # (a prefill: not counted)
                return original(x, batch, hold, used)
            counter.steps += 1
            counter.active = True
            try:
                with counter:
                    return original(x, batch, hold, used)
            finally:
                counter.active = False
        model._table_stream = counted
        # one prefill, then one decode step: its layers counted
        llm.generate(prompt_token_ids=prompts, max_tokens=2, temperature=0.0, ignore_eos=True)
        steps = counter.ops
    assert counter.steps == 1, counter.steps
    layers = model.spec.num_layers
    total = sum(steps.values())
    print(f"{args.arch}, {args.dtype}, {args.seqs} sequences: {total} kernels in the step's "
          f"layers, {total / layers:.1f} a layer ({layers} layers)")
    for name, count in steps.most_common():
        print(f"  {count / layers:6.2f} / layer  {name}")


if __name__ == "__main__":
    main()
