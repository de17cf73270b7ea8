"""Command-line tools: ``sdc-guard`` / ``python -m sdc_guard`` (``cli``), the benchmarks
(``bench*``), the demo, the self-test and the small GPT they train (``toy_gpt``; also
``sdc_guard.toy_gpt``)."""
