"""``generate()``'s decoding loop for a model of linear layers alone, continued from a sharded prefill's state.

``generate()`` slices the prompt by the cache's length only when some layer has one; a recurrent state has none,
so it would feed the whole prompt again. ``continue_prefilled`` (passed as ``custom_generate`` by
``cp_compile.hf.generate``) runs transformers' own loop from the prompt's last token instead.
"""

from __future__ import annotations

import torch
from torch import Tensor


class _SeesWholeSequence:
    """A logits processor list or stopping criteria list called with the prompt's prefilled tokens put back in
    front of the ids it is given, so that what reads the sequence (repetition penalties, lengths, a user's own
    rules) sees what one process's ``generate`` shows it."""

    def __init__(self, inner, prefix: Tensor):
        self.inner, self.prefix = inner, prefix

    def __call__(self, input_ids: Tensor, scores: Tensor, **kwargs):
        return self.inner(torch.cat([self.prefix, input_ids], 1), scores, **kwargs)

    def __iter__(self):
        return iter(self.inner)

    def __len__(self) -> int:
        return len(self.inner)

    @property
    def max_length(self):
        return self.inner.max_length


def continue_prefilled(
    model,
    input_ids,
    logits_processor,
    stopping_criteria,
    generation_config,
    synced_gpus=False,
    streamer=None,
    **model_kwargs,
):
    """``generate()``'s decoding loop (passed as its ``custom_generate``) for a model of linear layers alone,
    whose cache holds the state after all but the prompt's last token.

    ``generate()`` slices the prompt by the cache's length only when some layer has one; a recurrent state has
    none, so it would feed the whole prompt again. transformers' own loop runs here from the last prompt token
    instead, with processors and criteria built for the whole prompt; the prefix goes back on the result."""
    prefix = input_ids[:, :-1]
    if model_kwargs.get("attention_mask") is not None:  # all ones (checked): one column per token fed
        model_kwargs["attention_mask"] = model_kwargs["attention_mask"][:, -1:]
    result = type(model)._sample(
        model,
        input_ids[:, -1:],
        logits_processor=_SeesWholeSequence(logits_processor, prefix),
        stopping_criteria=_SeesWholeSequence(stopping_criteria, prefix),
        generation_config=generation_config,
        synced_gpus=synced_gpus,
        streamer=streamer,
        **model_kwargs,
    )
    if isinstance(result, Tensor):
        return torch.cat([prefix, result], 1)
    result.sequences = torch.cat([prefix, result.sequences], 1)
    return result
