"""hebrus: a transactional inference runtime for hybrid language models.

A chunk of tokens is one transaction: every persistent value it touches is published together
by one bank flip, or not at all.
"""
from hebrus.models.hebrus import HebrusConfig
from hebrus.errors import (FAULT_KINDS, AllocationError, CheckpointError, ChunkAborted, CommandError,
                           DeviceStatusError, InvalidInput, NonFiniteError, StructuralError)
from hebrus.faults import inject
from hebrus.batching import Batch, feed_many
from hebrus.runtime import Model, load
from hebrus.session import Session
from hebrus.text.entry import generate, stream_generate

__version__ = "0.1.0"

__all__ = [
    "FAULT_KINDS", "AllocationError", "Batch", "CheckpointError", "ChunkAborted", "CommandError", "DeviceStatusError",
    "HebrusConfig", "InvalidInput", "Model", "NonFiniteError", "Session", "StructuralError",
    "feed_many", "generate", "inject", "load", "stream_generate",
]
