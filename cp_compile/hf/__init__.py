"""Hugging Face transformers: ``attn_implementation="cp_compile"``, a sharded KV cache, and generation.

``import cp_compile.hf`` registers, here and nowhere else, through transformers' and torch's documented
extension points:

- the attention function ``attention`` and the mask function ``mask`` (``attention.py``) under the name
  ``"cp_compile"`` with ``transformers.AttentionInterface`` and ``AttentionMaskInterface``;
- with ``plan.while_active``, a global module forward pre-hook and forward hook, installed when the first
  plan is entered (``forward.py``): checks on a whole model call (global positions, labels, a model that
  never reaches attention);
- with ``plan.while_active``, the token mixers of the hybrid families (short convolutions, Gated DeltaNet /
  KDA, Mamba2; ``mixers.py``): their modeling modules' mixer functions, the ones transformers' kernel hub
  swaps, wrapped when a plan is entered, calling the original unchanged outside every plan;
- per-module forward hooks on the modules of the families that mix tokens in code of their own (MiniMax's
  lightning attention, RecurrentGemma's recurrent blocks, RWKV, xLSTM, OpenAI GPT's attention; ``gathered.py``),
  put on a model's modules before its first call under a plan: such a module runs over the gathered sequence.

``ContextParallelMixin`` (``trainer.py``) trains a ``Trainer`` or TRL ``SFTTrainer`` under CP.
``ShardedCache`` (``cache.py``) keeps each rank's share of the K/V; ``generate`` (``generate.py``) runs
``model.generate`` with the prompt prefilled sharded over the plan.
"""

try:
    import transformers  # noqa: F401
except ImportError as e:  # pragma: no cover - depends on the environment
    raise ImportError("cp_compile.hf needs transformers >= 5 (pip install 'cp_compile[hf]')") from e

from transformers import AttentionInterface, AttentionMaskInterface

from ..active import while_active
from ..inference.hf_cache import ShardedCache
from .attention import NAME, attention, mask
from .forward import model_call_checks
from .gathered import hook_gathered_modules  # noqa: F401  (prepares the models it runs over the gathered sequence)
from .generate import generate, sharded_prefill
from .indexed import hook_indexers  # noqa: F401  (prepares the models whose sparse-attention indexers run under CP)
from .mixers import mixers_under_plans
from .trainer import ContextParallelMixin

AttentionInterface.register(NAME, attention)
AttentionMaskInterface.register(NAME, mask)
while_active(model_call_checks)
while_active(mixers_under_plans)

__all__ = ["NAME", "ContextParallelMixin", "ShardedCache", "attention", "generate", "mask", "sharded_prefill"]
