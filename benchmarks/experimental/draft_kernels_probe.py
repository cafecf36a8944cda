"""Probe, not a benchmark of record: every CUDA kernel of one draft step in launch order, with its median kernel time
over `CALLS` profiled calls, in a replay of the step's CUDA graph and called outside a graph (as `draft_step.py`'s
per-GEMM tables profile it), each after an L2 flush, per compiled variant of `benchmarks/draft_step.py` and context
length; where the step's time outside the GEMMs goes, kernel by kernel, so that each line can be matched to
Inductor's generated code (run with `TORCH_LOGS=output_code`, which writes that code to stderr).

    TORCH_LOGS=output_code python3 benchmarks/experimental/draft_kernels_probe.py > probe.md 2> output_code.log
"""

import argparse
import copy
import statistics
import sys
from functools import partial
from pathlib import Path

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from _timing import graphed, median_us
from draft_step import HAND, QWEN3_8B, UNBATCHED, HandStackedDraft, build_draft, draft_inputs, short_kernel_name

import dspark_fx

CALLS = 5


def _profiled_kernels(call) -> list:
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        call()
        torch.cuda.synchronize()
    return sorted((e for e in prof.events() if e.device_type == DeviceType.CUDA), key=lambda e: e.time_range.start)


def kernel_sequence(call, before=lambda: None) -> list[tuple[str, float]]:
    """`(name, µs)` of each kernel one `call()` launches, in launch order: the median over `CALLS` calls, each
    profiled alone after three warm-up calls and after `before()` (outside the profile); the first call's times if
    the calls launched different kernels."""
    with torch.no_grad():
        for _ in range(3):
            call()
        torch.cuda.synchronize()
        calls = []
        for _ in range(CALLS):
            before()
            calls.append(_profiled_kernels(call))
    names = [k.name for k in calls[0]]
    if any([k.name for k in call] != names for call in calls):
        print("(the profiled calls launched different kernels: the first call's times)")
        calls = calls[:1]
    return [(name, statistics.median(c[i].time_range.elapsed_us() for c in calls)) for i, name in enumerate(names)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--contexts", type=int, nargs="+", default=[16, 512])
    parser.add_argument("--variants", nargs="+", default=["torch.compile", "dspark_backend", HAND, UNBATCHED])
    args = parser.parse_args()
    cfg, dtype = QWEN3_8B, torch.bfloat16
    eager = build_draft(cfg, "cuda", dtype)
    inputs = {ctx: draft_inputs(cfg, ctx, "cuda", dtype) for ctx in args.contexts}
    for _, target_hidden, _, ctx_positions in inputs.values():
        torch._dynamo.maybe_mark_dynamic(target_hidden, 0)
        torch._dynamo.maybe_mark_dynamic(ctx_positions, 0)
    makers = {
        "torch.compile": lambda: torch.compile(copy.deepcopy(eager)),
        "dspark_backend": lambda: torch.compile(copy.deepcopy(eager), backend=dspark_fx.dspark_backend),
        UNBATCHED: lambda: torch.compile(
            copy.deepcopy(eager), backend=dspark_fx.make_backend({"batch_regions": False})
        ),
        HAND: lambda: torch.compile(HandStackedDraft(eager)),
    }
    print(f"GPU {torch.cuda.get_device_name()}, torch {torch.__version__}; kernel µs: median of {CALLS} profiled calls")
    for name in args.variants:
        model = makers[name]()
        for ctx, step_inputs in inputs.items():
            print(f"\n### {name}, context {ctx}", flush=True)
            with torch.no_grad():
                replay = graphed(model, step_inputs)
                replay_us = median_us(replay, "cuda")
            flush = torch.empty(256 << 20, dtype=torch.int8, device="cuda")  # as do_bench clears the L2
            in_graph = kernel_sequence(replay, flush.zero_)
            outside = kernel_sequence(partial(model, *step_inputs), flush.zero_)
            print(
                f"\nreplay {replay_us:.1f} µs per step; in the graph {len(in_graph)} kernels, "
                f"{sum(us for _, us in in_graph):.1f} µs of kernel time; called outside a graph {len(outside)} "
                "kernels, "
                f"{sum(us for _, us in outside):.1f} µs\n"
            )
            if [kernel for kernel, _ in in_graph] == [kernel for kernel, _ in outside]:
                print("| # | kernel | µs in the graph | µs outside |\n|---|---|---|---|")
                for index, ((kernel, us), (_, us_out)) in enumerate(zip(in_graph, outside, strict=True)):
                    print(f"| {index} | `{short_kernel_name(kernel, 110)}` | {us:.1f} | {us_out:.1f} |")
            else:  # not the same kernels (work a graph does once per capture): one table each
                for where, sequence in (("in the graph", in_graph), ("outside", outside)):
                    print(f"\n| # | kernel | µs {where} |\n|---|---|---|")
                    for index, (kernel, us) in enumerate(sequence):
                        print(f"| {index} | `{short_kernel_name(kernel, 110)}` | {us:.1f} |")
            sys.stdout.flush()


if __name__ == "__main__":
    main()
