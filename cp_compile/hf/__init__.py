"""Hugging Face transformers: ``attn_implementation="cp_compile"``, a sharded KV cache, and generation.

``import cp_compile.hf`` registers, here and nowhere else, through transformers' and torch's documented
extension points:

- the attention function ``attention`` (``attention.py``) and the mask function ``mask`` (``masks.py``) under the
  name ``"cp_compile"`` with ``transformers.AttentionInterface`` and ``AttentionMaskInterface``;
- with ``plan.while_active``, a global module forward pre-hook and forward hook, installed when the first
  plan is entered (``checks.py``): checks on a whole model call (global positions, labels, a model that
  never reaches attention), and the record of the calls made inside the plan (``forward.py``);
- with ``plan.while_active``, the token mixers of the hybrid families (short convolutions, Gated DeltaNet /
  KDA, Mamba2; ``mixers.py``): their modeling modules' mixer functions, the ones transformers' kernel hub
  swaps, wrapped when a plan is entered, calling the original unchanged outside every plan;
- per-module forward hooks on the modules of the families that mix tokens in code of their own (MiniMax's
  lightning attention, RecurrentGemma's recurrent blocks, RWKV, xLSTM, OpenAI GPT's attention; ``gathered.py``),
  put on a model's modules before its first call under a plan: such a module runs over the gathered sequence.

What each family needs besides attention is one record in ``families.py``.

``ContextParallelMixin`` (``trainer.py``) trains a ``Trainer`` or TRL's ``SFTTrainer`` or ``DPOTrainer`` under CP
(``batch.py``: a token-level batch sharded; ``rows.py``: padded rows scored by the trainer itself).
``ShardedCache`` (``cache.py``) keeps each rank's share of the K/V; ``generate`` (``generate.py``) runs
``model.generate`` with the prompt prefilled sharded over the plan.
"""

try:
    import transformers  # noqa: F401
except ImportError as e:  # pragma: no cover - depends on the environment
    raise ImportError("cp_compile.hf needs transformers >= 5 (pip install 'cp_compile[hf]')") from e

from transformers import AttentionInterface, AttentionMaskInterface

from ..active import while_active
from .attention import attention
from .cache import ShardedCache
from .checks import model_call_checks, prepare
from .generate import generate, sharded_prefill
from .masks import NAME, mask
from .mixers import mixers_under_plans
from .trainer import ContextParallelMixin

AttentionInterface.register(NAME, attention)
AttentionMaskInterface.register(NAME, mask)
while_active(model_call_checks)
while_active(mixers_under_plans)

__all__ = [
    "NAME",
    "ContextParallelMixin",
    "ShardedCache",
    "attention",
    "generate",
    "mask",
    "prepare",
    "sharded_prefill",
]
