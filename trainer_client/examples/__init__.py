"""Examples that the demo, the benchmark, the tests and the recovery work reuse.

- :mod:`trainer_client.examples.gpt`: a small GPT-style model split into stages, a deterministic
  synthetic token dataset, static pipeline I/O examples, optimizer and scheduler builders.
- :mod:`trainer_client.examples.train_pipeline`: one stage's training script (the loop of
  docs/training-contract.md + measurement knobs), runnable with ``python -m``;
  :mod:`trainer_client.examples.train_resilient`
  trains the same stage through ``ResilientLoop``; :mod:`trainer_client.examples.common` holds the
  command line and configs both share.
- :mod:`trainer_client.examples.minimal_resilient`: the template for a script of one's own.
- :mod:`trainer_client.examples.factories`: the example GPT's stage factory and data source for a
  replay (``--model trainer_client.examples.factories:gpt_stage``).
- :mod:`trainer_client.examples.launch`: host a TCPStore and run every stage as its own process.
"""
