"""agora: Protocol Learning -- pretrain language models on a swarm of independently owned peers.

Layers, each importing only from itself and those before it: ``config`` -> building blocks (``model``, ``wire``,
``data``, ``hf``, ``optim``, ``compression``, ``sentinel``, ``trust``) -> ``net`` (RPCs, DHT) -> ``client``
(calling the pipeline) -> ``server`` (stage servers) -> ``ops`` -> ``roles`` -> ``lab`` -> ``bench`` -> ``cli``.
Map of every module: docs/ARCHITECTURE.md.
"""

__version__ = "0.1.0"
