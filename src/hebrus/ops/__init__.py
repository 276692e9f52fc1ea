"""Pure tensor functions: state in, (output, state out) back; nothing here writes its inputs.

Each batched ("fast") function has a per-token twin it is tested against.
"""
