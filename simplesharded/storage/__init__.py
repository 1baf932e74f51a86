"""Where a sharded parameter lives, and everything that depends on it.

Two storages, chosen by ``data_parallel(..., storage=...)``: one DTensor shard per parameter
(``"param"``: the compiler-bucketing path and the reference) and ragged buckets
(``"ragged"``: zero-copy buckets whose members are still the model's parameters,
docs/zero_copy.md). What differs between them (the read and gather, the gradient's
accumulator and reduction, state-dict conversion, init, eager resharding) lives in this
package, and nothing outside it asks which storage a parameter has
(tests/test_structure.py checks that by AST).

The record of a sharded parameter is the bottom (sharded_state.py): it imports no module
above it.
"""
