"""Structured outputs (JSON schema, regex, choice, EBNF, tool calls) and token healing.

`spec` is the request-side description (plain data, no xgrammar); `grammars` compiles specs
with xgrammar (cached per spec and tokenizer); `constraint` holds the per-request matchers;
`guide` is the engine's side (matcher lifecycle, masks at every place logits become tokens,
drafts included); `healing` backs off a prompt's trailing tokens.
"""
