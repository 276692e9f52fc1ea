"""The Hebrus reference model: parameterised layers and the graph that orders them into stages.

Layers know nothing about banks: a stage reads public state and writes private state through
the transaction it is given.
"""
