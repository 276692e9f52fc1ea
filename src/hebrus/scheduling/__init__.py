"""The serving engine loop (`scheduler`) and the prefix cache it keeps (`prefix`): requests of
token ids in, events out; nothing here knows HTTP."""
