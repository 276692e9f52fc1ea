"""The device-side checks the layers make, each a bit of a stage's status word: the model's
vocabulary of what can go out of range. `state.status` carries the bits without knowing them."""
from __future__ import annotations

import enum


class Check(enum.IntFlag):
    TOKEN_RANGE = 1 << 0      # a token id outside the vocabulary reached the device
    HASH_RANGE = 1 << 1       # an n-gram bucket index outside its table
    INDEX_RANGE = 1 << 2      # attention selected a row the query may not see
    ROUTE_RANGE = 1 << 3      # a route names an expert that does not exist
