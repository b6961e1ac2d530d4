"""Command line: ``python -m cp_compile demo``, ``bench``, ``accuracy``, ``generate``, ``step``, ``models`` and
``mixers`` and ``indexed``."""

import argparse
import sys

from .tools import bench, demo, generate
from .tools.bench import accuracy, step


def _models():
    from .tools.bench import models  # imports transformers' model registry only when asked

    return models


def _mixers():
    from .tools.bench import mixers  # imports transformers' scan bodies only when asked

    return mixers


def _indexed():
    from .tools.bench import indexed

    return indexed


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m cp_compile", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    demo.add_arguments(
        sub.add_parser("demo", help="CP training (or ring attention) on local ranks, checked against one device")
    )
    bench.add_arguments(sub.add_parser("bench", help="time ours vs PyTorch's ring vs one device; JSON + PNG"))
    accuracy.add_arguments(
        sub.add_parser(
            "accuracy", help="each schedule's error against fp64 as C grows, as a ratio to one device's; JSON + PNG"
        )
    )
    generate.add_arguments(
        sub.add_parser(
            "generate",
            help="Hugging Face generate under CP vs one process: "
            "tokens, prefill tokens/s, decode ms/token, cache memory",
        )
    )
    step.add_arguments(
        sub.add_parser(
            "step",
            help="a Hugging Face training step under CP vs one process by sequence "
            "length: ms per step, its breakdown, where CP starts to pay",
        )
    )
    sub_models = sub.add_parser(
        "models",
        help="every decoder-only causal-LM family of the installed transformers "
        "under CP vs one process: train step and generation; table, JSON, "
        "Markdown",
    )
    _models().add_arguments(sub_models)
    sub_mixers = sub.add_parser(
        "mixers",
        help="a hybrid layer's convolution and scans under CP vs one process by route: ms, bytes, the cost "
        "model's pick and crossover",
    )
    _mixers().add_arguments(sub_mixers)
    _indexed().add_arguments(
        sub.add_parser(
            "indexed",
            help="an indexed sparse-attention layer's (DSA) indexer and attention under CP vs one process: ms, bytes",
        )
    )
    args = parser.parse_args(argv)
    if args.command == "demo":
        return demo.main(args)
    if args.command == "bench":
        return bench.main(args)
    if args.command == "accuracy":
        return accuracy.main(args)
    if args.command == "generate":
        return generate.main(args)
    if args.command == "step":
        return step.main(args)
    if args.command == "models":
        return _models().main(args)
    if args.command == "mixers":
        return _mixers().main(args)
    if args.command == "indexed":
        return _indexed().main(args)
    return 2


if __name__ == "__main__":
    sys.exit(main())
