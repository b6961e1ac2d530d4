"""The instruments, apart from the library: the command-line programs (``python -m cp_compile demo``,
``bench``, ``accuracy``, ``generate``, ``step``, ``models``), the local rank pool that the commands, the tests
and the documentation run on (``launch``), the reference Llama (``llama``), memory probes (``memory``) and the
profile breakdown of a step (``breakdown``). ``import cp_compile`` imports none of them."""
