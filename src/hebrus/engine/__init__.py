"""Runners: how a session's chunk is executed as a transaction. `eager` runs the stages one by
one for any chunk; `graphs` runs one-token steps from a static plan, captured as CUDA graphs on a
GPU. Both drive the same stages through the same transaction (`hebrus.state.txn`)."""
