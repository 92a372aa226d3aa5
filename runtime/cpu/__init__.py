"""CPU serving: which vector path this CPU takes and what it computes natively (`isa`, `features`),
the C kernels built on the serving machine and their bindings (`native`), the weight-only and
dense linears that replace the model's on CPU, the fused elementwise ops and the crossovers timed
between them (`crossover`), the batch-invariant module swap of `--deterministic`, and the compiled
step: its cache (`step_cache`), its loading (`compiled_step`) and the `--arch cpu` bundle
(`bundle_loading`). The engine imports this package; it imports nothing of the engine."""
