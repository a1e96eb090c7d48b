"""Structured outputs: grammars compiled with xgrammar, enforced as a token bitmask.

Scheduler side (engine-core process): ``StructuredOutputManager`` compiles a request's
constraint into a grammar (cached by its canonical key), keeps one ``GrammarMatcher`` per
request, fills one bitmask row per request that samples in a step
(``SchedulerOutput.grammar_bitmask``) and advances the matcher with the accepted tokens
(``Scheduler.update_from_output``). Worker side: ``apply_grammar_bitmask`` (``bitmask.py``,
plain torch, no xgrammar) sets the logits of disallowed tokens to ``-inf`` before sampling.
The approach is XGrammar's (Dong et al., arXiv:2411.15100), as vLLM and SGLang use it.

Requests without a constraint never touch this package (it is imported on the first one).
"""

from kvserve.structured_output.bitmask import apply_grammar_bitmask, bitmask_width

__all__ = ["apply_grammar_bitmask", "bitmask_width"]
