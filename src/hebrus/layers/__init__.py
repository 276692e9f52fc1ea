"""The layers: the frame (embedding, residual, norms, head: `graph`, `sublayer`, `hyper`), one
module per layer kind, each declaring everything about itself (`kind`), and the tables built
from them (`owners`, `layout`). Layers know nothing about banks: a stage reads public state and
writes private state through the transaction it is given.

The registry: importing a kind's module registers it; one line a kind.
"""
from hebrus.layers import gdn  # noqa: F401                  Gated DeltaNet
from hebrus.layers import attention  # noqa: F401            attention, qsa
from hebrus.layers import kda  # noqa: F401                  Kimi delta attention
from hebrus.layers import mla  # noqa: F401                  multi-head latent attention
from hebrus.layers import v4_attention  # noqa: F401         DeepSeek-V4's swa, hca, csa
from hebrus.layers import moe  # noqa: F401                  routed experts
from hebrus.layers import hash_moe  # noqa: F401             hash-routed experts
from hebrus.layers import mlp  # noqa: F401                  the dense MLP
from hebrus.layers import ple  # noqa: F401                  per-layer embeddings
