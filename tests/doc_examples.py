"""Runs the Python blocks of README.md and docs/ (a pytest plugin built on Sybil).

A page is executed like a script, top to bottom; a renamed argument or a
changed result fails the suite instead of a reader.

- A ``python`` block runs in the test process, in the namespace its page's
  earlier blocks built.
- ``<!-- docs: ranks=N -->`` starts a new script on N local gloo ranks, as
  ``torchrun --nproc-per-node N`` starts one: every rank has RANK,
  LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, MASTER_ADDR and MASTER_PORT set
  and no process group until the script creates one. The page's next blocks
  run on every rank, in that script's namespace, until the next directive.
  The ranks are a pool that outlives the pages (``cp_compile.tools.launch.RankPool``).
- ``<!-- invisible-code-block: python ... -->`` (Sybil's) runs code the
  reader does not see: checks of what the example computed.
- ``<!-- skip: next "reason" -->`` (Sybil's) skips a block that cannot run
  here (CUDA, several nodes), with the reason pytest reports.
"""

from __future__ import annotations

import itertools
import os
import re
import shutil
import tempfile
from pathlib import Path

from sybil import Sybil
from sybil.evaluators.python import PythonEvaluator, pad
from sybil.parsers.markdown import PythonCodeBlockParser, SkipParser
from sybil.parsers.markdown.lexers import DirectiveInHTMLCommentLexer

from cp_compile.tools.launch import RankPool, free_port

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = "__docs_script__"  # in a page's namespace: (ranks, script id) of the script its blocks run in
BLOCK_TIMEOUT = 900.0  # seconds; a block that compiles a model takes tens of seconds on 2 cores

# ----------------------------------------------------------------------------
# On the ranks: one namespace per script.
# ----------------------------------------------------------------------------

_scripts: dict[str, dict] = {}


def start_script(script: str, port: int) -> None:
    """A fresh process state, as far as a script can tell: no group, no compiled code, an empty namespace."""
    import torch
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()
    torch._dynamo.reset()
    os.environ["MASTER_PORT"] = str(port)
    shutil.rmtree(_page_files(), ignore_errors=True)
    _scripts.clear()
    _scripts[script] = {"__name__": "__main__"}


def run_block(script: str, source: str, path: str) -> None:
    exec(compile(source, _as_python(path, source), "exec"), _scripts[script])


def _page_files() -> Path:
    """Where this rank writes the pages it runs as Python files (``_as_python``)."""
    return Path(tempfile.gettempdir()) / f"cp_compile_docs_{os.getpid()}"


def _as_python(path: str, source: str) -> str:
    """A Python file that holds the page's blocks so far at their lines in the page: tools that read a
    function's source from its file (inspect, Dynamo's logs, depyf) must not meet the page's Markdown."""
    target = _page_files() / (Path(path).name + ".py")
    lines = target.read_text().splitlines(keepends=True) if target.exists() else []
    block = source.splitlines(keepends=True)
    lines += ["\n"] * (len(block) - len(lines))
    for i, line in enumerate(block):
        if line.strip():
            lines[i] = line
    target.parent.mkdir(exist_ok=True)
    target.write_text("".join(lines))
    return str(target)


def end_script(script: str) -> None:
    import torch.distributed as dist

    _scripts.pop(script, None)
    shutil.rmtree(_page_files(), ignore_errors=True)
    if dist.is_initialized():
        dist.destroy_process_group()


# ----------------------------------------------------------------------------
# In the test process.
# ----------------------------------------------------------------------------

_pools: dict[int, RankPool] = {}
_caches: list[str] = []  # the pools' Inductor cache directories, removed with the pools
_ids = itertools.count()


def _pool(ranks: int) -> RankPool:
    if ranks not in _pools:
        cache = tempfile.mkdtemp(prefix="cp_compile_docs_inductor_")
        _caches.append(cache)
        _pools[ranks] = RankPool(ranks, init_group=False, env={"TORCHINDUCTOR_CACHE_DIR": cache})
    return _pools[ranks]


def _directive(example) -> None:
    match = re.fullmatch(r"\s*ranks=(\d+)\s*", example.parsed or "")
    if match is None:
        raise ValueError(f"unknown docs directive {example.parsed!r}; expected 'docs: ranks=N'")
    _end(example.namespace)
    ranks = int(match.group(1))
    script = f"{example.path}:{example.line}:{next(_ids)}"
    _pool(ranks).run(start_script, script, free_port(), timeout=BLOCK_TIMEOUT)
    example.namespace[SCRIPT] = (ranks, script)


def _end(namespace: dict) -> None:
    if SCRIPT in namespace:
        ranks, script = namespace.pop(SCRIPT)
        _pool(ranks).run(end_script, script, timeout=BLOCK_TIMEOUT)


class _DirectiveParser:
    def __init__(self):
        self.lexer = DirectiveInHTMLCommentLexer(directive="docs")

    def __call__(self, document):
        for region in self.lexer(document):
            region.parsed = region.lexemes["arguments"]
            region.evaluator = _directive
            yield region


_local = PythonEvaluator()


def _python(example) -> None:
    """A block: on the page's ranks if a script is running there, else here."""
    if SCRIPT not in example.namespace:
        return _local(example)
    ranks, script = example.namespace[SCRIPT]
    source = pad(example.parsed, example.line + example.parsed.line_offset)
    _pool(ranks).run(run_block, script, source, str(example.path), timeout=BLOCK_TIMEOUT)


class _PythonParser(PythonCodeBlockParser):
    def __call__(self, document):
        for region in super().__call__(document):
            if isinstance(region.evaluator, PythonEvaluator):  # doctest regions keep theirs
                region.evaluator = _python
            yield region


pytest_collect_file = Sybil(
    parsers=[_DirectiveParser(), _PythonParser(), SkipParser()],
    patterns=["README.md", "docs/*.md", "docs/*/*.md"],
    path=str(ROOT),
    teardown=_end,
).pytest()


def pytest_sessionfinish(session):
    for pool in _pools.values():
        pool.close()
    _pools.clear()
    for cache in _caches:
        shutil.rmtree(cache, ignore_errors=True)
    _caches.clear()
