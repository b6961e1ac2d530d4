"""The errors cp_compile raises on purpose, defined below every layer so that any layer may raise them;
``cp_compile`` exports both."""


class UnsupportedAttention(NotImplementedError):
    """An attention call that CP cannot rewrite exactly."""


class LocalAttentionError(RuntimeError):
    """Plain attention was about to run on this rank's shard alone while a plan is active."""
