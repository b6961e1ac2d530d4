"""Command line: ``python -m cp_compile demo``, ``bench``, ``accuracy``, ``generate``, ``generate-batch``, ``step``,
``models``, ``scale``, ``mixers``, ``indexed`` and ``gpu-check``."""

import argparse
import sys

from .tools import bench, demo, generate, generate_batch, gpu_check
from .tools.bench import accuracy, indexed, mixers, models, scaling, step

# command -> (its module, its help); each module gives add_arguments(parser) and main(args)
COMMANDS = {
    "demo": (demo, "CP training (or ring attention) on local ranks, checked against one device"),
    "bench": (bench, "time ours vs PyTorch's ring vs one device; JSON + PNG"),
    "accuracy": (
        accuracy,
        "each schedule's error against fp64 as C grows, as a ratio to one device's; JSON + PNG",
    ),
    "generate": (
        generate,
        "Hugging Face generate under CP vs one process: tokens, prefill tokens/s, decode ms/token, cache memory",
    ),
    "generate-batch": (
        generate_batch,
        "a batch of left-padded prompts generated together under CP vs one process: tokens, seconds, K/V per rank",
    ),
    "step": (
        step,
        "a Hugging Face training step under CP vs one process by sequence length: ms per step, its breakdown, "
        "where CP starts to pay",
    ),
    "models": (
        models,
        "every decoder-only causal-LM family of the installed transformers under CP vs one process: train step "
        "and generation; table, JSON, Markdown",
    ),
    "scale": (
        scaling,
        "each family's training step at C = 1, 2, 4 against one process, by route: ms per step and activations "
        "saved per rank",
    ),
    "mixers": (
        mixers,
        "a hybrid layer's convolution and scans under CP vs one process by route: ms, bytes, the cost model's pick "
        "and crossover",
    ),
    "indexed": (
        indexed,
        "an indexed sparse-attention layer's (DSA) indexer and attention under CP vs one process: ms, bytes",
    ),
    "gpu-check": (
        gpu_check,
        "on a machine with one GPU: the CUDA tier and the GPU benchmark under one time cap, one JSON report "
        "(--dry-run: the same on the CPU)",
    ),
}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m cp_compile", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    for command, (module, help_text) in COMMANDS.items():
        module.add_arguments(sub.add_parser(command, help=help_text))
    args = parser.parse_args(argv)
    return COMMANDS[args.command][0].main(args)


if __name__ == "__main__":
    sys.exit(main())
